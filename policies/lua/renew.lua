-- renew.lua: set a live lease's (and its reservation's) expiry to now + ttl (after lib.lua).
-- ARGV: request_id, lease_ttl_us. Returns 1, or 0 if unknown, settled or expired.
local rid, ttl = ARGV[1], tonumber(ARGV[2])
local now = now_us()
sweep(now)
if not live_expiry(rid, now) then return 0 end
redis.call('ZADD', K_LEASES, 'XX', int(now + ttl), rid)
redis.call('PEXPIRE', K_LEASES, int(KEEP_MS + math.ceil(ttl / 1000)))
redis.call('PEXPIRE', K_STARTS, int(KEEP_MS + math.ceil(ttl / 1000)))
redis.call('PEXPIRE', K_RESV, int(KEEP_MS + math.ceil(ttl / 1000)))
return 1

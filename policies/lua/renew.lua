-- renew.lua: set live leases' expiry to now + ttl (after lib.lua), all of one tenant's
-- in one call: the renewal beat makes one round trip per tenant, not one per request.
-- ARGV: lease_ttl_us, request_id... Returns one 1 per id, or 0 if unknown, settled or
-- expired. The keys' own TTLs are not touched: reserve set them 40 days past its write,
-- which outlives any lease it renews.
local ttl = tonumber(ARGV[1])
local now = now_us()
sweep(now)
local out = {}
for i = 2, #ARGV do
  local rid = ARGV[i]
  if live_expiry(rid, now) then
    redis.call('ZADD', K_LEASES, 'XX', int(now + ttl), rid)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out

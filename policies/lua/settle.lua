-- settle.lua: close a reservation with its actual cost, once (after lib.lua).
-- ARGV: request_id, actual_tokens. Returns 1, or 0 (and changes nothing) if the id is not
-- an open reservation: never reserved, settled already, or expired and released.
-- The TPM bucket gets back (reserved - actual), capped at capacity; a negative difference
-- (an under-reported bound) is charged, possibly into debt. A settle that used tokens is a
-- sample of how long the tenant's requests hold a slot (observe_hold).
local rid, actual = ARGV[1], tonumber(ARGV[2])
local now = now_us()
sweep(now)
local rec = redis.call('HGET', K_RESV, rid)
local expiry = rec and live_expiry(rid, now)
if not expiry then return 0 end
local tokens, charged = string.match(rec, '^(%S+) %S+ %S+ (%S+)$')
tokens, charged = tonumber(tokens), tonumber(charged)
if charged >= 0 then
  local cap = tonumber(redis.call('HGET', K_BUCKET, 'tpm_cap')) or charged
  local level = math.min(level_of('tpm', cap, now) + (tokens - actual) * US, cap * US)
  save_buckets(now, {{'tpm', level, cap}})
end
local began = redis.call('ZSCORE', K_STARTS, rid)
if actual > 0 and began then observe_hold(now - tonumber(began)) end
close(rid, rec, actual, expiry + DAY_US)  -- expiry > now: the lease is live
return 1

-- usage.lua: a tenant's counters after the sweep (after lib.lua; a backlog the sweep left
-- still counts as reserved, not used, until later calls release it).
-- Returns {reserved day, reserved month, used day, used month, requests day, live leases,
--          tokens drawn from the TPM bucket (-1: no bucket), reason1, n1, reason2, n2, ...}
-- (rejects of today, UTC).
local now = now_us()
sweep(now)
local p = periods(now)
local d, m = 'd:' .. p.day, 'm:' .. p.month
local c = redis.call('HMGET', K_BUDGET, d .. ':r', m .. ':r', d .. ':u', m .. ':u', d .. ':n')
local out = {}
for i = 1, 5 do out[i] = tonumber(c[i]) or 0 end
out[6] = live_leases(now)
local cap = tonumber(redis.call('HGET', K_BUCKET, 'tpm_cap'))
out[7] = cap and math.ceil((cap * US - level_of('tpm', cap, now)) / US) or -1
local all = redis.call('HGETALL', K_BUDGET)
local x = d .. ':x:'
for i = 1, #all, 2 do
  if string.sub(all[i], 1, #x) == x then
    out[#out + 1] = string.sub(all[i], #x + 1)
    out[#out + 1] = tonumber(all[i + 1])
  end
end
return out

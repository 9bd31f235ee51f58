-- reserve.lua: one atomic admission decision (after lib.lua).
-- ARGV: request_id, tokens, lease_ttl_us, tpm, rpm, tokens_per_day, tokens_per_month,
--       max_concurrency (each limit -1 = unlimited).
-- Returns {-1} if the id was reserved before, else
--   {granted 1|0, denied_by ('' if granted), retry_us (-1 never),
--    rpm remaining, rpm reset_us, tpm remaining, tpm reset_us}  (-1: no such bucket)
-- Grants take everything; denials take nothing but a reject count.
local rid, cost, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local tpm, rpm = tonumber(ARGV[4]), tonumber(ARGV[5])
local tpd, tpmo, cmax = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local now = now_us()
sweep(now)
local p = periods(now)
if redis.call('HGET', K_BUDGET, 'day') ~= tostring(p.day) then  -- a new day: prune
  for _, f in ipairs(redis.call('HKEYS', K_BUDGET)) do
    local kind, n = string.match(f, '^(%a):(%d+)')
    n = tonumber(n)
    if (kind == 'd' and n < p.keep_day) or (kind == 'm' and n < p.keep_month) then
      redis.call('HDEL', K_BUDGET, f)
    end
  end
  redis.call('HSET', K_BUDGET, 'day', tostring(p.day))
end
local forget_at = redis.call('ZSCORE', K_DONE, rid)  -- due but not yet swept: forgotten
if redis.call('HEXISTS', K_RESV, rid) == 1 or (forget_at and tonumber(forget_at) > now) then
  return {-1}
end

local d, m = 'd:' .. p.day, 'm:' .. p.month
local c = redis.call('HMGET', K_BUDGET, d .. ':r', d .. ':u', m .. ':r', m .. ':u')
local day_total = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0)
local month_total = (tonumber(c[3]) or 0) + (tonumber(c[4]) or 0)
local tl, rl  -- bucket levels, nil = unlimited

local denied, worst = nil, -1  -- the binding limit: longest wait, never (nil) longest of all
local function check(name, wait)
  if wait == 0 then return end
  local w = wait or math.huge
  if w > worst then denied, worst = name, w end
end
if tpm >= 0 then tl = level_of('tpm', tpm, now); check('tokens_per_minute', wait_us(tl, tpm, cost)) end
if rpm >= 0 then rl = level_of('rpm', rpm, now); check('requests_per_minute', wait_us(rl, rpm, 1)) end
if tpd >= 0 and day_total + cost > tpd then
  check('tokens_per_day', cost <= tpd and p.day_end - now or nil)
end
if tpmo >= 0 and month_total + cost > tpmo then
  check('tokens_per_month', cost <= tpmo and p.month_end - now or nil)
end
if cmax >= 0 and live_leases(now) >= cmax then  -- expired, unswept leases hold no slot
  local first = first_live_expiry(now)
  local wait = nil
  if cmax > 0 and first then  -- predicted from the oldest lease's age, at most its expiry
    wait = hold_wait(oldest_live_age(now), first - now)
  end
  check('max_concurrency', wait)
end

local granted = 0
if denied then
  redis.call('HINCRBY', K_BUDGET, d .. ':x:' .. denied, 1)
else
  granted = 1
  if tl then tl = tl - cost * US end
  if rl then rl = rl - US end
  save_buckets(now, {{'tpm', tl, tpm}, {'rpm', rl, rpm}})
  redis.call('HINCRBY', K_BUDGET, d .. ':r', int(cost))
  redis.call('HINCRBY', K_BUDGET, d .. ':n', 1)
  redis.call('HINCRBY', K_BUDGET, m .. ':r', int(cost))
  redis.call('ZADD', K_LEASES, int(now + ttl), rid)
  redis.call('ZADD', K_STARTS, int(now), rid)
  redis.call('HSET', K_RESV, rid, int(cost) .. ' ' .. p.day .. ' ' .. p.month .. ' ' .. int(tpm))
  -- resv, leases and starts hold the same ids (written and closed together)
  keep({K_RESV, K_LEASES, K_STARTS}, KEEP_MS + math.ceil(ttl / 1000))
end
keep({K_BUDGET}, KEEP_MS)

local function rate(level, cap)
  if not level then return -1, -1 end
  return math.max(0, math.floor(level / US)), reset_us(level, cap)
end
local rrem, rreset = rate(rl, rpm)
local trem, treset = rate(tl, tpm)
local retry = -1
if denied and worst ~= math.huge then retry = worst end
return {granted, denied or '', retry, rrem, rreset, trem, treset}

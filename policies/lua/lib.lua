-- lib.lua: shared by every Sluice quota script; RedisStore prepends it to each script.
--
-- Every script receives the same KEYS, all hash-tagged {tenant} (one Cluster slot) and
-- all declared, so that no script touches a key it did not declare:
--   KEYS[1] bucket  HASH  tpm_lvl tpm_ts tpm_cap rpm_lvl rpm_ts rpm_cap
--   KEYS[2] budget  HASH  d:<YYYYMMDD>:r|u|n|x:<limit>   m:<YYYYMM>:r|u   day
--   KEYS[3] leases  ZSET  request id -> expiry (µs)
--   KEYS[4] resv    HASH  request id -> "tokens day month tpm_cap" (tpm_cap -1: not charged)
--   KEYS[5] done    ZSET  request id -> forget-at (µs): closed ids, refused by reserve
--   KEYS[6] starts  ZSET  request id -> reserved-at (µs) of each live lease
-- Time is Redis TIME in integer µs; bucket levels are integer micro-units. Lua numbers
-- are doubles, exact below 2^53; every number written goes through int() so that Redis
-- stores its exact decimal (tostring would write 1.7e+15).

local K_BUCKET, K_BUDGET, K_LEASES, K_RESV, K_DONE = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local K_STARTS = KEYS[6]
local US = 1000000
local DAY_US = 86400 * US
local KEEP_MS = 40 * 86400 * 1000  -- budget, leases, resv live 39-40 days past their last write
local DAY_MS = 86400 * 1000

local function int(x) return string.format('%.0f', x) end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * US + tonumber(t[2])
end

-- Raise a key's TTL to at least `ms` (never shortens it: a bucket in debt needs longer).
local function extend(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, int(ms)) end
end

-- Howard Hinnant's civil-from-days / days-from-civil (proleptic Gregorian, day 0 = 1970-01-01).
local function fdiv(a, b) return math.floor(a / b) end

local function civil_from_days(z)
  z = z + 719468
  local era = fdiv(z, 146097)
  local doe = z - era * 146097
  local yoe = fdiv(doe - fdiv(doe, 1460) + fdiv(doe, 36524) - fdiv(doe, 146096), 365)
  local doy = doe - (365 * yoe + fdiv(yoe, 4) - fdiv(yoe, 100))
  local mp = fdiv(5 * doy + 2, 153)
  local d = doy - fdiv(153 * mp + 2, 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = fdiv(y, 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = fdiv(153 * mp + 2, 5) + d - 1
  local doe = yoe * 365 + fdiv(yoe, 4) - fdiv(yoe, 100) + doy
  return era * 146097 + doe - 719468
end

-- The UTC periods of `now` (µs): day YYYYMMDD, month YYYYMM, their ends (µs), and the
-- oldest day (today - 2) and month (the previous one) whose counters are kept.
local function periods(now)
  local z = fdiv(now, DAY_US)
  local y, m, d = civil_from_days(z)
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  local py, pm = y, m - 1
  if pm < 1 then py, pm = y - 1, 12 end
  local ky, km, kd = civil_from_days(z - 2)
  return {
    day = y * 10000 + m * 100 + d, month = y * 100 + m,
    day_end = (z + 1) * DAY_US, month_end = days_from_civil(ny, nm, 1) * DAY_US,
    keep_day = ky * 10000 + km * 100 + kd, keep_month = py * 100 + pm,
  }
end

-- Token bucket, mirrored by policies/buckets.py.
local function refill(level, since, now, cap)
  local full = cap * US
  local need = full - level
  local elapsed = now - since
  if need <= 0 or elapsed <= 0 then return math.min(level, full) end
  if elapsed * cap >= need * 60 then return full end
  return level + math.floor(elapsed * cap / 60)
end

-- The bucket `name` refilled to now at capacity `cap` (full if never written).
local function level_of(name, cap, now)
  local st = redis.call('HMGET', K_BUCKET, name .. '_lvl', name .. '_ts')
  if not st[1] then return cap * US end
  return refill(tonumber(st[1]), tonumber(st[2]), now, cap)
end

local function wait_us(level, cap, cost)  -- 0: now; nil: never
  local deficit = cost * US - level
  if deficit <= 0 then return 0 end
  if cost > cap or cap == 0 then return nil end
  return math.ceil(deficit * 60 / cap)
end

local function reset_us(level, cap)
  local need = cap * US - level
  if need <= 0 or cap <= 0 then return 0 end
  return math.ceil(need * 60 / cap)
end

-- Save buckets {name, level, cap} (a nil level: not charged, skipped) in one HSET; the key
-- goes 1 min after the last of them is full again.
local function save_buckets(now, list)
  local fields, full_us = {}, nil
  for _, b in ipairs(list) do
    local name, level, cap = b[1], b[2], b[3]
    if level then
      for _, v in ipairs({name .. '_lvl', int(level), name .. '_ts', int(now),
                          name .. '_cap', int(cap)}) do fields[#fields + 1] = v end
      full_us = math.max(full_us or 0, reset_us(level, cap))
    end
  end
  if not full_us then return end
  redis.call('HSET', K_BUCKET, unpack(fields))
  extend(K_BUCKET, math.ceil(full_us / 1000) + 60000)
end

-- Keep keys 39-40 days past their last write with one PEXPIRE a day at most: a read (PTTL
-- of the first) per call instead of writes, which would also go to every replica. The keys
-- of one call are created, emptied and deleted together, so the first one speaks for all.
local function keep(keys, ms)
  if redis.call('PTTL', keys[1]) < ms - DAY_MS then
    for _, k in ipairs(keys) do redis.call('PEXPIRE', k, int(ms)) end
  end
end

-- Close reservation `rid` (record `rec`): its periods move from reserved to used (used +=
-- actual, or the reserved worst case when actual is nil); the lease goes; the id is kept
-- in `done` until forget_at so that it cannot be reserved again.
local function close(rid, rec, actual, forget_at)
  local tokens, day, month = string.match(rec, '^(%S+) (%S+) (%S+)')
  tokens = tonumber(tokens)
  actual = actual or tokens
  for _, prefix in ipairs({'d:' .. day, 'm:' .. month}) do
    if redis.call('HEXISTS', K_BUDGET, prefix .. ':r') == 1 then  -- else pruned: long over
      redis.call('HINCRBY', K_BUDGET, prefix .. ':r', int(-tokens))
      redis.call('HINCRBY', K_BUDGET, prefix .. ':u', int(actual))
    end
  end
  redis.call('ZREM', K_LEASES, rid)
  redis.call('ZREM', K_STARTS, rid)
  redis.call('HDEL', K_RESV, rid)
  redis.call('ZADD', K_DONE, int(forget_at), rid)
  local last = redis.call('ZRANGE', K_DONE, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', K_DONE, int(math.ceil(tonumber(last[2]) / 1000)))
end

-- Release reservation `rid`, whose lease expired, at its worst case (its replica died).
local function release(rid, now)
  local rec = redis.call('HGET', K_RESV, rid)
  if rec then
    close(rid, rec, nil, now + DAY_US)
  else
    redis.call('ZREM', K_LEASES, rid)
    redis.call('ZREM', K_STARTS, rid)
  end
end

-- Release expired reservations, the earliest expiry first, and forget closed ids past their
-- time, the earliest first: at most SWEEP_LIMIT of each per call, so that a dead replica's
-- thousand leases never hold Redis in one script. A backlog drains over the next calls
-- (each script sweeps before it reads; each adds at most one lease or done id). Until then
-- nothing reads an expired lease or a forgotten id as present: live leases are those with
-- expiry > now (live_leases, first_live_expiry, oldest_live_age), renew and settle release
-- an expired one they are asked about, and reserve refuses only ids with forget-at > now.
local SWEEP_LIMIT = 64

local function sweep(now)
  local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', int(now), 'LIMIT', 0, SWEEP_LIMIT)
  for _, rid in ipairs(expired) do release(rid, now) end
  -- `done` is ordered by forget-at: the n that are due are its n lowest ranks.
  local due = math.min(redis.call('ZCOUNT', K_DONE, '-inf', int(now)), SWEEP_LIMIT)
  if due > 0 then redis.call('ZREMRANGEBYRANK', K_DONE, 0, due - 1) end
end

-- The expiry (µs) of `rid`'s lease if it is live at `now`; an expired one the sweep has not
-- reached yet is released here, as the sweep would have. nil: no live lease.
local function live_expiry(rid, now)
  local expiry = redis.call('ZSCORE', K_LEASES, rid)
  if not expiry then return nil end
  expiry = tonumber(expiry)
  if expiry > now then return expiry end
  release(rid, now)
  return nil
end

local function live_leases(now)
  return redis.call('ZCOUNT', K_LEASES, '(' .. int(now), '+inf')
end

-- The earliest expiry (µs) of a live lease, nil if none.
local function first_live_expiry(now)
  local first = redis.call('ZRANGEBYSCORE', K_LEASES, '(' .. int(now), '+inf', 'WITHSCORES',
                           'LIMIT', 0, 1)
  return first[2] and tonumber(first[2])
end

-- How long ago the oldest live lease was reserved; 0 if unknown (a lease from before
-- `starts`, or SWEEP_LIMIT older ones expired and not yet swept).
local function oldest_live_age(now)
  local starts = redis.call('ZRANGE', K_STARTS, 0, SWEEP_LIMIT - 1, 'WITHSCORES')
  for i = 1, #starts, 2 do
    local expiry = redis.call('ZSCORE', K_LEASES, starts[i])
    if expiry and tonumber(expiry) > now then return now - tonumber(starts[i + 1]) end
  end
  return 0
end

-- Slot-hold estimate, mirrored by policies/hold.py: the mean and mean deviation (µs) of
-- how long the tenant's requests held a lease, reserve to settle, in the budget hash.
local HOLD_MIN_WAIT, HOLD_COLD_WAIT = 100000, 1000000

local function observe_hold(held)
  held = math.max(0, held)
  local st = redis.call('HMGET', K_BUDGET, 'hold_mean', 'hold_dev')
  local mean, dev = held, math.floor(held / 2)
  if st[1] and st[2] then
    local m, v = tonumber(st[1]), tonumber(st[2])
    local err = held - m
    mean, dev = m + math.floor(err / 8), v + math.floor((math.abs(err) - v) / 4)
  end
  redis.call('HSET', K_BUDGET, 'hold_mean', int(mean), 'hold_dev', int(dev))
end

-- The predicted wait for a slot: the oldest live lease is `age` old, the earliest lease
-- expiry is `bound` away (the upper bound, unless below the floor).
local function hold_wait(age, bound)
  local st = redis.call('HMGET', K_BUDGET, 'hold_mean', 'hold_dev')
  local guess = HOLD_COLD_WAIT
  if st[1] and st[2] then guess = math.max(tonumber(st[1]) - age, tonumber(st[2])) end
  return math.max(HOLD_MIN_WAIT, math.min(bound, guess))
end

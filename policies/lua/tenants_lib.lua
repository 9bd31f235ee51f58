-- tenants_lib.lua: shared by the tenant registry's scripts; RedisTenantStore prepends it.
--
-- Every script receives the same KEYS, all hash-tagged {registry:tenants} (one Cluster
-- slot; no tenant id contains ':', so no quota key shares the tag):
--   KEYS[1] version  STRING  change counter, bumped by every write that changes anything.
--                            Created at Redis TIME in µs, so a store that lost its data
--                            never repeats a version a replica has already loaded.
--   KEYS[2] records  HASH    tenant id -> tenant record (canonical JSON)
--   KEYS[3] keys     HASH    key id -> {"created","digest","id","role","tenant"} (JSON;
--                            the SHA-256 digest only, never the key)
--   KEYS[4] deleted  SET     't:<tenant id>', 'k:<key id>' deleted through the API:
--                            seeding from the tenants file skips them
local K_VERSION, K_RECORDS, K_KEYS, K_DELETED = KEYS[1], KEYS[2], KEYS[3], KEYS[4]

local function ensure_version()
  if redis.call('EXISTS', K_VERSION) == 0 then
    local t = redis.call('TIME')
    redis.call('SET', K_VERSION,
               string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2])))
  end
end

local function bump()
  ensure_version()
  return redis.call('INCR', K_VERSION)
end

-- The tenant of a stored key record, or nil if the record is not a JSON object: a record
-- written by hand or by an older version never raises (a script that failed after its first
-- write would leave that write behind; Redis does not roll a script back).
local function key_tenant(text)
  local ok, rec = pcall(cjson.decode, text)
  if ok and type(rec) == 'table' then return rec.tenant end
  return nil
end

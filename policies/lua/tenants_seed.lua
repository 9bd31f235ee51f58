-- tenants_seed.lua: write the tenants file's records the store lacks (after tenants_lib.lua).
-- One batch of one kind (RedisTenantStore.seed sends at most SEED_BATCH records a call):
--   ARGV[1] 't': ARGV[2] is "id\nrecord\nid\nrecord..." (tenants)
--   ARGV[1] 'k': ARGV[2] is "key id\ntenant id\nrecord\n..." (keys)
-- One argument a batch, not one a field: a client packs each argument in Python (redis-py:
-- ~15 µs each, most of seeding 100,000 keys). No field holds a newline: ids are validated
-- and records are canonical JSON, which escapes every control character.
-- A record is written only if its id is absent and was never deleted through the API; a
-- key only if, besides, its tenant is in the store. Returns how many records were written.
local f = {}
for s in string.gmatch(ARGV[2] or '', '[^\n]+') do f[#f + 1] = s end
local written = 0
if ARGV[1] == 't' then
  for i = 1, #f - 1, 2 do
    if redis.call('SISMEMBER', K_DELETED, 't:' .. f[i]) == 0
        and redis.call('HSETNX', K_RECORDS, f[i], f[i + 1]) == 1 then
      written = written + 1
    end
  end
elseif ARGV[1] == 'k' then
  for i = 1, #f - 2, 3 do
    local kid, tenant, rec = f[i], f[i + 1], f[i + 2]
    if redis.call('HEXISTS', K_RECORDS, tenant) == 1
        and redis.call('SISMEMBER', K_DELETED, 'k:' .. kid) == 0
        and redis.call('HSETNX', K_KEYS, kid, rec) == 1 then
      written = written + 1
    end
  end
end
if written > 0 then bump() else ensure_version() end
return written

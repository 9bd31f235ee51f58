-- tenants_seed.lua: write the tenants file's records the store lacks (after tenants_lib.lua).
-- ARGV: n, then n pairs (tenant id, record JSON), then triples (key id, tenant id, key JSON).
-- A record is written only if its id is absent and was never deleted through the API; a
-- key only if, besides, its tenant is in the store. Returns how many records were written.
local n = tonumber(ARGV[1])
local written, i = 0, 2
for _ = 1, n do
  local id, rec = ARGV[i], ARGV[i + 1]
  i = i + 2
  if redis.call('SISMEMBER', K_DELETED, 't:' .. id) == 0
      and redis.call('HSETNX', K_RECORDS, id, rec) == 1 then
    written = written + 1
  end
end
while i + 2 <= #ARGV do
  local kid, tenant, rec = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if redis.call('HEXISTS', K_RECORDS, tenant) == 1
      and redis.call('SISMEMBER', K_DELETED, 'k:' .. kid) == 0
      and redis.call('HSETNX', K_KEYS, kid, rec) == 1 then
    written = written + 1
  end
end
if written > 0 then bump() else ensure_version() end
return written

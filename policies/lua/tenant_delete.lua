-- tenant_delete.lua: remove a tenant and every key of it (after tenants_lib.lua).
-- ARGV: tenant id. Returns the new version, or 0 if there is no such tenant.
local id = ARGV[1]
if redis.call('HDEL', K_RECORDS, id) == 0 then return 0 end
redis.call('SADD', K_DELETED, 't:' .. id)
local all = redis.call('HGETALL', K_KEYS)
for i = 1, #all, 2 do
  if key_tenant(all[i + 1]) == id then
    redis.call('HDEL', K_KEYS, all[i])
    redis.call('SADD', K_DELETED, 'k:' .. all[i])
  end
end
return bump()

-- key_delete.lua: remove one key of a tenant (after tenants_lib.lua).
-- ARGV: tenant id, key id. Returns the new version, or 0 if the tenant has no such key.
local tenant, kid = ARGV[1], ARGV[2]
local current = redis.call('HGET', K_KEYS, kid)
if not current or key_tenant(current) ~= tenant then return 0 end
redis.call('HDEL', K_KEYS, kid)
redis.call('SADD', K_DELETED, 'k:' .. kid)
return bump()

-- tenant_create.lua: add a tenant record (after tenants_lib.lua).
-- ARGV: tenant id, record JSON. Returns the new version, or 0 if the id exists.
local id, rec = ARGV[1], ARGV[2]
if redis.call('HSETNX', K_RECORDS, id, rec) == 0 then return 0 end
redis.call('SREM', K_DELETED, 't:' .. id)
return bump()

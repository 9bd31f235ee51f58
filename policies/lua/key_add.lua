-- key_add.lua: add a key record to an existing tenant (after tenants_lib.lua).
-- ARGV: tenant id, key id, key record JSON.
-- Returns the new version; -1: no such tenant; 0: the key id exists.
local tenant, kid, rec = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HEXISTS', K_RECORDS, tenant) == 0 then return -1 end
if redis.call('HSETNX', K_KEYS, kid, rec) == 0 then return 0 end
return bump()

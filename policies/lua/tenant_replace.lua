-- tenant_replace.lua: compare-and-set a tenant record (after tenants_lib.lua).
-- ARGV: tenant id, the record JSON the caller read, the new record JSON.
-- Returns the new version; -1: no such tenant; -2: changed since the caller read it.
local id, expected, rec = ARGV[1], ARGV[2], ARGV[3]
local current = redis.call('HGET', K_RECORDS, id)
if not current then return -1 end
if current ~= expected then return -2 end
if current == rec then return tonumber(redis.call('GET', K_VERSION)) end
redis.call('HSET', K_RECORDS, id, rec)
return bump()

-- concurrency.lua: live leases, after releasing expired ones (after lib.lua).
local now = now_us()
sweep(now)
return live_leases(now)

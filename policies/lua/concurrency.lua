-- concurrency.lua: live leases, after releasing expired ones (after lib.lua).
sweep(now_us())
return redis.call('ZCARD', K_LEASES)

"""Redis: the fork store, leases and their Lua scripts, health checks, dead letters."""

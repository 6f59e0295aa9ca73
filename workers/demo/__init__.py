"""`forkq demo`: the newcomer's demo, its report, and the private redis-server it and the tests run on."""

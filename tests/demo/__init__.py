"""Tests of workers/demo/: `forkq demo` and the private redis-server it runs on."""

"""Tests of workers/service/: the runner, tasks, sweeper, spawn, heartbeat, metrics and progress."""

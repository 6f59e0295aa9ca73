"""The Redis health check (workers/store/health.py): reachability, eviction policy and persistence."""

from __future__ import annotations

from broker_config.settings import Settings
from workers.store.health import check_redis


def test_a_redis_that_keeps_nothing_on_disk_gets_a_warning_but_is_accepted(settings: Settings) -> None:
    # the test servers run with `--save '' --appendonly no`
    health = check_redis(settings)

    assert health.problems == []
    assert len(health.warnings) == 1 and "persistence off" in health.warnings[0]
    assert "appendonly yes" in health.warnings[0]

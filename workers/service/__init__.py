"""The worker side: Celery tasks, the runner, nested spawns, the sweeper, heartbeat, metrics and progress events.

It needs the `worker` extra (metrics, the model SDKs, the search engine): without it, importing any of it
(`celery -A workers.app worker`, `forkq sweep`) fails at once naming the extra, not deep in a module.
"""

from workers.base.extras import require_extra

require_extra("worker", "the forkq worker side (forkq worker, forkq sweep, celery -A workers.app)")

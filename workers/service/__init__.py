"""The worker side: Celery tasks, the runner, nested spawns, the sweeper, heartbeat, metrics and progress events."""

"""The tools a fork runs: the registry, the built-in coding tools and their confinement.

No Redis, no Celery: a tool sees only its `ToolContext`."""

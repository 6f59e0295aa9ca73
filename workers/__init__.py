"""forkq: background fork subagents of LLM coding agents, on Celery and Redis."""

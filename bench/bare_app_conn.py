"""The bare baseline with forkq's broker connection, for `celery -A bench.bare_app_conn` (see bench/bare_app.py)."""

from __future__ import annotations

from functools import cache
from typing import Any

from celery import Celery

from bench.bare_app import make_bare_app
from broker_config.settings import Settings


@cache
def default_app() -> Celery:
    """The bare app with `ForkqAMQP`, from the environment's settings."""
    return make_bare_app(Settings(), forkq_connection=True)


def __getattr__(name: str) -> Any:
    # `celery -A bench.bare_app_conn` looks up `bench.bare_app_conn.app`; build it then, not at import time
    if name in ("app", "celery"):
        return default_app()
    raise AttributeError(f"module 'bench.bare_app_conn' has no attribute {name!r}")

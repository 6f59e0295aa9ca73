"""Fixtures of the end-to-end tests: a project to work in, the parent working there, local model servers, and
live workers started for settings overrides."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.worker import WorkController

from broker_config.settings import Settings
from tests.fakeapi import FakeAPI
from workers.app import make_app
from workers.client import ForkClient

MARKER = "The release codename is PERIWINKLE-7731."
APP_PY = "def main():\n    return 42\n"
FAST_RETRIES = {"provider_max_attempts": 3, "provider_retry_base_s": 0.01, "provider_retry_max_s": 0.05}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The fork's working directory: `notes.txt` and `src/app.py`."""
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / "notes.txt").write_text(MARKER + "\n", encoding="utf-8")
    (root / "src" / "app.py").write_text(APP_PY, encoding="utf-8")
    return root


@pytest.fixture
def make_parent(parent: dict[str, Any], workdir: Path) -> Callable[[str], dict[str, Any]]:
    """The example parent snapshot for a model, working in `workdir`."""
    return lambda model: {**copy.deepcopy(parent), "model": model, "cwd": str(workdir)}


@pytest.fixture
def openai_api() -> Iterator[FakeAPI]:
    """A local server answering as the OpenAI Chat Completions API."""
    with FakeAPI() as server:
        yield server


@pytest.fixture
def gemini_api() -> Iterator[FakeAPI]:
    """A local server answering as Gemini's generateContent API."""
    with FakeAPI() as server:
        yield server


@pytest.fixture
def apis(openai_api: FakeAPI, gemini_api: FakeAPI) -> dict[str, FakeAPI]:
    """Both local servers by provider kind."""
    return {"openai": openai_api, "gemini": gemini_api}


@pytest.fixture
def forkq(
    make_settings: Callable[..., Settings], start_live_worker: Callable[[Celery], WorkController]
) -> Iterator[Callable[..., ForkClient]]:
    """Start an in-process worker for settings overrides; the client that launches to it."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: Any) -> ForkClient:
            settings = make_settings(**{**FAST_RETRIES, **overrides})
            app = make_app(settings)
            stack.callback(app.close)
            client = stack.enter_context(ForkClient(settings, app=app))
            start_live_worker(app)
            return client

        yield start

"""Fixtures of the HTTP API's tests only: an httpx client of the test API with a valid token."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.api_support import Api


@pytest.fixture
def http(api: Api) -> Iterator[httpx.Client]:
    """An httpx client of `api` with a valid token."""
    with api.client() as client:
        yield client

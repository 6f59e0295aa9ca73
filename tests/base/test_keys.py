"""The Redis key schema: hash tags, validation, and the documentation of every key."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from workers.base import keys as keys_module
from workers.base.keys import Keys
from workers.client import ForkClient

FORK_ID = "f-0123456789abcdef01234567"


def per_fork_templates() -> list[str]:
    """Every `Keys` method that names one key of one fork (a single `fork_id` argument)."""
    return sorted(
        name
        for name, member in inspect.getmembers(Keys, inspect.isfunction)
        if not name.startswith("_") and list(inspect.signature(member).parameters) == ["self", "fork_id"]
    )


def test_the_schema_has_the_per_fork_keys_of_the_design() -> None:
    assert {"bootstrap", "state", "result", "events"} <= set(per_fork_templates())


@pytest.mark.parametrize("template", per_fork_templates())
def test_every_per_fork_key_carries_the_fork_id_hash_tag(template: str) -> None:
    key = getattr(Keys("forkq"), template)(FORK_ID)

    assert key.startswith("forkq:")
    assert f"{{{FORK_ID}}}" in key
    assert key.index("{") == key.index(f"{{{FORK_ID}}}")  # the first brace pair is the hash tag
    assert key_slot(key.encode()) == key_slot(FORK_ID.encode())


def test_all_keys_of_one_fork_share_a_cluster_slot_and_two_forks_get_different_keys() -> None:
    keys = Keys("ns")
    names = [getattr(keys, t)(FORK_ID) for t in per_fork_templates()]

    assert len(set(names)) == len(names)
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert not {getattr(keys, t)("f-other") for t in per_fork_templates()} & set(names)


def test_chunk_keys_carry_the_parent_session_hash_tag() -> None:
    key = Keys("ns").chunk("5d0e8c2a-7f31", "ab" * 32)

    assert key == f"ns:{{parent:5d0e8c2a-7f31}}:chunk:{'ab' * 32}"
    assert key_slot(key.encode()) == key_slot(b"parent:5d0e8c2a-7f31")


def test_the_namespace_prefixes_every_key() -> None:
    keys = Keys("team-a.forkq")

    assert all(getattr(keys, t)(FORK_ID).startswith("team-a.forkq:{") for t in per_fork_templates())
    assert keys.chunk("s", "00").startswith("team-a.forkq:{parent:s}")


@pytest.mark.parametrize("fork_id", ["", "a b", "f}1", "f{1", "-leading", "f:1", "x" * 129, "f\n", "é"])
def test_an_invalid_fork_id_is_refused_with_a_message_saying_what_ids_look_like(fork_id: str) -> None:
    with pytest.raises(ValueError, match=r"fork id .* is not valid; ids are 1-128 letters"):
        Keys().state(fork_id)


@pytest.mark.parametrize("session", ["", "a b", "a{b", "a}b", "x" * 201])
def test_an_invalid_parent_session_is_refused(session: str) -> None:
    with pytest.raises(ValueError, match="parent session id"):
        Keys().chunk(session, "00")


@pytest.mark.parametrize("template", per_fork_templates())
def test_the_module_docstring_documents_every_per_fork_key(template: str) -> None:
    assert f"`{{ns}}:{{<fork_id>}}:{template}`" in (keys_module.__doc__ or "")


def test_every_key_a_launch_writes_is_under_the_fork_or_parent_hash_tag(
    client: ForkClient, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    handle = client.launch(parent, {"description": "d", "prompt": "Do it.", "subagent_type": "fork"})

    ours = [k.decode() for k in redis_client.keys(f"{client.settings.namespace}:*")]
    fork_keys = [k for k in ours if f"{{{handle.fork_id}}}" in k]
    parent_keys = [k for k in ours if k.startswith(f"{client.settings.namespace}:{{parent:{parent['session_id']}}}:")]
    assert sorted(fork_keys + parent_keys) == sorted(ours)
    assert client.store.keys.session_forks(parent["session_id"]) in parent_keys  # the session's index of forks
    assert len({key_slot(k.encode()) for k in fork_keys}) == 1
    assert len({key_slot(k.encode()) for k in parent_keys}) == 1


def test_the_session_index_and_idempotency_keys_are_built_here_and_checked() -> None:
    keys = Keys("ns")

    assert keys.session_forks("5d0e8c2a-7f31") == "ns:{parent:5d0e8c2a-7f31}:forks"
    assert keys.idempotency("ab" * 32) == f"ns:idempotency:{'ab' * 32}"
    with pytest.raises(ValueError, match="parent session id"):
        keys.session_forks("a b")
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        keys.idempotency("not-a-digest")

"""Uploaded workspaces over HTTP: the manifest, the missing blobs, their checks and bounds, a launch naming the
manifest, and a fork's changes; against the API served by uvicorn on the private Redis."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from broker_config.settings import Settings
from tests.api_support import FORK, Api, no_keys_written
from workers.base.keys import Keys
from workers.store.blobs import BlobStore
from workers.workspace.manifest import Entry, Manifest, Mode

FILES = {
    "README.md": b"# app\n",
    "src/app.py": b"print('hi')\n",
    "src/copy.py": b"print('hi')\n",  # the same bytes: one blob
    "run.sh": b"#!/bin/sh\n",
}


def entries_of(files: dict[str, bytes]) -> list[dict[str, Any]]:
    """The manifest entries of `files` (a `.sh` file is executable)."""
    return [
        {
            "path": path,
            "mode": int(Mode.EXECUTABLE if path.endswith(".sh") else Mode.FILE),
            "size": len(data),
            "digest": hashlib.sha256(data).hexdigest(),
        }
        for path, data in files.items()
    ]


def blob_store(settings: Settings, redis_client: redis.Redis) -> BlobStore:
    return BlobStore(redis_client, Keys(settings.namespace), ttl_s=settings.record_ttl_s)


def upload_all(http: httpx.Client, files: dict[str, bytes]) -> str:
    """Offer, upload what is missing, offer again: the manifest's digest."""
    missing = http.post("/v1/workspaces", json={"entries": entries_of(files)}).json()["missing"]
    by_digest = {hashlib.sha256(data).hexdigest(): data for data in files.values()}
    for digest in missing:
        assert http.put(f"/v1/workspaces/blobs/{digest}", content=by_digest[digest]).status_code == 204
    answer = http.post("/v1/workspaces", json={"entries": entries_of(files)}).json()
    assert answer["missing"] == []
    return str(answer["manifest"])


def test_an_offered_tree_gets_its_missing_blobs_then_once_uploaded_its_manifest_is_stored(
    http: httpx.Client, api: Api, redis_client: redis.Redis
) -> None:
    store = blob_store(api.settings, redis_client)
    expected = Manifest.of(Entry.parse(e) for e in entries_of(FILES))

    first = http.post("/v1/workspaces", json={"entries": entries_of(FILES)})

    # Then each distinct blob is asked for once, and the manifest is not stored before its blobs are
    assert first.status_code == 200, first.text
    assert first.json()["manifest"] == expected.digest
    assert sorted(first.json()["missing"]) == sorted({hashlib.sha256(d).hexdigest() for d in FILES.values()})
    assert not store.has_manifest(expected.digest)

    # When the blobs are uploaded and the tree offered again, the manifest is stored, and a third offer asks nothing
    assert upload_all(http, FILES) == expected.digest
    assert store.get_manifest(expected.digest) == expected
    again = http.post("/v1/workspaces", json={"entries": entries_of(FILES)})
    assert again.json() == {"manifest": expected.digest, "missing": []}


def test_a_changed_file_is_the_one_blob_a_later_offer_asks_for(http: httpx.Client) -> None:
    upload_all(http, FILES)

    edited = {**FILES, "src/app.py": b"print('bye')\n"}
    missing = http.post("/v1/workspaces", json={"entries": entries_of(edited)}).json()["missing"]

    assert missing == [hashlib.sha256(b"print('bye')\n").hexdigest()]


def test_a_stored_manifest_whose_blob_is_gone_asks_for_it_again(
    http: httpx.Client, api: Api, redis_client: redis.Redis
) -> None:
    # Given a stored tree, near its expiry, one of whose blobs is gone (expired, or Redis lost it)
    manifest = upload_all(http, FILES)
    keys = Keys(api.settings.namespace)
    gone = hashlib.sha256(FILES["README.md"]).hexdigest()
    redis_client.delete(keys.blob("default", gone))
    redis_client.expire(keys.manifest("default", manifest), 60)

    answer = http.post("/v1/workspaces", json={"entries": entries_of(FILES)}).json()

    assert answer == {"manifest": manifest, "missing": [gone]}


def test_a_blob_whose_bytes_are_not_its_digest_is_422_and_nothing_is_stored(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    unchanged = no_keys_written(redis_client)
    claimed = hashlib.sha256(b"the real bytes").hexdigest()

    response = http.put(f"/v1/workspaces/blobs/{claimed}", content=b"other bytes")

    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "digest"
    assert hashlib.sha256(b"other bytes").hexdigest() in error["message"]
    assert "upload the file's exact bytes" in error["message"]
    unchanged()


@pytest.mark.parametrize(
    ("overrides", "size", "bound"),
    [({"api_max_body_bytes": 1000}, 1001, "FORKQ_API_MAX_BODY_BYTES"), ({"workspace_max_bytes": 100}, 101, None)],
    ids=["server-body-limit", "workspace-max-bytes"],
)
def test_a_blob_over_a_bound_is_413_and_nothing_is_stored(
    serve_api: Callable[..., Api], redis_client: redis.Redis, overrides: dict[str, int], size: int, bound: str | None
) -> None:
    data = b"x" * size
    unchanged = no_keys_written(redis_client)

    with serve_api(**overrides).client() as http:
        response = http.put(f"/v1/workspaces/blobs/{hashlib.sha256(data).hexdigest()}", content=data)

    assert response.status_code == 413, response.text
    assert (bound or "FORKQ_WORKSPACE_MAX_BYTES") in response.json()["error"]["message"]
    unchanged()


def _entry(path: str = "a.txt", mode: int = int(Mode.FILE), digest: str = "0" * 64) -> dict[str, Any]:
    return {"path": path, "mode": mode, "size": 1, "digest": digest}


BAD_ENTRIES = {  # (entries, the field named, words of the message)
    "dot-dot": ([_entry(), _entry("src/../../etc/passwd")], "entries[1].path", "'src/../../etc/passwd'"),
    "absolute": ([_entry("/etc/passwd")], "entries[0].path", "is absolute"),
    "bad-mode": ([_entry(mode=0o100666)], "entries[0].mode", "'a.txt': mode 33206 is not one of"),
    "bad-digest": ([_entry(digest="ABC")], "entries[0].digest", "'a.txt': digest 'ABC' is not the SHA-256"),
    "duplicate": ([_entry(), _entry()], "path", "'a.txt' is listed twice"),
    "under-a-file": ([_entry(), _entry("a.txt/b")], "path", "lies under 'a.txt', which is a file"),
    "missing-field": ([{"path": "a.txt"}], "entries[0].mode", "mode None"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_a_bad_manifest_entry_is_422_naming_the_entry_and_nothing_is_written(
    http: httpx.Client, redis_client: redis.Redis, case: str
) -> None:
    entries, field, words = BAD_ENTRIES[case]
    unchanged = no_keys_written(redis_client)

    response = http.post("/v1/workspaces", json={"entries": entries})

    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and words in error["message"], error
    unchanged()


@pytest.mark.parametrize(
    ("overrides", "bound"),
    [({"workspace_max_files": 3}, "FORKQ_WORKSPACE_MAX_FILES (3)"), ({"workspace_max_bytes": 20}, "MAX_BYTES (20)")],
    ids=["files", "bytes"],
)
def test_a_tree_over_the_bounds_is_422_naming_the_bound_the_largest_folders_and_the_fix(
    serve_api: Callable[..., Api], redis_client: redis.Redis, overrides: dict[str, int], bound: str
) -> None:
    unchanged = no_keys_written(redis_client)

    with serve_api(**overrides).client() as http:
        response = http.post("/v1/workspaces", json={"entries": entries_of(FILES)})

    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "workspace"
    assert bound in error["message"] and "src/ (24 bytes, 2 files)" in error["message"]
    assert ".forkqignore" in error["message"] and '"shared"' in error["message"]
    unchanged()


def test_an_entry_whose_size_is_not_its_blobs_is_422_and_the_manifest_is_not_stored(
    http: httpx.Client, api: Api, redis_client: redis.Redis
) -> None:
    upload_all(http, FILES)
    lying = entries_of(FILES)
    lying[0] = {**lying[0], "size": 1}  # README.md: 6 bytes

    response = http.post("/v1/workspaces", json={"entries": lying})

    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "size" and "'README.md': size 1" in response.text
    manifest = Manifest.of(Entry.parse(e) for e in lying)
    assert not blob_store(api.settings, redis_client).has_manifest(manifest.digest)


def test_a_launch_names_an_uploaded_manifest_and_one_naming_an_unknown_manifest_is_422(
    http: httpx.Client, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    manifest = upload_all(http, FILES)
    options = {"workspace": "snapshot", "workspace_manifest": manifest, "network": False}

    launched = http.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": options})

    assert launched.status_code == 202, launched.text
    unknown = hashlib.sha256(b"never uploaded").hexdigest()
    unchanged = no_keys_written(redis_client)
    refused = http.post(
        "/v1/forks",
        json={"parent": parent, "agent": FORK, "options": {"workspace_manifest": unknown}},
        headers={"Idempotency-Key": "unknown-manifest"},
    )
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["field"] == "workspace_manifest" and unknown in error["message"]
    assert "upload it first" in error["message"]
    unchanged()


BAD_OPTIONS = {  # (options, the field named, words of the message)
    "mode": ({"workspace": "copy"}, "workspace", 'is not "snapshot"'),
    "digest": ({"workspace_manifest": "abc"}, "workspace_manifest", "is not a manifest's digest"),
    "network": ({"network": "no"}, "network", "is not true or false"),
    "shared-with-manifest": (
        {"workspace": "shared", "workspace_manifest": "0" * 64},
        "workspace_manifest",
        'the workspace is "shared"',
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_a_bad_workspace_option_is_422_naming_it(http: httpx.Client, parent: dict[str, Any], case: str) -> None:
    options, field, words = BAD_OPTIONS[case]

    response = http.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": options})

    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and words in error["message"], error


def test_a_snapshot_launch_without_a_manifest_gets_the_empty_tree_never_a_folder_of_the_server(
    http: httpx.Client, api: Api, redis_client: redis.Redis, parent: dict[str, Any]
) -> None:
    launched = http.post("/v1/forks", json={"parent": parent, "agent": FORK, "options": {"workspace": "snapshot"}})

    assert launched.status_code == 202, launched.text
    assert blob_store(api.settings, redis_client).has_manifest(Manifest(()).digest)


def test_a_forks_changes_are_a_patch_or_json_and_an_unknown_fork_is_404(
    http: httpx.Client, parent: dict[str, Any]
) -> None:
    fork_id = http.post("/v1/forks", json={"parent": parent, "agent": FORK}).json()["fork_id"]

    as_patch = http.get(f"/v1/forks/{fork_id}/changes", headers={"Accept": "*/*"})
    as_json = http.get(f"/v1/forks/{fork_id}/changes", headers={"Accept": "application/json"})
    as_stat = http.get(f"/v1/forks/{fork_id}/changes", params={"stat": "1"})

    assert as_patch.status_code == 200 and as_patch.headers["content-type"].startswith("text/x-diff")
    assert as_json.headers["content-type"] == "application/json"
    assert set(as_json.json()) == {"fork_id", "files", "patch"} and isinstance(as_json.json()["patch"], str)
    assert as_stat.json()["patch"] is None and isinstance(as_stat.json()["files"], list)
    missing = http.get("/v1/forks/f-never-launched/changes")
    assert missing.status_code == 404 and "f-never-launched" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/workspaces"),
        ("PUT", f"/v1/workspaces/blobs/{hashlib.sha256(b'x').hexdigest()}"),
        ("GET", "/v1/forks/f-any/changes"),
    ],
)
def test_every_workspace_endpoint_needs_a_bearer_token(
    api: Api, redis_client: redis.Redis, method: str, path: str
) -> None:
    unchanged = no_keys_written(redis_client)

    with api.client(token=None) as anonymous, api.client(token="not-a-token") as wrong:
        answers = [c.request(method, path, content=b"x") for c in (anonymous, wrong)]

    assert [a.status_code for a in answers] == [401, 401]
    unchanged()

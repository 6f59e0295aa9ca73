"""The stdlib-only helper of a parent that speaks HTTP (clients/python/forkq_http.py), against the served API:
a folder uploaded (from git, or walked with .forkqignore), nothing sent twice, a launch naming it, its changes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from tests.api_support import FORK, TOKEN, Api
from workers.base.keys import Keys
from workers.store.blobs import BlobStore
from workers.workspace.manifest import Mode

HELPER = Path(__file__).resolve().parents[2] / "clients" / "python" / "forkq_http.py"


@pytest.fixture(scope="module")
def forkq_http() -> ModuleType:
    """The helper, loaded from its file as a parent would copy it."""
    spec = importlib.util.spec_from_file_location("forkq_http", HELPER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["forkq_http"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def git(folder: Path, *argv: str) -> None:
    subprocess.run(["git", "-C", str(folder), *argv], check=True, capture_output=True)


def make_tree(folder: Path) -> None:
    """A tree with a file, an executable, a symlink, a nested file and a build folder."""
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "app.py").write_text("print('hi')\n")
    (folder / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (folder / "run.sh").chmod(0o755)
    (folder / "link").symlink_to("src/app.py")
    (folder / "build").mkdir()
    (folder / "build" / "out.bin").write_bytes(b"\0" * 100)
    (folder / "notes.log").write_text("log\n")


def stored_paths(api: Api, redis_client: redis.Redis, manifest: str) -> dict[str, int]:
    store = BlobStore(redis_client, Keys(api.settings.namespace), ttl_s=api.settings.record_ttl_s)
    return {e.path: int(e.mode) for e in store.get_manifest(manifest)}


def test_a_git_folder_is_uploaded_as_git_lists_it_once_and_then_only_its_changed_file(
    forkq_http: ModuleType, api: Api, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Given a git work tree with an ignored folder, a committed file and an untracked one
    make_tree(tmp_path)
    (tmp_path / ".gitignore").write_text("build/\n*.log\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "src", ".gitignore")
    (tmp_path / "src" / "gone.py").write_text("deleted after add\n")
    git(tmp_path, "add", "src/gone.py")
    (tmp_path / "src" / "gone.py").unlink()  # in git's index, not on disk: not uploaded

    manifest, uploaded = forkq_http.upload_workspace(api.url, TOKEN, tmp_path)

    assert stored_paths(api, redis_client, manifest) == {
        ".gitignore": int(Mode.FILE),
        "link": int(Mode.SYMLINK),
        "run.sh": int(Mode.EXECUTABLE),
        "src/app.py": int(Mode.FILE),
    }
    assert uploaded == 4
    assert forkq_http.upload_workspace(api.url, TOKEN, tmp_path) == (manifest, 0)
    (tmp_path / "src" / "app.py").write_text("print('bye')\n")
    changed, uploaded_again = forkq_http.upload_workspace(api.url, TOKEN, tmp_path)
    assert changed != manifest and uploaded_again == 1


def test_a_folder_outside_git_is_walked_minus_its_forkqignore(
    forkq_http: ModuleType, api: Api, redis_client: redis.Redis, tmp_path: Path
) -> None:
    make_tree(tmp_path)
    (tmp_path / "src" / "keep.log").write_text("kept\n")
    (tmp_path / ".forkqignore").write_text("# build output\nbuild/\n*.log\n!src/keep.log\n/run.sh\n")
    (tmp_path / ".git").mkdir()  # a stray .git folder that is not a repository is never uploaded
    (tmp_path / ".git" / "config").write_text("x\n")

    manifest, _ = forkq_http.upload_workspace(api.url, TOKEN, tmp_path)

    assert sorted(stored_paths(api, redis_client, manifest)) == [".forkqignore", "link", "src/app.py", "src/keep.log"]


def test_the_ignore_rules_follow_gitignores_matching(forkq_http: ModuleType) -> None:
    rules = forkq_http.IgnoreRules("*.o\n/top.txt\ndocs/**/draft.md\ncache/\n!keep.o\n[ab].tmp\n")

    assert rules.ignored("x/y.o", False) and not rules.ignored("x/keep.o", False)
    assert rules.ignored("top.txt", False) and not rules.ignored("sub/top.txt", False)
    assert rules.ignored("docs/draft.md", False) and rules.ignored("docs/a/b/draft.md", False)
    assert rules.ignored("src/cache", True) and not rules.ignored("src/cache", False)
    assert rules.ignored("a.tmp", False) and not rules.ignored("c.tmp", False)


def test_a_launch_names_the_uploaded_workspace_and_its_changes_are_read(
    forkq_http: ModuleType, api: Api, parent: dict[str, Any], tmp_path: Path
) -> None:
    make_tree(tmp_path)
    manifest, _ = forkq_http.upload_workspace(api.url, TOKEN, tmp_path)

    fork = forkq_http.launch(api.url, TOKEN, parent, FORK, workspace_manifest=manifest, network=False, max_turns=3)

    assert fork["status"] == "queued"
    assert forkq_http.changes(api.url, TOKEN, fork["fork_id"], stat_only=True)["patch"] is None
    assert isinstance(forkq_http.patch(api.url, TOKEN, fork["fork_id"]), bytes)


def test_a_refusal_is_a_forkq_http_error_with_the_apis_status_message_and_field(
    forkq_http: ModuleType, api: Api, parent: dict[str, Any]
) -> None:
    with pytest.raises(forkq_http.ForkqHttpError) as refused:
        forkq_http.launch(api.url, TOKEN, parent, FORK, workspace_manifest="0" * 64)

    assert (refused.value.status, refused.value.field) == (422, "workspace_manifest")
    assert "upload it first" in str(refused.value)
    with pytest.raises(forkq_http.ForkqHttpError) as unauthorized:
        forkq_http.upload_workspace(api.url, "not-a-token", Path(__file__).parent)
    assert unauthorized.value.status == 401

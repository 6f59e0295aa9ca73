"""Removing a run's folder whatever its commands did to it, and measuring the disk a folder takes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT as ROOT
from tests.conftest import missing_tool
from workers.workspace.cleanup import disk_usage, remove_tree


def make_tree(root: Path, outside: Path) -> None:
    """A small run folder: files, an executable, nested folders, and symlinks to a folder and a file outside."""
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "big.bin").write_bytes(b"\1" * 300_000)
    (root / "out").symlink_to(outside)
    (root / "src" / "kept-link").symlink_to(outside / "kept")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "kept").write_text("x")
    return folder


def unprivileged(script: str, *args: str) -> None:
    """Run `script` in a Python child that permissions bind: as root (a container's), with every capability
    dropped, so a read-only folder is read-only for it too."""
    command = [sys.executable, "-c", script, *args]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            missing_tool("setpriv", "setpriv (util-linux) drops root's capabilities for the read-only tests")
        command = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", *command]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_remove_tree_removes_a_tree_a_command_made_read_only(tmp_path: Path, outside: Path):
    root = tmp_path / "tree"
    make_tree(root, outside)
    subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)
    (root / "src").chmod(0o000)

    unprivileged(
        "import sys, pathlib, shutil\n"
        "from workers.workspace.cleanup import remove_tree\n"
        "root = pathlib.Path(sys.argv[1])\n"
        "try:\n"
        "    shutil.rmtree(root)\n"
        "except PermissionError:\n"
        "    pass\n"
        "else:\n"
        "    sys.exit('the tree was not read-only for this process')\n"
        "remove_tree(root)\n"
        "remove_tree(root)  # already gone: nothing to do\n",
        str(root),
    )

    assert not root.exists()
    assert (outside / "kept").read_text() == "x" and os.access(outside, os.W_OK)


def test_remove_tree_removes_a_symlink_never_its_target(tmp_path: Path, outside: Path):
    (tmp_path / "link").symlink_to(outside)

    remove_tree(tmp_path / "link")

    assert not (tmp_path / "link").is_symlink() and (outside / "kept").exists()


def test_remove_tree_and_disk_usage_handle_folders_nested_deeper_than_the_python_stack(tmp_path: Path):
    # Given folders nested 1,200 deep (a command can make them), each made read-only from the bottom up
    root = tmp_path / "tree"
    fds = [os.open(tmp_path, os.O_RDONLY)]
    for name in ["tree"] + ["d"] * 1200:
        os.mkdir(name, dir_fd=fds[-1])
        fds.append(os.open(name, os.O_RDONLY, dir_fd=fds[-1]))
    for fd in reversed(fds[1:]):
        os.chmod(fd, 0o555)
    for fd in fds:
        os.close(fd)

    assert disk_usage(root) >= 1200 * 512

    remove_tree(root)
    assert not root.exists()


def test_a_tree_that_cannot_be_removed_is_a_workspace_error(tmp_path: Path):
    (tmp_path / "parent" / "locked").mkdir(parents=True)
    (tmp_path / "parent" / "locked" / "file").write_text("x")
    (tmp_path / "parent").chmod(0o555)  # the folder's parent, which remove_tree does not make writable
    try:
        unprivileged(
            "import sys, pathlib\n"
            "from workers.errors import WorkspaceError\n"
            "from workers.workspace.cleanup import remove_tree\n"
            "try:\n"
            "    remove_tree(pathlib.Path(sys.argv[1]))\n"
            "except WorkspaceError as exc:\n"
            "    assert 'cannot be removed' in str(exc), exc\n"
            "else:\n"
            "    sys.exit('no WorkspaceError')\n",
            str(tmp_path / "parent" / "locked"),
        )
    finally:
        (tmp_path / "parent").chmod(0o755)


def test_disk_usage_counts_the_blocks_of_a_tree_and_not_what_its_links_point_to(tmp_path: Path, outside: Path):
    (outside / "huge").write_bytes(b"\2" * 2_000_000)
    make_tree(tmp_path / "tree", outside)

    used = disk_usage(tmp_path / "tree")

    assert 300_000 <= used < 400_000
    assert disk_usage(tmp_path / "tree" / "big.bin") >= 300_000
    assert disk_usage(tmp_path / "absent") == 0

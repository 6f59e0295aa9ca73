"""Reads beneath a tree: no symlink is followed anywhere on the way, so a read never leaves the tree."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from workers.workspace import beneath


def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"inside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_bytes(b"secret")
    return root


def test_a_file_is_read_with_the_stat_it_had(tmp_path: Path) -> None:
    root = tree(tmp_path)
    read = beneath.read_file(str(root), "a/b/f")
    assert read is not None
    st, data = read
    assert data == b"inside" and st.st_ino == os.stat(root / "a/b/f").st_ino


def test_a_folder_swapped_for_a_link_out_of_the_tree_fails_the_read(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (root / "a" / "b" / "f").unlink()
    (root / "a" / "b").rmdir()
    (root / "a" / "b").symlink_to(tmp_path / "outside")
    assert (root / "a" / "b" / "f").read_bytes() == b"secret"  # a plain open would follow it
    with pytest.raises(OSError) as raised:
        beneath.read_file(str(root), "a/b/f")
    assert raised.value.errno in (errno.ELOOP, errno.ENOTDIR)
    with pytest.raises(OSError):
        beneath.read_link(str(root), "a/b/f")


def test_a_link_is_read_not_followed_and_a_fifo_is_no_file(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (root / "a" / "link").symlink_to(tmp_path / "outside" / "f")
    os.mkfifo(root / "a" / "pipe")
    assert beneath.read_link(str(root), "a/link") == os.fsencode(tmp_path / "outside" / "f")
    with pytest.raises(OSError) as raised:
        beneath.read_file(str(root), "a/link")
    assert raised.value.errno == errno.ELOOP
    assert beneath.read_file(str(root), "a/pipe") is None

"""Opening paths beneath a directory (`workers.tools.beneath`), with `openat2` and with the component walk.

Every test runs twice: once as this kernel allows (`openat2` where it has it) and once with the
walk forced, so both implementations are held to the same answers. The race through the tools
themselves is in tests/test_tools.py.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.tools import beneath
from workers.tools.beneath import ANY, DIRECTORY, RootDir


@pytest.fixture(params=["openat2", "walk"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "walk":
        monkeypatch.setattr(beneath, "use_openat2", False)
    elif not beneath.openat2_available():
        pytest.skip("this kernel (or its seccomp profile) has no openat2: the walk is all there is")
    return str(request.param)


@pytest.fixture
def root(tmp_path: Path, implementation: str) -> Iterator[RootDir]:
    """work/ with d/f, links inside and out, beside outside/s."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    (work / "d").mkdir(parents=True)
    outside.mkdir()
    (work / "d" / "f").write_text("inside\n", encoding="utf-8")
    (outside / "s").write_text("secret\n", encoding="utf-8")
    (work / "rel").symlink_to("d")
    (work / "absin").symlink_to(work / "d")
    (work / "relout").symlink_to("../outside")
    (work / "absout").symlink_to(outside)
    (work / "loop1").symlink_to("loop2")
    (work / "loop2").symlink_to("loop1")
    (work / "dangling").symlink_to("d/new")
    (work / "danglingout").symlink_to(outside / "new")
    with RootDir.open(work) as opened:
        yield opened


def opened(root: RootDir, path: str, flags: int = os.O_RDONLY) -> str:
    fd = root.open_beneath(path, flags)
    try:
        return root.relative(fd, "?")
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("path", "names"),
    [("d/f", "d/f"), ("rel/f", "d/f"), ("absin/f", "d/f"), ("d/../d/f", "d/f"), ("", "."), ("d/..", ".")],
)
def test_a_path_that_stays_inside_opens_what_it_names(root: RootDir, path: str, names: str) -> None:
    assert opened(root, path, ANY) == names


@pytest.mark.parametrize("path", ["../outside/s", "relout/s", "absout/s", "d/../../outside/s", "absout"])
def test_a_path_that_leads_outside_is_refused_with_exdev(root: RootDir, path: str) -> None:
    with pytest.raises(OSError) as refused:
        root.open_beneath(path, os.O_RDONLY)
    assert refused.value.errno == errno.EXDEV


def test_a_symlink_loop_is_refused_with_eloop(root: RootDir) -> None:
    with pytest.raises(OSError) as refused:
        root.open_beneath("loop1/x", os.O_RDONLY)
    assert refused.value.errno == errno.ELOOP


def test_creating_through_a_dangling_symlink_creates_its_target_only_when_it_is_inside(
    root: RootDir, tmp_path: Path
) -> None:
    assert opened(root, "dangling", os.O_WRONLY | os.O_CREAT) == "d/new"
    with pytest.raises(OSError) as refused:
        root.open_beneath("danglingout", os.O_WRONLY | os.O_CREAT)
    assert refused.value.errno == errno.EXDEV
    assert not (tmp_path / "outside" / "new").exists()


def test_a_missing_component_or_a_file_used_as_a_directory_is_reported_as_such(root: RootDir) -> None:
    with pytest.raises(FileNotFoundError):
        root.open_beneath("nope/f", os.O_RDONLY)
    with pytest.raises(NotADirectoryError):
        root.open_beneath("d/f/g", os.O_RDONLY)
    with pytest.raises(NotADirectoryError):
        root.open_beneath("d/f", DIRECTORY)


@pytest.mark.parametrize("path", ["bad\0name", "/etc/passwd"])
def test_a_nul_byte_or_an_absolute_path_is_refused_before_any_lookup(root: RootDir, path: str) -> None:
    with pytest.raises(ValueError, match="a relative path without NUL bytes is expected"):
        root.open_beneath(path, os.O_RDONLY)

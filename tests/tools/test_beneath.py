"""Opening paths beneath a directory (`workers.tools.beneath`), with `openat2` and with the component walk.

Every test runs twice: once as this kernel allows (`openat2` where it has it) and once with the
walk forced, so both implementations are held to the same answers. The tests at the end race the
tools themselves against a directory swapped for a symlink out, in threads and in a fork on a live worker.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.live import wait_until
from tests.loop_support import FORK, call, parent_for, step, workdir
from tests.tools_support import run
from workers.client import ForkClient
from workers.records.fork import Status
from workers.tools import beneath
from workers.tools.beneath import ANY, DIRECTORY, RootDir
from workers.tools.builtins import builtin_tools as make_builtin_registry


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


# ── symlink races: resolve and open in one step (issue 11, item 8) ─────────────────────────────

# swaps work/dir (a real directory) and work/swap (a symlink to outside/) atomically, as fast as it can,
# in a process of its own (truly in parallel with the tools), until SIGTERM; it ends with dir real again
SWAPPER = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
swaps = 0
open("swapping", "w").close()
while not stop or swaps % 2:
    if libc.renameat2(-100, b"dir", -100, b"swap", 2) != 0:
        sys.exit(os.strerror(ctypes.get_errno()))
    swaps += 1
print(swaps)
"""


@contextlib.contextmanager
def swapping(work: Path) -> Iterator[list[int]]:
    """work/dir swapped with a symlink to outside/ meanwhile; yields a list that gets the number of swaps."""
    (work / "swap").symlink_to(work.parent / "outside", target_is_directory=True)
    proc = subprocess.Popen([sys.executable, "-c", SWAPPER, str(work)], stdout=subprocess.PIPE)
    counted: list[int] = []
    try:
        wait_until((work / "swapping").exists, what="the swapper to start")
        yield counted
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        counted.append(int(out or 0))
    assert proc.returncode == 0 and (work / "dir").is_dir() and not (work / "dir").is_symlink()


RACE_ATTEMPTS = 3000


RACING_CALLS: list[Callable[[int], tuple[str, dict[str, Any]]]] = [
    lambda i: ("write_file", {"path": f"dir/w{i}.txt", "content": "escaped?"}),
    lambda i: ("write_file", {"path": f"dir/made{i}/w.txt", "content": "escaped?"}),
    lambda i: ("read_file", {"path": "dir/secret.txt"}),
    lambda i: ("edit", {"path": "dir/secret.txt", "old_string": "secret: the key is 42", "new_string": "stolen"}),
    lambda i: ("list_directory", {"path": "dir"}),
    lambda i: ("glob", {"pattern": "only-*", "path": "dir"}),
    lambda i: ("glob", {"pattern": "dir/only-*"}),
    lambda i: ("grep_search", {"pattern": "key is", "path": "dir/secret.txt"}),
    lambda i: ("grep_search", {"pattern": "key is", "path": "dir", "include": "secret.txt"}),
]


def racing_calls(index: int) -> tuple[str, dict[str, Any]]:
    """Attempt `index`: a write (one making a parent directory too), read, edit, listing, glob or grep in dir."""
    return RACING_CALLS[index % len(RACING_CALLS)](index)


def escaped(response: dict[str, Any]) -> bool:
    """Whether a call read, listed or changed something of outside/ (it holds secret.txt and only-outside.txt)."""
    text = str(response.get("output") or response.get("error"))
    return "the key is 42" in text or "only-outside" in text or text.startswith("edited")


@pytest.mark.parametrize("implementation", ["openat2", "walk"])
def test_no_write_or_read_escapes_while_a_directory_is_swapped_for_a_symlink_out(
    work: Path, monkeypatch: pytest.MonkeyPatch, implementation: str
) -> None:
    # Given a directory inside, with a file named like the secret outside, swapped with a symlink out
    if implementation == "walk":
        monkeypatch.setattr("workers.tools.beneath.use_openat2", False)
    outside = work.parent / "outside"
    (outside / "only-outside.txt").touch()
    (work / "dir").mkdir()
    (work / "dir" / "secret.txt").write_text("inside\n", encoding="utf-8")
    before = sorted(os.listdir(outside))
    registry = make_builtin_registry()
    attempts = iter(range(RACE_ATTEMPTS))
    outcomes: list[str] = []
    lock = threading.Lock()

    def attempt() -> None:
        while True:
            with lock:
                index = next(attempts, None)
            if index is None:
                return
            name, args = racing_calls(index)
            response = run(registry, work, name, **args)
            with lock:
                outcomes.append("leak" if escaped(response) else "ok" if "output" in response else "refused")

    # When 4 threads make 3000 calls meanwhile
    with swapping(work) as swaps:
        threads = [threading.Thread(target=attempt) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # Then nothing appeared outside, nothing there was read, listed or edited, while calls did land inside
    assert sorted(os.listdir(outside)) == before
    assert (outside / "secret.txt").read_text(encoding="utf-8") == "secret: the key is 42\n"
    assert outcomes.count("leak") == 0
    assert len(outcomes) == RACE_ATTEMPTS and outcomes.count("ok") > 0
    assert swaps[0] > 100  # the race was on


# ── through real workers: the fork's view of all this ──────────────────────────────────────────


def test_a_fork_writing_while_its_directory_is_swapped_for_a_symlink_writes_nothing_outside(
    live: Callable[..., ForkClient], parent: dict[str, Any], tmp_path: Path
) -> None:
    # Given a fork whose one step writes 150 files below work/dir, while work/dir is swapped with a link out
    work = workdir(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (work / "dir").mkdir()
    writes = [call(f"w{i}", "write_file", path=f"dir/f{i}.txt", content="escaped?") for i in range(150)]
    client = live([step(*writes), step("done")])

    # When it runs meanwhile
    with swapping(work) as swaps:
        result = client.launch(parent_for(parent, work, "yolo"), FORK, workspace="shared").wait(timeout=60)

    # Then it finished and not one file escaped, while writes landed inside and the swapper kept swapping
    assert result.status is Status.SUCCEEDED, result.error
    assert os.listdir(outside) == []
    assert len(os.listdir(work / "dir")) > 0 and swaps[0] > 100

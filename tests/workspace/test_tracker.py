"""The tracker: real trees, real shell commands, and each collect checked against an independent walk of the tree."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.errors import WorkspaceTooLarge
from workers.workspace.manifest import EMPTY, Entry, Manifest, Mode, blob_digest
from workers.workspace.tracker import RACY_NS, Collected, Tracker


def sh(root: Path, command: str) -> None:
    """Run a shell command in the tree, as the shell tool does, and wait for it to end."""
    subprocess.run(["sh", "-c", command], cwd=root, check=True)


def walk(root: Path) -> Manifest:
    """The tree as it is on disk, read without the tracker: files and symlinks, no `.git` at any depth."""
    entries = []
    for folder, subfolders, files in os.walk(root):
        relative = Path(folder).relative_to(root).as_posix()
        subfolders[:] = [f for f in subfolders if f.lower() != ".git"]
        names = [f for f in files if f.lower() != ".git"]
        for name in names + [f for f in subfolders if os.path.islink(os.path.join(folder, f))]:
            full = os.path.join(folder, name)
            path = name if relative == "." else f"{relative}/{name}"
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                data = os.readlink(os.fsencode(full))
            elif stat.S_ISREG(st.st_mode):
                data = Path(full).read_bytes()
            else:
                continue
            entries.append(Entry(path, Mode.of(st.st_mode), len(data), blob_digest(data)))
    return Manifest.of(entries)


def folders(root: Path) -> int:
    """How many folders the tree has (its root included, `.git` folders and what is under them left out)."""
    count = 0
    for _, subfolders, _ in os.walk(root):
        subfolders[:] = [f for f in subfolders if f.lower() != ".git"]
        count += 1
    return count


def kernel_watches() -> int:
    """How many inotify watches this process holds, as the kernel lists them (`/proc/self/fdinfo`)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                count += Path(f"/proc/self/fdinfo/{fd}").read_text().count("inotify wd:")
        except OSError:
            continue
    return count


def base_tree(root: Path) -> Manifest:
    """A small tree: files at the root and in nested folders, an executable and a symlink."""
    sh(
        root,
        "mkdir -p src/pkg docs && printf 'print(1)\\n' > src/main.py && printf 'x = 1\\n' > src/pkg/mod.py"
        " && printf '# readme\\n' > README.md && printf 'guide\\n' > docs/guide.md"
        " && printf '#!/bin/sh\\n' > run.sh && chmod +x run.sh && ln -s src/main.py link",
    )
    return walk(root)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, Tracker]]:
    """A materialized tree and its started tracker (inotify), closed after the test."""
    root = tmp_path / "tree"
    root.mkdir()
    tracker = Tracker(root, base_tree(root))
    tracker.start()
    assert tracker.watching
    yield root, tracker
    tracker.close()


def collect_checked(root: Path, tracker: Tracker) -> Collected:
    """A collect, checked: the tracker's tree is the disk's, every new digest's bytes come with it, and it watches
    each folder of the tree once (none moved out or removed)."""
    before = tracker.manifest
    collected = tracker.collect()
    assert tracker.manifest == walk(root)
    if tracker.watching:
        assert kernel_watches() == folders(root)
    assert before.apply(collected.changes) == tracker.manifest
    new = {e.digest for e in collected.changes.values() if e is not None} - before.digests()
    assert set(collected.blobs) == new
    assert all(blob_digest(data) == digest for digest, data in collected.blobs.items())
    return collected


def test_a_collect_with_nothing_done_reports_nothing(tree: tuple[Path, Tracker]) -> None:
    _, tracker = tree
    assert tracker.collect() == Collected({}, {}, rescanned=False)


def test_a_file_edited_by_sed_is_one_change_with_its_new_bytes(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "sed -i 's/1/2/' src/main.py")
    collected = collect_checked(root, tracker)
    assert collected.changes == {"src/main.py": Entry("src/main.py", Mode.FILE, 9, blob_digest(b"print(2)\n"))}
    assert collected.blobs == {blob_digest(b"print(2)\n"): b"print(2)\n"}
    assert not collected.rescanned


def test_a_second_collect_returns_nothing(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "echo more >> README.md && touch new.txt")
    assert set(collect_checked(root, tracker).changes) == {"README.md", "new.txt"}
    assert tracker.collect().changes == {}


def test_created_deleted_and_renamed_files_are_reported(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "echo new > src/new.py && rm docs/guide.md && mv src/pkg/mod.py src/pkg/renamed.py")
    collected = collect_checked(root, tracker)
    assert set(collected.changes) == {"src/new.py", "docs/guide.md", "src/pkg/mod.py", "src/pkg/renamed.py"}
    assert collected.changes["docs/guide.md"] is None and collected.changes["src/pkg/mod.py"] is None
    # a renamed file's blob is stored already: only the new file's bytes come back
    assert collected.blobs == {blob_digest(b"new\n"): b"new\n"}


def test_a_mode_change_is_reported_without_a_blob(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "chmod +x README.md && chmod -x run.sh")
    collected = collect_checked(root, tracker)
    assert {p: e.mode for p, e in collected.changes.items() if e} == {"README.md": Mode.EXECUTABLE, "run.sh": Mode.FILE}
    assert collected.blobs == {}


def test_symlinks_are_entries_of_their_target_and_never_followed(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "ln -s /etc/hostname outside && ln -sfn docs/guide.md link && ln -s src srclink")
    collected = collect_checked(root, tracker)
    assert collected.changes == {
        "link": Entry("link", Mode.SYMLINK, 13, blob_digest(b"docs/guide.md")),
        "outside": Entry("outside", Mode.SYMLINK, 13, blob_digest(b"/etc/hostname")),
        "srclink": Entry("srclink", Mode.SYMLINK, 3, blob_digest(b"src")),
    }
    sh(root, "echo changed > srclink/through.py")  # written through a link into the tree: seen at its real path
    assert set(collect_checked(root, tracker).changes) == {"src/through.py"}


def test_a_folder_made_with_its_files_in_one_command_is_seen_whole(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "mkdir -p a/b/c && echo deep > a/b/c/f && echo mid > a/b/g")
    assert set(collect_checked(root, tracker).changes) == {"a/b/c/f", "a/b/g"}
    sh(root, "echo later >> a/b/c/f")  # the new folders are watched from now on
    assert set(collect_checked(root, tracker).changes) == {"a/b/c/f"}


def test_a_removed_folder_removes_every_file_under_it(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "rm -rf src")
    assert collect_checked(root, tracker).changes == {"src/main.py": None, "src/pkg/mod.py": None}


def test_a_folder_moved_out_and_in_is_removed_and_added(tree: tuple[Path, Tracker], tmp_path: Path) -> None:
    root, tracker = tree
    outside = tmp_path / "outside"
    sh(root, f"mv src {outside}")
    assert collect_checked(root, tracker).changes == {"src/main.py": None, "src/pkg/mod.py": None}
    sh(root, f"echo ignored > {outside}/pkg/after.py")  # no longer in the tree: no change
    assert tracker.collect().changes == {}
    sh(root, f"mv {outside} back")
    assert set(collect_checked(root, tracker).changes) == {"back/main.py", "back/pkg/mod.py", "back/pkg/after.py"}
    sh(root, "echo edit >> back/pkg/after.py")
    assert set(collect_checked(root, tracker).changes) == {"back/pkg/after.py"}


def test_a_folder_renamed_in_the_tree_keeps_being_watched_at_its_new_path(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "echo edited >> src/pkg/mod.py && mv src lib && echo added > lib/pkg/new.py")
    changes = collect_checked(root, tracker).changes
    assert set(changes) == {"src/main.py", "src/pkg/mod.py", "lib/main.py", "lib/pkg/mod.py", "lib/pkg/new.py"}
    sh(root, "echo again >> lib/pkg/new.py && mkdir src && echo back > src/main.py")
    assert set(collect_checked(root, tracker).changes) == {"lib/pkg/new.py", "src/main.py"}


def test_a_file_replaced_by_a_folder_and_back_is_tracked(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "rm README.md && mkdir -p README.md/inner && echo x > README.md/inner/f && rm -rf docs && echo y > docs")
    changes = collect_checked(root, tracker).changes
    assert set(changes) == {"README.md", "README.md/inner/f", "docs/guide.md", "docs"}
    sh(root, "rm -rf README.md && echo z > README.md")
    assert set(collect_checked(root, tracker).changes) == {"README.md", "README.md/inner/f"}


def test_a_file_rewritten_with_the_same_bytes_is_no_change(tree: tuple[Path, Tracker], tmp_path: Path) -> None:
    root, tracker = tree
    copy = tmp_path / "copy"
    sh(root, f"printf 'print(1)\\n' > src/main.py && cp README.md {copy} && cp {copy} README.md")
    sh(root, "sed -i 's/nothing/matches/' docs/guide.md && touch run.sh")
    assert collect_checked(root, tracker).changes == {}


def test_git_folders_are_not_part_of_the_tree_at_any_depth(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    git = "git -c user.name=t -c user.email=t@t"
    sh(root, f"git init -q && {git} add -A && {git} commit -qm base && mkdir -p sub/.git sub/.GIT/x docs/more")
    sh(root, "echo nested > sub/.git/config && echo y > sub/.GIT/x/y && echo f > sub/f && git -C docs/more init -q")
    assert set(collect_checked(root, tracker).changes) == {"sub/f"}
    sh(root, f"echo edit >> README.md && {git} commit -qam edit && echo z > sub/.git/z && rm -rf docs/more/.git")
    assert set(collect_checked(root, tracker).changes) == {"README.md"}


def test_many_changes_in_one_call_are_all_reported(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    sh(root, "mkdir many && for i in $(seq 1 500); do echo $i > many/f$i; done && rm src/main.py && chmod +x docs/*")
    changes = collect_checked(root, tracker).changes
    assert len(changes) == 500 + 2


def test_an_overflowed_event_queue_falls_back_to_a_full_rescan(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    # Given a watched folder, and more events in one call than the kernel queues (two per new file: create, close)
    sh(root, "mkdir flood")
    assert tracker.collect().changes == {}
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    count = limit // 2 + 100
    script = f"for i in range({count}):\n    open(f'flood/{{i}}', 'w').close()\n"
    subprocess.run([sys.executable, "-c", script + "open('README.md', 'a').write('end')"], cwd=root, check=True)
    # When collecting, then the whole tree was walked, and nothing was missed
    collected = collect_checked(root, tracker)
    assert collected.rescanned
    assert len(collected.changes) == count + 1
    # and the watches are whole again: the next call is found from events
    sh(root, "echo after > flood/0")
    collected = collect_checked(root, tracker)
    assert not collected.rescanned and set(collected.changes) == {"flood/0"}


def settled(root: Path) -> None:
    """Wait until every file of the tree is older than the racy window, so the tracker trusts its stat."""
    newest = max(os.lstat(os.path.join(d, n)).st_ctime_ns for d, _, names in os.walk(root) for n in names)
    while time.time_ns() < newest + RACY_NS + 10_000_000:
        time.sleep(0.01)


def test_without_inotify_every_collect_rescans_and_finds_a_rewrite_with_its_mtime_put_back(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    tracker = Tracker(root, base_tree(root), use_inotify=False)
    settled(root)
    tracker.start()
    assert not tracker.watching
    assert tracker.collect() == Collected({}, {}, rescanned=True)
    # Given a file rewritten with other bytes of the same size and its mtime put back, and a mode change
    old = os.stat(root / "src/main.py")
    sh(root, "printf 'print(3)\\n' > src/main.py && chmod +x README.md")
    os.utime(root / "src/main.py", ns=(old.st_atime_ns, old.st_mtime_ns))
    now = os.stat(root / "src/main.py")
    assert (now.st_size, now.st_ino, now.st_mtime_ns) == (old.st_size, old.st_ino, old.st_mtime_ns)
    # Then the ctime still tells: both changes are found
    collected = collect_checked(root, tracker)
    assert collected.rescanned and set(collected.changes) == {"src/main.py", "README.md"}
    sh(root, "mkdir -p n/m && echo x > n/m/f && rm -rf docs")
    assert set(collect_checked(root, tracker).changes) == {"n/m/f", "docs/guide.md"}


def test_start_reports_where_the_tree_differs_from_its_manifest(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    manifest = base_tree(root)
    sh(root, "rm docs/guide.md && echo extra > extra.txt && echo longer >> README.md")
    tracker = Tracker(root, manifest)
    tracker.start()
    assert set(collect_checked(root, tracker).changes) == {"docs/guide.md", "extra.txt", "README.md"}
    tracker.close()


def test_a_tree_over_the_bounds_raises_and_its_changes_wait_for_the_next_collect(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    manifest = base_tree(root)
    tracker = Tracker(root, manifest, max_files=len(manifest) + 2, max_bytes=10_000)
    tracker.start()
    sh(root, "mkdir big && head -c 20000 /dev/zero > big/blob && echo small > small.txt")
    with pytest.raises(WorkspaceTooLarge) as raised:
        tracker.collect()
    assert raised.value.largest[0] == ("big", 20_000, 1)
    assert "FORKQ_WORKSPACE_MAX_BYTES" in str(raised.value)
    assert tracker.manifest == manifest  # nothing kept
    sh(root, "rm -rf big")
    # the call that made the tree too big and the one that fixed it are reported together
    assert set(collect_checked(root, tracker).changes) == {"small.txt"}
    sh(root, "touch a b c")
    with pytest.raises(WorkspaceTooLarge, match="files"):
        tracker.collect()
    tracker.close()


def test_names_a_manifest_cannot_hold_are_reported_and_left_out(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    (root / os.fsdecode(b"bad\xff")).write_bytes(b"x")
    sh(root, "mkfifo pipe && echo ok > fine")
    collected = tracker.collect()
    assert set(collected.changes) == {"fine"}
    assert len(collected.skipped) == 1 and collected.skipped[0].startswith("bad\\xff: not valid UTF-8")


def test_trackers_in_threads_see_only_their_own_tree(tmp_path: Path) -> None:
    roots = [tmp_path / f"tree{i}" for i in range(4)]
    trackers = []
    for root in roots:
        root.mkdir()
        trackers.append(Tracker(root, EMPTY))
        trackers[-1].start()
    results: dict[int, Collected] = {}

    def step(i: int) -> None:
        sh(roots[i], f"echo {i} > mine{i} && mkdir -p d{i} && echo {i} > d{i}/f")
        results[i] = trackers[i].collect()

    threads = [threading.Thread(target=step, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, tracker in enumerate(trackers):
        assert set(results[i].changes) == {f"mine{i}", f"d{i}/f"}
        tracker.close()


def test_random_shell_steps_keep_the_tracked_tree_equal_to_the_disk(tree: tuple[Path, Tracker]) -> None:
    root, tracker = tree
    rng = random.Random(29)
    steps = [
        "mkdir -p {d} && echo {n} > {d}/{f}",
        "echo {n} >> {f}",
        "rm -rf {d}",
        "mv {d} {e} 2>/dev/null || true",
        "chmod +x {f} 2>/dev/null || true",
        "ln -sfn {f} {g}",
        "rm -f {f}",
        "mkdir -p {d} && mv {f} {d}/ 2>/dev/null || true",
        "sed -i 's/1/9/' {f} 2>/dev/null || true",
    ]
    for n in range(60):
        names = {k: rng.choice(["a", "b", "a/b", "b/c", "c"]) for k in "de"}
        names.update({k: rng.choice(["x", "y", "a/x", "b/c/y", "z"]) for k in "fg"})
        commands = " ; ".join(rng.choice(steps).format(n=n, **names) for _ in range(rng.randint(1, 4)))
        sh(root, commands + " ; true")
        collect_checked(root, tracker)
    assert tracker.collect().changes == {}


def test_a_rewrite_of_the_same_size_with_its_mtime_put_back_is_read_again(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    tracker = Tracker(root, base_tree(root))
    settled(root)
    tracker.start()
    # Given a trusted stat row, then a write whose size and mtime end as before
    old = os.stat(root / "docs/guide.md")
    sh(root, "printf 'GUIDE\\n' > docs/guide.md && chmod +x docs/guide.md")
    os.utime(root / "docs/guide.md", ns=(old.st_atime_ns, old.st_mtime_ns))
    # Then the write's event has it read again: its new bytes are found, not only its new mode
    changes = collect_checked(root, tracker).changes
    assert changes == {"docs/guide.md": Entry("docs/guide.md", Mode.EXECUTABLE, 6, blob_digest(b"GUIDE\n"))}
    tracker.close()


WATCH_LIMIT_SCRIPT = """
import json, os, subprocess, sys
from pathlib import Path
from workers.workspace.manifest import EMPTY
from workers.workspace.tracker import Tracker

root = Path(sys.argv[1])
# this user namespace's own watch limit: the tree's 3 folders, and 2 more
Path("/proc/sys/user/max_inotify_watches").write_text("5")
subprocess.run("mkdir -p a/b && echo 1 > a/b/f", shell=True, cwd=root, check=True)
tracker = Tracker(root, EMPTY)
tracker.start()
steps = [[tracker.watching, sorted(tracker.collect().changes)]]
subprocess.run("mkdir -p c/d/e/f && echo 2 > c/d/e/f/g && echo 3 >> a/b/f", shell=True, cwd=root, check=True)
collected = tracker.collect()
steps.append([tracker.watching, sorted(collected.changes), collected.rescanned])
subprocess.run("echo 4 > c/d/e/h && rm a/b/f", shell=True, cwd=root, check=True)
collected = tracker.collect()
steps.append([tracker.watching, sorted(collected.changes), collected.rescanned])
print(json.dumps(steps))
"""


def in_user_namespace(script: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run a Python script in a new user namespace, where it may set its own inotify limits (no privilege)."""
    probe = subprocess.run(["unshare", "-U", "-r", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no user namespace to set inotify limits in: {probe.stderr.decode().strip()}")
    return subprocess.run(
        ["unshare", "-U", "-r", sys.executable, "-c", script, str(root)], capture_output=True, text=True, check=True
    )


def test_the_watch_limit_turns_the_tracker_to_rescans_without_losing_a_change(tmp_path: Path) -> None:
    # Given a user namespace whose inotify watch limit is below what the tree grows to
    root = tmp_path / "tree"
    root.mkdir()
    out = in_user_namespace(WATCH_LIMIT_SCRIPT, root)
    # Then the collect that reached the limit still found everything, and the next ones walk the tree
    assert json.loads(out.stdout) == [
        [True, ["a/b/f"]],
        [False, ["a/b/f", "c/d/e/f/g"], False],
        [False, ["a/b/f", "c/d/e/h"], True],
    ]
    assert "watch limit reached" in out.stderr


NO_INSTANCE_SCRIPT = """
import json, subprocess, sys
from pathlib import Path
from workers.workspace.manifest import EMPTY
from workers.workspace.tracker import Tracker

root = Path(sys.argv[1])
Path("/proc/sys/user/max_inotify_instances").write_text("0")
tracker = Tracker(root, EMPTY)
tracker.start()
subprocess.run("mkdir -p a && echo 1 > a/f", shell=True, cwd=root, check=True)
collected = tracker.collect()
print(json.dumps([tracker.watching, sorted(collected.changes), collected.rescanned]))
"""


def test_a_tracker_without_inotify_instances_left_rescans(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    out = in_user_namespace(NO_INSTANCE_SCRIPT, root)
    assert json.loads(out.stdout) == [False, ["a/f"], True]
    assert "inotify_init1 failed" in out.stderr

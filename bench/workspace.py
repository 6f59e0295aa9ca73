"""Benchmark: snapshot workspaces, each figure beside its baseline from the same run, in one table.

Run: `python bench/workspace.py [--quick]`. Generates a source tree in git (bench/workspace_tree.py: 10,000 files,
100 MB; `--quick`: 2,000 files, 20 MB), starts a private redis-server, and measures:

1. snapshot at launch: `ForkClient.launch(workspace="snapshot")` with an empty stat cache and an empty Redis (the
   first launch: list, hash, store every blob) vs the floor, `git ls-files` + SHA-256 of every listed byte (rounds
   interleaved, medians); a sibling launch with nothing changed (p50, vs a `shared` launch of the same parent); a
   launch after one file is edited: the blobs it stored (blob keys counted in Redis) and the bytes it sent;
2. materialize on a worker (`workers.workspace.materialize.build` from the launch's manifest, as a worker builds:
   `trusted` fetch, cache written by its background thread), on each `--dir` (default: the temp folder, where
   FORKQ_WORKSPACE_DIR defaults to, and tmpfs /dev/shm), rounds interleaved across them: a warm cache vs `cp -r`
   of the built tree, a cold cache (every blob fetched from Redis, verified once, written) vs MGET of every blob
   and vs MGET + writing the files, the floor of any cold build (writing the same files from bytes already in
   memory, no Redis: when it alone exceeds 1.5× the MGET, the cold target cannot be met by faster fetching),
   the cold build as it was before (each blob verified twice, cached inline),
   and the git base commit (`git=True`, warm) vs `cp -r` + `git init/add/commit`;
3. a step's checkpoint (`RunWorkspace.checkpoint`: the inotify tracker's collect, then the changed blobs stored)
   after `sed -i` edits one random file through the real shell tool (sandboxed where the machine can), vs a
   full rescan of the tree (the tracker without inotify) plus the same store;
4. Redis memory: used_memory after 100 sibling snapshot launches (records, seeds, queued jobs, blobs, manifest)
   vs the tree's bytes stored once, raw (one SET per file);
5. revival (bench/workspace_revival.py): SIGKILL of the worker running a snapshot fork → the fork's next step on
   another worker (its own mount namespace, where the parent's folder is an empty tmpfs) with the workspace rebuilt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/workspace.py` puts bench/, not the repo root, on sys.path
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.revival import pct  # noqa: E402
from bench.workspace_snapshot import floor  # noqa: E402
from bench.workspace_tree import make_tree  # noqa: E402
from broker_config.settings import Settings  # noqa: E402
from workers.client import ForkClient  # noqa: E402
from workers.demo.redis_server import RedisServer  # noqa: E402
from workers.history.snapshot import ParentSnapshot, parse_parent_snapshot  # noqa: E402
from workers.service.workspace import RunWorkspace, worker_cache  # noqa: E402
from workers.store.blobs import BlobStore  # noqa: E402
from workers.tools.registry import ToolContext  # noqa: E402
from workers.tools.shell import run_shell_command  # noqa: E402
from workers.workspace.manifest import Manifest  # noqa: E402
from workers.workspace.materialize import WorkspaceCache, build, remove_tree  # noqa: E402
from workers.workspace.sandbox import probe  # noqa: E402
from workers.workspace.snapshot import snapshot  # noqa: E402
from workers.workspace.statcache import RACY_NS  # noqa: E402
from workers.workspace.tracker import Tracker  # noqa: E402

EXAMPLE_PARENT = ROOT / "workers" / "examples" / "parent.json"
PARAMS = {"description": "workspace bench fork", "prompt": "Edit the tree.", "subagent_type": "fork"}
IDLE_QUEUE = "bench-workspace-idle"  # no worker consumes it: launches stay queued
MB = 1024 * 1024
GIT_QUIET = ("-c", "user.name=bench", "-c", "user.email=bench@example.invalid", "-c", "commit.gpgsign=false")


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the issue's (full) or `--quick`'s."""

    files: int
    total_bytes: int
    rounds: int  # first launches and materializations, interleaved with their baselines
    siblings: int  # timed sibling launches
    checkpoints: int
    memory_forks: int
    kills: int
    revival_files: int
    revival_bytes: int
    quick: bool


FULL = Plan(10_000, 100 * MB, 5, 30, 100, 100, 20, 1_000, 10 * MB, False)
QUICK = Plan(2_000, 20 * MB, 3, 15, 30, 100, 5, 1_000, 10 * MB, True)


@dataclass(frozen=True)
class Row:
    """One line of the table: forkq's figure, its baseline's, their ratio and the target."""

    label: str
    forkq: str
    baseline: str
    ratio: float | None
    target: str
    ok: bool | None  # None: no target

    def line(self) -> str:
        """The row as printed."""
        ratio = "—" if self.ratio is None else f"{self.ratio:.2f}×"
        verdict = {True: "pass", False: "FAIL", None: ""}[self.ok]
        return f"{self.label:<62} {self.forkq:>11} {self.baseline:>11} {ratio:>7}  {self.target:<9} {verdict}".rstrip()


def ms(seconds: float) -> str:
    """Seconds as milliseconds for the table."""
    return f"{seconds * 1000:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1000:.1f} ms"


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def parent_at(root: Path) -> ParentSnapshot:
    """The example parent, working in `root`, in `yolo` (its forks' shell calls need no approval)."""
    raw = json.loads(EXAMPLE_PARENT.read_text())
    return parse_parent_snapshot({**raw, "cwd": str(root), "approval_mode": "yolo"})


def fresh_home(tmp: Path, name: str) -> Path:
    """Point HOME at an empty folder: the launcher's stat cache (under ~/.cache) starts empty."""
    home = tmp / "homes" / name
    home.mkdir(parents=True)
    os.environ["HOME"] = str(home)
    return home


def blob_keys(r: redis.Redis, blobs: BlobStore) -> int:
    """Workspace blobs stored in Redis (keys of the blob template, counted with SCAN)."""
    prefix = blobs.keys.blob(blobs.scope, "0" * 64)[:-64]
    return sum(1 for _ in r.scan_iter(match=prefix + "*", count=1000))


def net_in(r: redis.Redis) -> int:
    """Bytes Redis has read from its clients so far."""
    return int(r.info("stats")["total_net_input_bytes"])


# ── 1. snapshot at launch ─────────────────────────────────────────────────────────────────────


@dataclass
class Launches:
    """What the launch rows measured, and the last launch's manifest (for the next rows)."""

    rows: list[Row]
    manifest: Manifest
    fork_id: str
    notes: list[str]


def first_launches(r: redis.Redis, settings: Settings, root: Path, tmp: Path, rounds: int) -> tuple[Row, str]:
    """The first launch (empty stat cache, empty Redis) vs the floor, interleaved; the row and a note."""
    floors, firsts = [], []
    for i in range(rounds):
        floors.append(timed(lambda: floor(root)))
        r.flushall()
        fresh_home(tmp, f"first{i}")
        with ForkClient(settings, redis_client=r) as client:
            parent = parent_at(root)
            firsts.append(timed(lambda: client.launch(parent, PARAMS, workspace="snapshot")))  # noqa: B023
    fresh_home(tmp, "alone")
    alone = timed(lambda: snapshot(root, max_bytes=1 << 40, max_files=10**6, cache_dir=None))
    f, b = statistics.median(firsts), statistics.median(floors)
    note = (
        f"first launch: median of {rounds} rounds (min {ms(min(firsts))}); floor min {ms(min(floors))}; "
        f"snapshot() alone (no cache, nothing stored): {ms(alone)}"
    )
    return Row("snapshot: first launch (list + hash + store)", ms(f), ms(b), f / b, "≤ 1.5×", f / b <= 1.5), note


def launch_rows(r: redis.Redis, settings: Settings, root: Path, tmp: Path, plan: Plan) -> Launches:
    """Row 1: the first launch, sibling launches, and a launch after one edit."""
    first, note = first_launches(r, settings, root, tmp, plan.rounds)
    client = ForkClient(settings, redis_client=r)
    parent = parent_at(root)
    client.launch(parent, PARAMS, workspace="snapshot")  # the stat cache of this HOME learns the tree
    siblings, shared = [], []
    for _ in range(plan.siblings):
        siblings.append(timed(lambda: client.launch(parent, PARAMS, workspace="snapshot")))
        shared.append(timed(lambda: client.launch(parent, PARAMS, workspace="shared")))
    s50, b50 = statistics.median(siblings), statistics.median(shared)
    sibling = Row(
        "snapshot: sibling launch, nothing changed (p50)", ms(s50), ms(b50), s50 / b50, "≤ 50 ms", s50 <= 0.05
    )
    # one file edited: the launch stores that file's blob only
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    edited = root / listed[len(listed) // 2]
    edited.write_bytes(edited.read_bytes() + b"\n# edited\n")
    keys_before, sent_before = blob_keys(r, client.blobs), net_in(r)
    took = time.perf_counter()
    handle = client.launch(parent, PARAMS, workspace="snapshot")
    took = time.perf_counter() - took
    stored, sent = blob_keys(r, client.blobs) - keys_before, net_in(r) - sent_before
    one = Row("snapshot: one file edited → blobs stored", str(stored), "1", None, "= 1", stored == 1)
    record = client.store.get_record(handle.fork_id, None)
    assert record.workspace is not None and record.workspace.manifest is not None
    manifest = client.blobs.get_manifest(record.workspace.manifest)
    notes = [
        note,
        f"sibling launch: p50 of {plan.siblings} (p99 {ms(pct(siblings, 99))}); baseline: a `shared` launch of the "
        f"same parent (no files), p50",
        f"one edit: {edited.stat().st_size:,} byte file; the launch took {ms(took)} and sent {sent:,} bytes to Redis",
    ]
    client.close()
    return Launches([first, sibling, one], manifest, handle.fork_id, notes)


# ── 2. materialize ────────────────────────────────────────────────────────────────────────────


def mget_all(r: redis.Redis, blobs: BlobStore, digests: list[str]) -> int:
    """Read every blob with MGET (1,000 keys a call, as BlobStore.get batches): the bytes read."""
    got = 0
    for i in range(0, len(digests), 1000):
        got += sum(len(v) for v in r.mget([blobs.keys.blob(blobs.scope, d) for d in digests[i : i + 1000]]) if v)
    return got


def mget_write(r: redis.Redis, blobs: BlobStore, manifest: Manifest, dest: Path) -> None:
    """MGET every blob and write each file with its mode, unverified: the least a cold build could do."""
    entries = list(manifest)
    for i in range(0, len(entries), 1000):
        batch = entries[i : i + 1000]
        values = r.mget([blobs.keys.blob(blobs.scope, e.digest) for e in batch])
        for entry, data in zip(batch, values, strict=True):
            assert isinstance(data, bytes), entry
            path = dest / entry.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(entry.mode & 0o777)


def write_from_memory(manifest: Manifest, contents: dict[str, bytes], dest: Path) -> None:
    """Create every folder, then write every file with its mode from bytes already in memory (no Redis, nothing
    verified): the floor of any cold build, which must create the same files."""
    root = str(dest)
    folders = sorted({e.path.rsplit("/", 1)[0] for e in manifest if "/" in e.path})
    os.makedirs(root)
    for folder in folders:
        os.makedirs(f"{root}/{folder}", exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for entry in manifest:
        fd = os.open(f"{root}/{entry.path}", flags, entry.mode & 0o777)
        try:
            os.write(fd, contents[entry.digest])
        finally:
            os.close(fd)


def cp_git(source: Path, dest: Path) -> None:
    """`cp -r`, then a repository whose one commit is the copy: the baseline of a build with git."""
    subprocess.run(["cp", "-r", str(source), str(dest)], check=True)
    for args in (["init", "-q"], ["add", "-A"], [*GIT_QUIET, "commit", "-q", "-m", "base"]):
        subprocess.run(["git", *args], cwd=dest, check=True, capture_output=True)


def filesystem(folder: Path) -> str:
    """The type of the filesystem holding `folder` (`tmpfs`, `ext2/ext3`, ...), as `stat -f` names it."""
    done = subprocess.run(["stat", "-f", "-c", "%T", str(folder)], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def cpu_s() -> float:
    """CPU seconds this process has used so far (every thread, user + kernel)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Samples:
    """The seconds of each timed thing over the rounds, and the CPU seconds of some."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def time(self, name: str, fn: Callable[[], object]) -> None:
        """Run `fn`, adding its wall and CPU seconds to `name`."""
        c = cpu_s()
        self.wall.setdefault(name, []).append(timed(fn))
        self.cpu.setdefault(name, []).append(cpu_s() - c)

    def med(self, name: str) -> float:
        """The median wall seconds of `name`."""
        return statistics.median(self.wall[name])

    def summary(self, name: str) -> str:
        """`name`'s median and min wall time and median CPU time, for the notes."""
        return (
            f"{name} {ms(self.med(name))} (min {ms(min(self.wall[name]))}, CPU {ms(statistics.median(self.cpu[name]))})"
        )


def materialize_round(
    r: redis.Redis, blobs: BlobStore, manifest: Manifest, contents: dict[str, bytes], work: Path, *, got: Samples
) -> None:
    """One round of every materialize measurement in `work` (a folder on the filesystem measured); `contents`: every
    blob's bytes, already in memory."""
    digests = sorted(manifest.digests())
    out = work / "built"
    room = 4 * manifest.total_bytes + MB
    before = WorkspaceCache(work / "cache-before", room)  # as before: each blob verified twice, cached inline
    got.time("cold, as before", lambda: build(manifest, out / "before", before, blobs.get))
    got.time("MGET", lambda: mget_all(r, blobs, digests))
    cache = WorkspaceCache(work / "cache", room, deferred=True)  # as a worker's (`worker_cache`)
    got.time("cold", lambda: build(manifest, out / "cold", cache, blobs.get, trusted=True))
    got.time("cache written after", cache.flush)
    got.time("MGET + write", lambda: mget_write(r, blobs, manifest, out / "mget"))
    got.time("write from memory", lambda: write_from_memory(manifest, contents, out / "memory"))
    got.time("warm", lambda: build(manifest, out / "warm", cache, blobs.get, trusted=True))
    got.time("cp -r", lambda: subprocess.run(["cp", "-r", str(out / "warm"), str(out / "cp")], check=True))
    got.time("warm + git", lambda: build(manifest, out / "git", cache, blobs.get, git=True, trusted=True))
    got.time("cp + git", lambda: cp_git(out / "warm", out / "cpgit"))
    cache.flush()  # its writer thread done before the folder goes
    remove_tree(work)
    os.sync()  # the next round's first build does not pay for this one's removal


def materialize_rows(
    r: redis.Redis, blobs: BlobStore, manifest: Manifest, places: Sequence[Path], rounds: int
) -> tuple[list[Row], list[str]]:
    """Row 2, on each folder of `places`: cold and warm builds vs MGET and `cp -r`, and the git base commit, in
    rounds interleaved across the places; the rows and notes."""
    found = {place: Samples({}, {}) for place in places}
    contents = dict(blobs.get(manifest.digests()))
    for i in range(rounds):
        for place, got in found.items():
            work = Path(tempfile.mkdtemp(prefix=f"materialize{i}-", dir=place))
            materialize_round(r, blobs, manifest, contents, work, got=got)
    rows, notes = [], []
    for place, got in found.items():
        at = f"[{filesystem(place)} {place}]"
        w, p, c, g = got.med("warm"), got.med("cp -r"), got.med("cold"), got.med("MGET")
        old, z, x, y = got.med("cold, as before"), got.med("MGET + write"), got.med("warm + git"), got.med("cp + git")
        m = got.med("write from memory")
        rows += [
            Row(f"materialize {at}: warm cache vs cp -r", ms(w), ms(p), w / p, "≤ 2×", w / p <= 2),
            Row(f"materialize {at}: cold cache vs MGET", ms(c), ms(g), c / g, "≤ 1.5×", c / g <= 1.5),
            Row(f"materialize {at}: floor: write the files from memory vs MGET", ms(m), ms(g), m / g, "—", None),
            Row(f"materialize {at}: cold, as before vs MGET", ms(old), ms(g), old / g, "—", None),
            Row(f"materialize {at}: cold vs MGET + write", ms(c), ms(z), c / z, "—", None),
            Row(f"materialize {at}: warm + git vs cp + git commit", ms(x), ms(y), x / y, "—", None),
        ]
        names = ["cold", "cold, as before", "cache written after", "MGET", "MGET + write", "write from memory", "warm"]
        names.append("cp -r")
        notes.append(f"materialize {at}: " + "; ".join(got.summary(n) for n in names))
    return rows, notes


# ── 3. a step's checkpoint ────────────────────────────────────────────────────────────────────


def checkpoint_rows(client: ForkClient, fork_id: str, tmp: Path, runs: int, sandbox: str) -> tuple[list[Row], str]:
    """Row 3: `sed -i` through the shell tool, then the run's checkpoint vs a full rescan; the rows and a note."""
    record = client.store.get_record(fork_id, None)
    settings = Settings(redis_url=client.settings.redis_url, workspace_dir=tmp / "worker", sandbox=sandbox)
    run = RunWorkspace(record, settings=settings, blobs=client.blobs, cache=worker_cache(settings), epoch=1)
    run.open({})
    ctx = run.context(ToolContext(fork_id=fork_id, cwd=Path(record.cwd), call_id=None, idempotency_key="bench"))
    assert run.tracker is not None  # the context waits for the tree (its git base is made in the background)
    time.sleep(0.3)  # the built files' mtimes age out of the tracker's racy window, as before a fork's first call
    rescan = Tracker(run.root, run.tracker.manifest, use_inotify=False)
    rescan.start()
    paths = [e.path for e in run.tracker.manifest]
    rng = random.Random(29)
    forkq, baseline, sizes, shell = [], [], [], []
    try:
        for i in range(runs):
            path = rng.choice(paths)
            shell.append(timed(lambda: run_shell_command({"command": f"sed -i '1i # edit {i}' {path}"}, ctx)))  # noqa: B023
            start = time.perf_counter()
            journaled = run.checkpoint()
            forkq.append(time.perf_counter() - start)
            assert journaled is not None and len(journaled) == 1, journaled
            start = time.perf_counter()
            found = rescan.collect()
            client.blobs.put(found.blobs)
            baseline.append(time.perf_counter() - start)
            assert list(found.changes) == [path], found.changes
            sizes.append((run.root / path).stat().st_size)
    finally:
        rescan.close()
        run.close()
    f50, b50, f99, b99 = (pct(v, p) for p in (50, 99) for v in (forkq, baseline))
    rows = [
        Row("checkpoint after `sed -i` of one file, p50", ms(f50), ms(b50), f50 / b50, "≤ 20 ms", f50 <= 0.02),
        Row("checkpoint after `sed -i` of one file, p99", ms(f99), ms(b99), f99 / b99, "—", None),
    ]
    note = (
        f"checkpoint: {runs} shell calls (sandbox {sandbox}; the call itself: p50 {ms(statistics.median(shell))}), "
        f"a random file each (median "
        f"{statistics.median(sizes):,.0f} bytes, max {max(sizes):,}); max {ms(max(forkq))}; "
        f"baseline: rescan of {len(paths):,} files + the same store"
    )
    return rows, note


# ── 4. Redis memory ───────────────────────────────────────────────────────────────────────────


def used_memory(r: redis.Redis) -> int:
    """Redis's used_memory now."""
    return int(r.info("memory")["used_memory"])


def memory_rows(r: redis.Redis, settings: Settings, root: Path, manifest: Manifest, forks: int) -> tuple[Row, str]:
    """Row 4: used_memory of `forks` sibling snapshot launches vs the tree stored once, raw."""
    r.flushall()
    before = used_memory(r)
    with ForkClient(settings, redis_client=r) as client:
        parent = parent_at(root)
        for _ in range(forks):
            client.launch(parent, PARAMS, workspace="snapshot")
    forkq = used_memory(r) - before
    r.flushall()
    before = used_memory(r)
    pipe, carried = r.pipeline(transaction=False), 0
    for entry in manifest:
        data = (root / entry.path).read_bytes()
        pipe.set(f"raw:{entry.path}", data)
        carried += len(data)
        if carried > 8 * MB:
            pipe.execute()
            pipe, carried = r.pipeline(transaction=False), 0
    pipe.execute()
    raw = used_memory(r) - before
    r.flushall()
    tree = manifest.total_bytes
    ratio = forkq / raw
    label = f"Redis memory: {forks} sibling snapshot forks"
    row = Row(label, f"{forkq / MB:.1f} MB", f"{raw / MB:.1f} MB", ratio, "≤ 1.1×", ratio <= 1.1)
    note = (
        f"memory: used_memory deltas; baseline = one SET per file of the tree ({tree / MB:.1f} MB of bytes); "
        f"forkq / tree bytes = {forkq / tree:.3f}×"
    )
    return row, note


# ── 5. revival ────────────────────────────────────────────────────────────────────────────


def revival_row(redis_url: str, tmp: Path, plan: Plan, sandbox: str) -> tuple[Row, str]:
    """Row 5: SIGKILL → the next step on another machine, the workspace rebuilt from Redis (no baseline)."""
    from bench.workspace_revival import MODEL_S, revivals

    done, built_s = revivals(redis_url, tmp, plan.kills, (plan.revival_files, plan.revival_bytes), sandbox)
    times = [t.recovery_s for t in done]
    p99 = pct(times, 99)
    intact = sum(t.intact for t in done)
    label = f"revival: SIGKILL → next step elsewhere, p99 ({len(done)})"
    row = Row(label, f"{p99:.2f} s", "—", None, "≤ 3 s", p99 <= 3.0 and intact == len(done))
    note = (
        f"revival: tree of {plan.revival_files:,} files / {plan.revival_bytes / MB:.0f} MB in git (smaller than the "
        f"rows above); p50 {pct(times, 50):.2f} s, max {max(times):.2f} s; {sum(t.warm_cache for t in done)} of "
        f"{len(done)} rebuilt by a worker whose cache held the tree; workspace intact after revival: "
        f"{intact}/{len(done)}; split, p50: kill → `revived` {pct([t.revived_ms - t.kill_ms for t in done], 50):.0f} ms"
        f", → the revived run's `started` {pct([t.claimed_ms - t.revived_ms for t in done], 50):.0f} ms, → its first "
        f"step/tool (workspace built, journal replayed, one {MODEL_S:.1f} s scripted model call) "
        f"{pct([t.next_ms - t.claimed_ms for t in done], 50):.0f} ms; a cold build of this tree with its git commit, "
        f"in the bench's process: {ms(built_s)}"
    )
    return row, note


# ── the run ───────────────────────────────────────────────────────────────────────────────────


def age_tree(root: Path) -> None:
    """Wait until every file is older than the stat cache's racy window, then refresh git's index (`git status`),
    as a tree a parent works in is: a launch trusts what it knows only of files not written in the last moments."""
    newest = max(os.lstat(os.path.join(d, n)).st_mtime_ns for d, _, ns in os.walk(root) for n in ns)
    time.sleep(max(0.0, (newest + RACY_NS) / 1e9 - time.time() + 0.2))
    subprocess.run(["git", "status", "--porcelain"], cwd=root, check=True, capture_output=True)


def header(plan: Plan, r: redis.Redis, sandbox: str, tree: str) -> str:
    """The machine, the sizes, and what differs from the issue's setting."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    size = "--quick: a SMALLER tree than the issue's 10,000 files / 100 MB" if plan.quick else "the issue's sizes"
    return (
        f"forkq workspaces: {os.cpu_count()} CPUs (load {load} at the start), Python {platform.python_version()}, "
        f"redis-server {r.info('server')['redis_version']}, kernel {platform.release()}, git "
        f"{subprocess.run(['git', '--version'], capture_output=True, text=True, check=True).stdout.split()[-1]}\n"
        f"tree: {tree} ({size}); sandbox {sandbox}"
    )


def run(plan: Plan, skip_revival: bool, places: Sequence[Path]) -> None:
    """Make the tree, start Redis, measure every row, print the table."""
    began = time.monotonic()
    report = probe()
    sandbox = "on" if report.usable else "off"
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="forkq-bench-ws-")))
        stack.callback(os.environ.__setitem__, "HOME", os.environ.get("HOME", "/"))
        server = stack.enter_context(RedisServer())
        r = stack.enter_context(redis.Redis.from_url(server.url))
        root = make_tree(tmp / "parent" / "tree", plan.files, plan.total_bytes, git=True)
        age_tree(root)
        settings = Settings(redis_url=server.url, queue=IDLE_QUEUE)
        launches = launch_rows(r, settings, root, tmp, plan)
        print("snapshot rows done", flush=True)
        with ForkClient(settings, redis_client=r) as client:
            built, built_notes = materialize_rows(r, client.blobs, launches.manifest, places, plan.rounds)
            rows = [*launches.rows, *built]
            print("materialize rows done", flush=True)
            checkpoint, cp_note = checkpoint_rows(client, launches.fork_id, tmp, plan.checkpoints, sandbox)
        rows += checkpoint
        print("checkpoint rows done", flush=True)
        memory, mem_note = memory_rows(r, settings, root, launches.manifest, plan.memory_forks)
        rows.append(memory)
        notes = [*launches.notes, *built_notes, cp_note, mem_note]
        tree = f"{len(launches.manifest):,} files, {launches.manifest.total_bytes / MB:.1f} MB, in git"
        head = header(plan, r, f"{sandbox} ({report.line()})", tree)
        if not skip_revival:
            revived, revival_note = revival_row(server.url, tmp, plan, sandbox)
            rows.append(revived)
            notes.append(revival_note)
        shutil.rmtree(tmp / "homes", ignore_errors=True)
    print(f"\n{head}\n")
    print(f"{'figure':<62} {'forkq':>11} {'baseline':>11} {'ratio':>7}  target")
    for row in rows:
        print(row.line())
    print("\n" + "\n".join(notes))
    print(f"\ntotal {time.monotonic() - began:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller tree (2,000 files, 20 MB), fewer rounds")
    parser.add_argument("--no-revival", action="store_true", help="leave out the revival row (no workers)")
    parser.add_argument(
        "--dir",
        action="append",
        type=Path,
        help="a folder to measure the materialize rows in (repeat for several); default: the temp folder (where "
        "FORKQ_WORKSPACE_DIR defaults to) and /dev/shm (tmpfs) when it exists",
    )
    args = parser.parse_args()
    places = args.dir or [Path(tempfile.gettempdir()), *([Path("/dev/shm")] if os.path.isdir("/dev/shm") else [])]
    run(QUICK if args.quick else FULL, args.no_revival, places)


if __name__ == "__main__":
    main()

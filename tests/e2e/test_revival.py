"""Revival with real processes: forks survive worker death, pauses, Redis faults and hostile messages.

Every test runs `forkq worker` subprocesses (and `forkq sweep` where revival is involved) against a
private redis-server, with short lease timings. Tools come from a real `forkq.tools` entry point (a
dist-info directory on PYTHONPATH) and count their side effects, one line per run with the call's
idempotency key, in a file the test reads. The scripted provider (FORKQ_SCRIPT) gives each fork the
same answers at every attempt, with delays that open the windows in which the tests kill.

Each test asserts that the fork completes exactly once (or ends in the right terminal state) and that
every tool call's side effect happened at most once (an idempotent call may be re-run).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
import redis
from celery.exceptions import Reject

from broker_config.settings import Settings
from tests.conftest import PARENT_PATH, REPO_ROOT, TEST_NAMESPACE, TEST_QUEUE
from tests.live import kombu_envelope, stop_redis, wait_until
from workers.app import make_app
from workers.base.keys import Keys
from workers.broker.queue import enqueue_fork
from workers.client import ForkClient
from workers.demo.redis_server import RedisServer
from workers.loop.child import INTERRUPTED_ERROR
from workers.loop.replay import replay
from workers.providers import ModelRequest
from workers.records.events import StreamEvent
from workers.records.fork import ForkResult, Status
from workers.records.journal import request_digest
from workers.service.job import RunForkJob
from workers.service.runner import WorkerRuntime, run_fork_job
from workers.store.forks import ForkStore
from workers.store.lease import Claim, Leases, revival_grace_s

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LEASE_TTL_S = 3.0
HEARTBEAT_S = 1.0
SWEEP_S = 0.5
# a dead worker's fork is claimed again within this: its lease, the sweeper's grace for a lapsed lease, a sweep
REVIVAL_S = LEASE_TTL_S + revival_grace_s(HEARTBEAT_S) + SWEEP_S + 1.0
READY_TIMEOUT_S = 30.0
FORK = {"description": "revival test", "prompt": "Do the revival task.", "subagent_type": "fork", "fork_turns": "1"}

TESTTOOLS = '''
"""Tools of the revival tests: each appends its call's idempotency key to $FORKQ_TEST_EFFECTS."""

import os
import signal
import time

from workers.tools import Tool

PARAMETERS = {"type": "object", "properties": {"sleep_s": {"type": "number"}}}


def _record(ctx):
    with open(os.environ["FORKQ_TEST_EFFECTS"], "a", encoding="utf-8") as effects:
        effects.write(ctx.idempotency_key + "\\n")


def _count(args, ctx):
    _record(ctx)
    time.sleep(float(args.get("sleep_s") or 0))  # the tool's work, as long as the script says
    return "done " + ctx.idempotency_key


def _kill_worker(args, ctx):
    _record(ctx)
    os.kill(os.getpid(), signal.SIGKILL)


def tools():
    return [
        Tool("count_effect", "A side effect (not idempotent).", PARAMETERS, _count, mutating=True),
        Tool("count_idempotent", "An idempotent side effect.", PARAMETERS, _count, mutating=True, idempotent=True),
        Tool("kill_worker", "Kills the process running it.", PARAMETERS, _kill_worker, mutating=True, idempotent=True),
    ]
'''


TEST_TOOL_NAMES = ("count_effect", "count_idempotent", "kill_worker")


@pytest.fixture(scope="session")
def testtools_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the `forkq_testtools` module and its dist-info with a `forkq.tools` entry point."""
    root = tmp_path_factory.mktemp("testtools")
    (root / "forkq_testtools.py").write_text(TESTTOOLS, encoding="utf-8")
    dist = root / "forkq_testtools-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: forkq-testtools\nVersion: 0.0\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text("[forkq.tools]\ntesttools = forkq_testtools:tools\n", encoding="utf-8")
    return root


# ── script builders ───────────────────────────────────────────────────────────────────────────


def call(call_id: str, tool: str = "count_effect", sleep_s: float = 0.0) -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": tool, "args": {"sleep_s": sleep_s}}}


def step(delay_s: float, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"delay_s": delay_s, "content": {"role": "model", "parts": list(parts)}}


def text(value: str) -> dict[str, Any]:
    return {"text": value}


def effect_key(fork_id: str, step_index: int, call_id: str) -> str:
    """The idempotency key of a call made by the fork's model call `step_index` (0-based)."""
    return f"{fork_id}:{step_index}:{call_id}"


# ── processes ─────────────────────────────────────────────────────────────────────────────────


@dataclass
class Proc:
    """A worker or sweeper subprocess (own process group) and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    ready_marker: str

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def ready(self) -> bool:
        if not self.alive():
            raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{tail(self.log())}")
        return self.ready_marker in self.log()

    def task_returns(self, task_id: str) -> list[str]:
        """What Celery logged as the return value of each run of `task_id` in this worker."""
        pattern = rf"run_fork\[{re.escape(task_id)}\] succeeded in [0-9.e-]+s: '([^']*)'"
        return re.findall(pattern, self.log())

    def close(self) -> None:
        # the whole process group: prefork pool children are killed with (or after) their main process
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


def tail(log: str, lines: int = 40) -> str:
    return "\n".join(f"    {line}" for line in log.splitlines()[-lines:])


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


# ── the cluster: private Redis, workers, sweepers, a client ──────────────────────────────────


@dataclass
class Cluster:
    """Workers and sweepers of one test, sharing one Redis, one script and one effects file."""

    redis_url: str
    directory: Path
    tools_dir: Path
    env_overrides: dict[str, str]
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.effects_path = self.directory / "effects.txt"
        self.effects_path.touch()
        self.settings = Settings(
            redis_url=self.redis_url,
            namespace=TEST_NAMESPACE,
            queue=TEST_QUEUE,
            lease_ttl_s=float(self.env_overrides.get("FORKQ_LEASE_TTL_S", LEASE_TTL_S)),
            heartbeat_s=HEARTBEAT_S,
            agents_dir=self.env_overrides.get("FORKQ_AGENTS_DIR"),
        )
        self.app = make_app(self.settings)
        self.client = ForkClient(self.settings, app=self.app)
        self.redis = redis.Redis.from_url(self.redis_url)
        self.keys = Keys(TEST_NAMESPACE)
        self.store = ForkStore(self.redis, self.keys, ttl_s=3600)
        self.leases = Leases(self.redis, self.keys, ttl_ms=10_000, retention_s=3600)
        # yolo: the parent's mode carries over, so the counted side effects run without approval; the
        # parent declares the test tools, since a fork runs only the tools its parent declared
        parent = json.loads(PARENT_PATH.read_text(encoding="utf-8"))
        test_tools = [{"name": name, "parameters": {"type": "object"}} for name in TEST_TOOL_NAMES]
        self.parent = {**parent, "approval_mode": "yolo", "tools": [*parent["tools"], *test_tools]}

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(self.tools_dir), str(REPO_ROOT)]),
            "FORKQ_REDIS_URL": self.redis_url,
            "FORKQ_NAMESPACE": TEST_NAMESPACE,
            "FORKQ_QUEUE": TEST_QUEUE,
            "FORKQ_PROVIDER": "scripted",
            "FORKQ_SCRIPT": str(self.directory / "script.json"),
            "FORKQ_LEASE_TTL_S": str(LEASE_TTL_S),
            "FORKQ_HEARTBEAT_S": str(HEARTBEAT_S),
            "FORKQ_SWEEP_S": str(SWEEP_S),
            "FORKQ_TEST_EFFECTS": str(self.effects_path),
            **self.env_overrides,
        }

    def script(self, *steps: dict[str, Any]) -> None:
        (self.directory / "script.json").write_text(json.dumps({"steps": list(steps)}), encoding="utf-8")

    def spawn(self, name: str, argv: list[str], ready_marker: str, env: dict[str, str] | None = None) -> Proc:
        log_path = self.directory / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "workers.cli", *argv],
                cwd=REPO_ROOT,
                env={**self.env, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so prefork children are stopped with it
            )
        proc = Proc(name, process, log_path, ready_marker)
        self.procs.append(proc)
        return proc

    def start(self, *workers: str, pool: str = "threads", concurrency: int = 4, sweepers: int = 0) -> list[Proc]:
        """Start workers (and `forkq sweep` processes) at once; wait until every one is ready; the workers."""
        argv = ["worker", "--pool", pool, "--concurrency", str(concurrency), "--loglevel", "INFO"]
        # FORKQ_WORKER_POOL too: `--pool prefork` alone is overridden by the configured pool (see
        # test_forkq_worker_pool_option_selects_the_prefork_pool)
        env = {"FORKQ_WORKER_POOL": pool}
        # Celery logs "<name>@<host> ready." once the worker consumes
        started = [self.spawn(name, [*argv, "--hostname", f"{name}@%h"], " ready.", env) for name in workers]
        swept = [self.spawn(f"sweeper{len(self.procs)}", ["sweep"], "forkq sweep: every") for _ in range(sweepers)]
        self.wait_for(lambda: all(p.ready() for p in started + swept), READY_TIMEOUT_S, "the processes to be ready")
        return started

    def close(self) -> None:
        for proc in self.procs:
            proc.close()
        self.client.close()
        self.redis.close()
        self.app.close()

    # ── forks ─────────────────────────────────────────────────────────────────────────────────

    def launch(self, params: dict[str, Any] = FORK, **options: Any) -> str:
        return self.client.launch(self.parent, params, **options).fork_id

    def events(self, fid: str) -> list[StreamEvent]:
        return self.store.events(fid, count=100_000)

    def of_type(self, fid: str, kind: str) -> list[StreamEvent]:
        return [e for e in self.events(fid) if e.type == kind]

    def started(self, fid: str) -> list[dict[str, Any]]:
        return [e.wire_data() for e in self.of_type(fid, "started")]

    def owner_pid(self, fid: str, attempt: int) -> int:
        [data] = [d for d in self.started(fid) if d["attempt"] == attempt]
        return int(data["owner"].split(":")[1])

    def proc_of(self, pid: int) -> Proc:
        [proc] = [p for p in self.procs if p.pid == pid]
        return proc

    def has_event(self, fid: str, kind: str, **data: Any) -> bool:
        return any(all(e.wire_data().get(k) == v for k, v in data.items()) for e in self.of_type(fid, kind))

    def effects(self) -> Counter[str]:
        return Counter(self.effects_path.read_text(encoding="utf-8").split())

    def result(self, fid: str, timeout: float) -> ForkResult:
        self.wait_for(lambda: self.store.result(fid) is not None, timeout, f"fork {fid} to end", fid)
        result = self.store.result(fid)
        assert result is not None
        return result

    def task_returns(self, task_id: str) -> list[str]:
        return [value for proc in self.procs for value in proc.task_returns(task_id)]

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str, fid: str | None = None) -> None:
        wait_until(predicate, timeout, lambda: f"{what}\n{self.diagnostics(fid)}")

    def wait_for_sweeps(self, for_s: float, fid: str | None = None) -> None:
        """Wait until a sweeper starts a pass `for_s` seconds of Redis time from now: sweeping went on that long."""
        seconds, micros = self.redis.time()
        after_ms = seconds * 1000 + micros // 1000 + for_s * 1000
        swept = lambda: int(self.redis.hget(self.keys.sweep, "last") or 0) >= after_ms  # noqa: E731
        self.wait_for(swept, for_s + 15, f"the sweepers to sweep on for {for_s} s", fid)

    def diagnostics(self, fid: str | None) -> str:
        parts = []
        if fid is not None:
            parts.append(f"events of {fid}:\n" + "\n".join(f"    {e.type} {e.wire_data()}" for e in self.events(fid)))
        parts.append(f"effects: {dict(self.effects())}")
        for proc in self.procs:
            state = "alive" if proc.alive() else f"exited {proc.process.returncode}"
            parts.append(f"{proc.name} (pid {proc.pid}, {state}):\n{tail(proc.log(), 25)}")
        return "\n".join(parts)

    # ── the checks every test makes ───────────────────────────────────────────────────────────

    def assert_ended_once(self, fid: str, status: Status = Status.SUCCEEDED) -> ForkResult:
        """The fork ended once, in `status`; its state and result agree."""
        finished = self.of_type(fid, "finished")
        assert len(finished) == 1, self.diagnostics(fid)
        assert finished[0].data.status == status.value
        assert self.store.state(fid).status is status
        result = self.store.result(fid)
        assert result is not None and result.status is status, result
        return result

    def assert_effects_at_most_once(self, fid: str, idempotent: tuple[str, ...] = ()) -> Counter[str]:
        """No side effect of the fork's non-idempotent calls happened twice."""
        effects = Counter({k: n for k, n in self.effects().items() if k.startswith(f"{fid}:")})
        repeated = {k: n for k, n in effects.items() if n > 1 and k.rsplit(":", 1)[1] not in idempotent}
        assert not repeated, f"side effects repeated: {repeated}\n{self.diagnostics(fid)}"
        return effects

    def assert_requests_replayed_exactly(self, fid: str) -> dict[int, ModelRequest]:
        """Every model request (any attempt) has the digest of the request rebuilt from record + journal.

        Returns the rebuilt requests by step (0-based).
        """
        state = self.store.state(fid)
        record, seed = self.store.read_inputs(fid, state.digest)
        entries = self.leases.journal(fid)
        rebuilt: dict[int, ModelRequest] = {}
        for i, entry in enumerate(entries):
            if entry.kind != "model":
                continue
            request = ModelRequest(
                fork_id=fid,
                step=entry.step,
                model=record.model,
                system_instruction=record.system_instruction,
                tools=record.tools,
                messages=replay(seed, entries[:i]).messages,
                generation=record.generation,
                directive=record.directive,
            )
            assert request_digest(request.model_dump(mode="json", exclude={"directive"})) == entry.request_digest
            rebuilt[entry.step] = request
        sent: defaultdict[int, set[str]] = defaultdict(set)
        for event in self.of_type(fid, "model_call"):
            sent[event.data.step - 1].add(event.data.request_digest)
        recorded = {e.step: e.request_digest for e in entries if e.kind == "model"}
        assert {s: {d} for s, d in recorded.items()} == dict(sent), self.diagnostics(fid)
        return rebuilt


@pytest.fixture
def make_cluster(tmp_path: Path, testtools_dir: Path) -> Iterator[Callable[..., Cluster]]:
    """Build a Cluster on a Redis URL; every process it started is killed after the test."""
    clusters: list[Cluster] = []

    def make(redis_url: str, **env_overrides: str) -> Cluster:
        directory = tmp_path / f"cluster{len(clusters)}"
        directory.mkdir()
        cluster = Cluster(redis_url, directory, testtools_dir, env_overrides)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster], redis_url: str) -> Cluster:
    """A Cluster on the session's private Redis (flushed around the test)."""
    return make_cluster(redis_url)


# ── worker death ──────────────────────────────────────────────────────────────────────────────


def test_a_fork_finishes_on_another_worker_after_sigkill_during_a_model_call(cluster: Cluster) -> None:
    # Given two workers and a sweeper, and a fork whose second model call takes 2.5 s
    cluster.script(step(0.2, call("e1")), step(2.5, call("e2")))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()

    # When the worker running it is SIGKILLed during that model call
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=2), 10, "the second model call", fid)
    victim = cluster.proc_of(cluster.owner_pid(fid, attempt=1))
    victim.send(signal.SIGKILL)

    # Then the fork finishes on the other worker, from its last recorded step
    cluster.result(fid, timeout=REVIVAL_S + 8)
    cluster.assert_ended_once(fid)
    assert [d["attempt"] for d in cluster.started(fid)] == [1, 2]
    assert cluster.owner_pid(fid, attempt=2) != victim.pid
    assert len(cluster.of_type(fid, "revived")) == 1
    effects = cluster.assert_effects_at_most_once(fid)
    assert effects == Counter({effect_key(fid, 0, "e1"): 1, effect_key(fid, 1, "e2"): 1})
    # the interrupted model call was made again with the identical request; the first one was not re-made
    cluster.assert_requests_replayed_exactly(fid)
    assert [e.data.step for e in cluster.of_type(fid, "model_call")] == [1, 2, 2, 3]


def test_a_completed_turn_fork_and_a_defined_subagent_are_revived_with_the_scope_they_were_launched_with(
    make_cluster: Callable[..., Cluster], redis_url: str, tmp_path: Path
) -> None:
    # Given a definition file, and two workers and a sweeper that read it, and a script whose second call is slow
    agents = tmp_path / "agents"
    agents.mkdir()
    definition = agents / "counter.md"
    definition.write_text("---\nname: counter\ndescription: counts\n---\nYou count things.\n", encoding="utf-8")
    cluster = make_cluster(redis_url, FORKQ_AGENTS_DIR=str(agents))
    cluster.script(step(0.2, call("e1")), step(2.5, call("e2")))
    cluster.start("w1", "w2", "w3", sweepers=1)
    spawned = cluster.launch({"description": "count", "prompt": "Count.", "subagent_type": "counter"})
    completed = cluster.launch(
        {"description": "fork", "prompt": "Go on.", "subagent_type": "fork"},
        seed_mode="completed_turns",
        persona="You are the completed-turn fork.",
    )

    # When the definition changes, and every worker running one of them is SIGKILLed during the slow call
    definition.write_text("---\nname: counter\ndescription: counts\n---\nChanged.\n", encoding="utf-8")
    for fid in (spawned, completed):
        cluster.wait_for(lambda f=fid: cluster.has_event(f, "model_call", step=2), 10, "the second model call", fid)
    for pid in {cluster.owner_pid(spawned, attempt=1), cluster.owner_pid(completed, attempt=1)}:
        cluster.proc_of(pid).send(signal.SIGKILL)

    # Then both finish elsewhere with the requests they would have made: the recorded persona, not the new file
    for fid, persona in ((spawned, "You count things."), (completed, "You are the completed-turn fork.")):
        cluster.result(fid, timeout=REVIVAL_S + 8)
        cluster.assert_ended_once(fid)
        assert len(cluster.of_type(fid, "revived")) == 1
        rebuilt = cluster.assert_requests_replayed_exactly(fid)
        assert {request.system_instruction for request in rebuilt.values()} == {persona}
        cluster.assert_effects_at_most_once(fid)


def test_a_continuation_is_revived_on_another_worker_after_sigkill_with_its_message_delivered_once(
    cluster: Cluster,
) -> None:
    # Given a fork that answered (a side effect, then its answer), and a script whose next call is slow
    cluster.script(
        step(0.2, call("e1")), step(0.2, text("first answer")), step(2.5, call("e2")), step(0.2, text("2nd"))
    )
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()
    assert cluster.result(fid, timeout=20).output == "first answer"

    # When the parent sends a follow-up, and the worker running the continuation is SIGKILLed in its model call
    assert cluster.client.send(fid, "And then?").outcome == "continued"
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=3), 10, "the continuation's model call", fid)
    owner = [d for d in cluster.started(fid)][-1]["owner"]
    cluster.proc_of(int(owner.split(":")[1])).send(signal.SIGKILL)

    # Then the continuation finishes elsewhere: the message delivered once, no side effect twice, same requests
    cluster.wait_for(lambda: cluster.store.result(fid) is not None, REVIVAL_S + 8, "the continuation's result", fid)
    result = cluster.store.result(fid)
    assert result is not None and result.output == "2nd", cluster.diagnostics(fid)
    assert len(cluster.of_type(fid, "revived")) == 1
    messages = [e for e in cluster.leases.journal(fid) if e.kind == "message"]
    assert len(messages) == 1 and cluster.redis.llen(cluster.keys.inbox(fid)) == 0
    cluster.assert_requests_replayed_exactly(fid)
    effects = cluster.assert_effects_at_most_once(fid)
    assert effects == Counter({effect_key(fid, 0, "e1"): 1, effect_key(fid, 2, "e2"): 1})
    assert result.usage.model_calls == 4 and result.run_usage is not None and result.run_usage.model_calls == 2


@pytest.mark.parametrize("tool", ["count_effect", "count_idempotent"])
def test_a_fork_finishes_on_another_worker_after_sigkill_during_a_tool_call(tool: str, cluster: Cluster) -> None:
    # Given a fork whose first tool call runs for 2 s
    cluster.script(step(0.2, call("t1", tool, sleep_s=2.0)))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()
    key = effect_key(fid, 0, "t1")

    # When its worker is SIGKILLed while the tool runs (its side effect already happened)
    cluster.wait_for(lambda: cluster.effects()[key] == 1, 10, "the tool call to start", fid)
    victim = cluster.proc_of(cluster.owner_pid(fid, attempt=1))
    victim.send(signal.SIGKILL)

    # Then the fork finishes on the other worker
    cluster.result(fid, timeout=REVIVAL_S + 8)
    cluster.assert_ended_once(fid)
    assert cluster.owner_pid(fid, attempt=2) != victim.pid
    requests = cluster.assert_requests_replayed_exactly(fid)
    answer = requests[1].messages[-1].to_wire()["parts"][0]["functionResponse"]
    if tool == "count_effect":
        # a non-idempotent interrupted call is not run again: the model reads the interrupted error
        assert cluster.assert_effects_at_most_once(fid) == Counter({key: 1})
        assert answer["response"] == {"error": INTERRUPTED_ERROR}
        assert cluster.has_event(fid, "tool", step=1, ok=False)
    else:
        # an idempotent one is run again, with the same idempotency key
        assert cluster.assert_effects_at_most_once(fid, idempotent=("t1",)) == Counter({key: 2})
        assert answer["response"] == {"output": f"done {key}"}
    assert answer["id"] == "t1"


def test_forkq_worker_pool_option_selects_the_prefork_pool(cluster: Cluster) -> None:
    # Given `forkq worker --pool prefork`, with the default settings (FORKQ_WORKER_POOL unset)
    cluster.script(step(0.1, text("done")))
    argv = ["worker", "--pool", "prefork", "--concurrency", "2", "--loglevel", "INFO", "--hostname", "p1@%h"]
    worker = cluster.spawn("p1", argv, " ready.")
    cluster.wait_for(worker.ready, READY_TIMEOUT_S, "the worker to be ready")

    # Then it runs the prefork pool it was asked for (docs/operations.md: prefork for CPU-heavy tools)
    banner = re.search(r"concurrency: (\d+) \((\w+)\)", worker.log())
    assert banner is not None and banner.groups() == ("2", "prefork"), tail(worker.log())


def test_a_fork_survives_sigkill_of_its_prefork_pool_child(cluster: Cluster) -> None:
    # Given a fork running in the pool child of a prefork worker, and a second (threads) worker
    cluster.script(step(2.5, call("e1")), step(2.5, call("e2")))
    [prefork] = cluster.start("p1", pool="prefork", concurrency=1, sweepers=1)
    fid = cluster.launch()
    cluster.wait_for(lambda: len(cluster.started(fid)) == 1, 10, "the prefork worker to claim the fork", fid)
    child = cluster.owner_pid(fid, attempt=1)
    assert child != prefork.pid and parent_pid(child) == prefork.pid
    cluster.start("w2")

    # When the pool child (not the worker's main process) is SIGKILLed during the second model call
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=2), 10, "the second model call", fid)
    os.kill(child, signal.SIGKILL)

    # Then the fork finishes once, the main process lives on, and no side effect is repeated
    cluster.result(fid, timeout=REVIVAL_S + 10)
    cluster.assert_ended_once(fid)
    assert prefork.alive()
    assert [d["attempt"] for d in cluster.started(fid)] == [1, 2]
    effects = cluster.assert_effects_at_most_once(fid)
    assert effects == Counter({effect_key(fid, 0, "e1"): 1, effect_key(fid, 1, "e2"): 1})
    cluster.assert_requests_replayed_exactly(fid)


# ── pauses ────────────────────────────────────────────────────────────────────────────────────


def test_a_worker_stopped_past_its_lease_is_fenced_off_when_it_resumes(cluster: Cluster) -> None:
    # Given a fork whose first model call takes 2 s, then calls a tool
    cluster.script(step(2.0, call("e1")))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()

    # When its worker is SIGSTOPped during the model call, and the fork is revived and finished elsewhere
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=1), 10, "the first model call", fid)
    stalled = cluster.proc_of(cluster.owner_pid(fid, attempt=1))
    stalled.send(signal.SIGSTOP)
    cluster.result(fid, timeout=REVIVAL_S + 6)
    events = cluster.events(fid)
    journal = cluster.leases.journal(fid)
    state = cluster.store.state(fid)

    # And the stopped worker resumes
    stalled.send(signal.SIGCONT)
    cluster.wait_for(lambda: stalled.task_returns(f"{fid}.1") != [], 10, "the resumed worker to end its run", fid)

    # Then its writes were refused and it performed no side effect
    assert stalled.task_returns(f"{fid}.1") == ["lease_lost"]
    assert cluster.owner_pid(fid, attempt=2) != stalled.pid
    assert cluster.events(fid) == events
    assert cluster.leases.journal(fid) == journal
    assert cluster.store.state(fid) == state
    cluster.assert_ended_once(fid)
    assert cluster.assert_effects_at_most_once(fid) == Counter({effect_key(fid, 0, "e1"): 1})
    cluster.assert_requests_replayed_exactly(fid)


def test_a_stall_shorter_than_the_lease_is_not_revived(make_cluster: Callable[..., Cluster], redis_url: str) -> None:
    # Given a 4 s lease renewed every second, and a fork whose model call takes 2.5 s
    cluster = make_cluster(redis_url, FORKQ_LEASE_TTL_S="4")
    cluster.script(step(2.5, call("e1")))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()

    # When its worker stalls for 1.5 s (SIGSTOP, then SIGCONT) while the sweeper keeps sweeping
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=1), 10, "the first model call", fid)
    worker = cluster.proc_of(cluster.owner_pid(fid, attempt=1))
    worker.send(signal.SIGSTOP)
    time.sleep(1.5)  # not a synchronization: the stall, a fault injected for this long
    worker.send(signal.SIGCONT)

    # Then nobody revived the fork behind its back: the same worker finishes it
    cluster.result(fid, timeout=10)
    cluster.assert_ended_once(fid)
    assert [d["attempt"] for d in cluster.started(fid)] == [1]
    assert cluster.of_type(fid, "revived") == []
    assert cluster.assert_effects_at_most_once(fid) == Counter({effect_key(fid, 0, "e1"): 1})


# ── the broker's own redeliveries ─────────────────────────────────────────────────────────────


def test_a_fork_longer_than_the_broker_visibility_timeout_has_one_executor(
    make_cluster: Callable[..., Cluster], redis_url: str
) -> None:
    # Given a 2 s broker visibility timeout and a fork of four 2 s model calls (about 8 s)
    cluster = make_cluster(redis_url, FORKQ_VISIBILITY_TIMEOUT_S="2")
    cluster.script(step(2.0, call("e1")), step(2.0, call("e2")), step(2.0, call("e3")), step(2.0, text("done")))
    cluster.start("w1", sweepers=1)
    fid = cluster.launch()
    cluster.wait_for(lambda: len(cluster.started(fid)) == 1, 10, "the fork to start", fid)
    started_ms = cluster.of_type(fid, "started")[0].at_ms

    def redis_ms() -> int:
        seconds, micros = cluster.redis.time()
        return int(seconds * 1000 + micros // 1000)

    # When its unacked job is older than the visibility timeout and a new worker restores it (at start-up)
    cluster.wait_for(lambda: redis_ms() - started_ms > 2500, 5, "the visibility timeout to pass", fid)
    cluster.start("w2")

    # Then the job is delivered again, but the redelivery is a no-op: one executor at any time
    cluster.wait_for(lambda: "duplicate:running" in cluster.task_returns(f"{fid}.1"), 10, "the redelivery", fid)
    result = cluster.result(fid, timeout=15)
    assert result.output == "done"
    cluster.assert_ended_once(fid)
    assert [d["attempt"] for d in cluster.started(fid)] == [1]
    assert [e.data.step for e in cluster.of_type(fid, "model_call")] == [1, 2, 3, 4]
    effects = cluster.assert_effects_at_most_once(fid)
    assert effects == Counter({effect_key(fid, i, f"e{i + 1}"): 1 for i in range(3)})


def test_duplicate_and_replayed_job_messages_are_no_ops(cluster: Cluster) -> None:
    # Given a fork launched before any worker runs, so its job message can be captured
    cluster.script(step(2.0, call("e1")), step(0.2, text("done")))
    fid = cluster.launch()
    [original] = cluster.redis.lrange(TEST_QUEUE, 0, -1)
    digest = cluster.store.state(fid).digest
    cluster.start("w1", "w2")
    cluster.wait_for(lambda: len(cluster.started(fid)) == 1, 10, "the fork to start", fid)

    # When the same job is published twice more while the fork runs
    for _ in range(2):
        enqueue_fork(cluster.app, TEST_QUEUE, fid, digest, attempt=1)
    cluster.wait_for(
        lambda: cluster.task_returns(f"{fid}.1").count("duplicate:running") == 2, 10, "the duplicates", fid
    )
    result = cluster.result(fid, timeout=10)
    events = cluster.events(fid)

    # And the original message is replayed, byte for byte, after the fork finished
    cluster.redis.lpush(TEST_QUEUE, original)
    cluster.wait_for(lambda: "duplicate:succeeded" in cluster.task_returns(f"{fid}.1"), 10, "the replay", fid)

    # Then the fork ran once and nothing changed
    assert sorted(cluster.task_returns(f"{fid}.1")) == [
        "duplicate:running",
        "duplicate:running",
        "duplicate:succeeded",
        "succeeded",
    ]
    assert cluster.events(fid) == events
    assert cluster.store.result(fid) == result
    assert [d["attempt"] for d in cluster.started(fid)] == [1]
    cluster.assert_ended_once(fid)
    assert cluster.assert_effects_at_most_once(fid) == Counter({effect_key(fid, 0, "e1"): 1})


def test_a_dead_workers_fork_is_revived_from_its_closed_connection_long_before_its_lease_expires(
    make_cluster: Callable[..., Cluster], redis_url: str
) -> None:
    # Given a 60 s lease (so only the worker's closed connection can revive the fork within the test), two
    # workers, a sweeper, and a fork whose second model call takes 5 s
    cluster = make_cluster(redis_url, FORKQ_LEASE_TTL_S="60")
    cluster.script(step(0.2, call("e1")), step(5.0, call("e2")), step(0.2, text("done")))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=2), 10, "the second model call", fid)

    # When the worker running it is SIGKILLed during that model call
    victim = cluster.proc_of(cluster.owner_pid(fid, attempt=1))
    killed_at = time.monotonic()
    victim.send(signal.SIGKILL)

    # Then the other worker takes it over within a few seconds (the lease had 55 s or more left), the
    # revival names the closed connection, and the fork succeeds with its first side effect done once
    cluster.wait_for(lambda: len(cluster.started(fid)) == 2, 8, "the fork to start on the other worker", fid)
    taken_over_s = time.monotonic() - killed_at
    assert taken_over_s < 8
    [revived] = cluster.of_type(fid, "revived")
    assert revived.data.via == "connection"
    assert cluster.owner_pid(fid, attempt=2) != victim.pid
    cluster.result(fid, timeout=20)
    cluster.assert_ended_once(fid)
    assert cluster.assert_effects_at_most_once(fid) == Counter(
        {effect_key(fid, 0, "e1"): 1, effect_key(fid, 1, "e2"): 1}
    )
    cluster.assert_requests_replayed_exactly(fid)


def test_a_stopped_worker_keeps_its_connection_so_its_fork_waits_for_the_lease(
    make_cluster: Callable[..., Cluster], redis_url: str
) -> None:
    # Given a 6 s lease renewed every second, and a fork whose model call takes 2 s
    cluster = make_cluster(redis_url, FORKQ_LEASE_TTL_S="6")
    cluster.script(step(2.0, call("e1")))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=1), 10, "the first model call", fid)

    # When its worker is SIGSTOPped (alive, silent: its connections stay open)
    stalled = cluster.proc_of(cluster.owner_pid(fid, attempt=1))
    stopped_at = time.monotonic()
    stalled.send(signal.SIGSTOP)
    try:
        # Then the fork is revived only once its lease has expired, and the revival says so
        cluster.wait_for(lambda: cluster.of_type(fid, "revived") != [], 20, "the revival", fid)
        assert time.monotonic() - stopped_at > 4.0
        [revived] = cluster.of_type(fid, "revived")
        assert revived.data.via == "lease"
        cluster.result(fid, timeout=20)
    finally:
        stalled.send(signal.SIGCONT)
    # and the resumed worker is fenced off: the fork ended once, its side effect done once
    cluster.wait_for(lambda: stalled.task_returns(f"{fid}.1") != [], 10, "the resumed worker to end its run", fid)
    assert stalled.task_returns(f"{fid}.1") == ["lease_lost"]
    cluster.assert_ended_once(fid)
    assert cluster.assert_effects_at_most_once(fid) == Counter({effect_key(fid, 0, "e1"): 1})


def test_a_workers_connections_killed_for_a_second_revive_none_of_its_forks(
    make_cluster: Callable[..., Cluster], redis_url: str
) -> None:
    # Given a 60 s lease, and two forks of a dozen short steps on one worker
    cluster = make_cluster(redis_url, FORKQ_LEASE_TTL_S="60")
    steps = 12
    cluster.script(*long_fork_script(steps, 0.3))
    [worker] = cluster.start("w1", sweepers=1)
    forks = [cluster.launch() for _ in range(2)]
    cluster.wait_for(lambda: all(cluster.has_event(f, "model_call", step=2) for f in forks), 20, "the forks to run")

    # When every connection the worker has to Redis is killed again and again for a second (a network blip)
    killer = redis.Redis.from_url(redis_url)
    ports = {c.laddr.port for c in psutil.Process(worker.pid).net_connections(kind="tcp") if c.raddr}
    killed = 0
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        for entry in killer.client_list(_type="normal"):
            if int(entry["addr"].rsplit(":", 1)[1]) in ports:
                with contextlib.suppress(redis.ResponseError):  # gone meanwhile
                    killed += killer.client_kill_filter(_id=entry["id"], skipme=True)
        ports |= {c.laddr.port for c in psutil.Process(worker.pid).net_connections(kind="tcp") if c.raddr}
        time.sleep(0.05)  # not a synchronization: the blip's rhythm, a kill every 50 ms for a second
    killer.close()

    # Then no fork was revived: each succeeds on its first attempt with every side effect once
    assert killed > 0
    for fid in forks:
        cluster.result(fid, timeout=60)
    for fid in forks:
        assert_one_clean_attempt(cluster, fid, steps)


# ── Redis faults ──────────────────────────────────────────────────────────────────────────────


def test_a_dropped_redis_connection_does_not_duplicate_or_lose_the_fork(
    make_cluster: Callable[..., Cluster], fresh_redis: RedisServer
) -> None:
    # Given a fork on its own Redis: a tool call, then two model calls
    cluster = make_cluster(fresh_redis.url)
    cluster.script(step(0.5, call("e1", sleep_s=1.0)), step(1.5, call("e2")), step(1.5, call("e3")))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()
    killer = redis.Redis.from_url(fresh_redis.url)

    # When every normal client connection is killed during the tool call and during each model call
    cluster.wait_for(lambda: cluster.effects()[effect_key(fid, 0, "e1")] == 1, 10, "the tool call", fid)
    killed = [killer.client_kill_filter(_type="normal")]
    for model_step in (2, 3):
        cluster.wait_for(lambda s=model_step: cluster.has_event(fid, "model_call", step=s), 10, "a model call", fid)
        killed.append(killer.client_kill_filter(_type="normal"))
    killer.close()

    # Then the fork completes exactly once, with every side effect once
    assert all(n > 0 for n in killed)
    cluster.result(fid, timeout=REVIVAL_S + 10)
    cluster.assert_ended_once(fid)
    effects = cluster.assert_effects_at_most_once(fid)
    assert effects == Counter({effect_key(fid, i, f"e{i + 1}"): 1 for i in range(3)})
    assert [d["attempt"] for d in cluster.started(fid)] == [1]  # the lease was never lost
    cluster.assert_requests_replayed_exactly(fid)


@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_a_fork_completes_after_redis_is_killed_and_restarted_from_its_aof(
    make_cluster: Callable[..., Cluster], fresh_redis: RedisServer
) -> None:
    # Given a fork on a Redis with AOF persistence
    cluster = make_cluster(fresh_redis.url)
    cluster.script(step(0.5, call("e1")), step(1.5, call("e2")), step(1.0, call("e3")))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()

    # When Redis is SIGKILLed during the second model call and restarted from its files
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=2), 10, "the second model call", fid)
    fresh_redis.kill()
    time.sleep(0.5)  # not a synchronization: the outage, a fault injected for this long
    fresh_redis.restart()

    # Then the fork completes, once, with no side effect repeated
    cluster.result(fid, timeout=REVIVAL_S + 20)
    cluster.assert_ended_once(fid)
    effects = cluster.assert_effects_at_most_once(fid)
    assert set(effects) <= {effect_key(fid, i, f"e{i + 1}") for i in range(3)}
    entries = cluster.leases.journal(fid)
    assert [e.seq for e in entries] == list(range(len(entries)))
    assert {e.call_id for e in entries if e.kind == "tool_result"} == {"e1", "e2", "e3"}
    cluster.assert_requests_replayed_exactly(fid)


def long_fork_script(steps: int, delay_s: float) -> list[dict[str, Any]]:
    """A fork of `steps` model calls, each calling the (non-idempotent) counted tool, then an answer."""
    return [*(step(delay_s, call(f"c{i}")) for i in range(steps)), step(delay_s, text("done"))]


def assert_one_clean_attempt(cluster: Cluster, fid: str, steps: int) -> None:
    """The fork succeeded once, on its first attempt, never revived, every side effect once."""
    cluster.assert_ended_once(fid)
    assert [d["attempt"] for d in cluster.started(fid)] == [1], cluster.diagnostics(fid)
    assert cluster.of_type(fid, "revived") == [], cluster.diagnostics(fid)
    effects = cluster.assert_effects_at_most_once(fid)
    assert effects == Counter({effect_key(fid, i, f"c{i}"): 1 for i in range(steps)})
    entries = cluster.leases.journal(fid)
    assert [e.seq for e in entries] == list(range(len(entries)))
    cluster.assert_requests_replayed_exactly(fid)


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_three_redis_restarts_of_a_second_cost_four_long_forks_no_attempt_and_no_revival(
    stop: str, make_cluster: Callable[..., Cluster], fresh_redis: RedisServer
) -> None:
    # Given four long forks on two workers of two forks each, one per pool, with the default 15 s lease
    # renewed every 5 s, and AOF on
    cluster = make_cluster(fresh_redis.url, FORKQ_LEASE_TTL_S="15", FORKQ_HEARTBEAT_S="5")
    steps = 24
    cluster.script(*long_fork_script(steps, 0.4))
    [threads] = cluster.start("w1", concurrency=2, sweepers=1)
    [prefork] = cluster.start("p1", pool="prefork", concurrency=2)
    forks = [cluster.launch() for _ in range(4)]
    cluster.wait_for(lambda: all(cluster.has_event(f, "model_call", step=2) for f in forks), 20, "the forks to run")
    owners = [cluster.owner_pid(f, attempt=1) for f in forks]
    assert sorted(pid if pid == threads.pid else parent_pid(pid) for pid in owners) == sorted(
        [threads.pid] * 2 + [prefork.pid] * 2
    )

    # When Redis is stopped (SIGTERM: it writes its AOF and exits; SIGKILL: it dies, what it acknowledged is
    # in its AOF already) and started again three times, down about a second each time
    for _ in range(3):
        stop_redis(fresh_redis) if stop == "SIGTERM" else fresh_redis.kill()
        time.sleep(1.0)  # not a synchronization: the outage, a fault injected for this long
        fresh_redis.restart()
        time.sleep(2.0)  # not a synchronization: the fault's rhythm, up 2 s between outages

    # Then every fork succeeds on its first attempt, without a revival or a repeated side effect
    for fid in forks:
        cluster.result(fid, timeout=60)
    for fid in forks:
        assert_one_clean_attempt(cluster, fid, steps)
    assert all(proc.alive() for proc in cluster.procs)


@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_a_redis_outage_longer_than_a_heartbeat_and_shorter_than_the_lease_costs_no_attempt(
    make_cluster: Callable[..., Cluster], fresh_redis: RedisServer
) -> None:
    # Given two long forks with the default 15 s lease renewed every 5 s
    cluster = make_cluster(fresh_redis.url, FORKQ_LEASE_TTL_S="15", FORKQ_HEARTBEAT_S="5")
    steps = 20
    cluster.script(*long_fork_script(steps, 0.4))
    cluster.start("w1", sweepers=1)
    forks = [cluster.launch() for _ in range(2)]
    cluster.wait_for(lambda: all(cluster.has_event(f, "model_call", step=2) for f in forks), 20, "the forks to run")

    # When Redis is down for 7 s: at least one heartbeat and many writes fail; the leases have 10 s or more
    # left, and one that lapsed anyway (a late beat on a loaded machine) would be taken back: the sweeper
    # leaves it to its worker for 6.5 s more, so the margin is about 9 s
    stop_redis(fresh_redis)
    time.sleep(7.0)  # not a synchronization: the outage, a fault injected for this long
    fresh_redis.restart()

    # Then both forks succeed on their first attempt, without a revival or a repeated side effect
    for fid in forks:
        cluster.result(fid, timeout=60)
    for fid in forks:
        assert_one_clean_attempt(cluster, fid, steps)


def go_silent(server: RedisServer, how: str) -> Callable[[], None]:
    """Take Redis away as `how` says (`restart`: SIGTERM, files kept; `sigstop`: frozen, sockets open and
    silent); the function returned brings it back."""
    if how == "sigstop":
        server.pause()
        return server.resume
    stop_redis(server)
    return server.restart


@pytest.mark.parametrize("how", ["restart", "sigstop"])
@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_a_lease_that_lapses_during_a_redis_outage_shorter_than_its_ttl_is_taken_back_not_revived(
    how: str, make_cluster: Callable[..., Cluster], fresh_redis: RedisServer
) -> None:
    # Given two long forks on one worker, with an 8 s lease renewed every 4 s
    ttl_s, heartbeat_s = 8.0, 4.0
    cluster = make_cluster(fresh_redis.url, FORKQ_LEASE_TTL_S=str(ttl_s), FORKQ_HEARTBEAT_S=str(heartbeat_s))
    steps = 30
    cluster.script(*long_fork_script(steps, 0.4))
    cluster.start("w1", sweepers=1)
    forks = [cluster.launch() for _ in range(2)]
    cluster.wait_for(lambda: all(cluster.has_event(f, "model_call", step=2) for f in forks), 20, "the forks to run")

    # When Redis goes away for TTL - 2 s, starting more than 2 s after the last renewal (and before the next),
    # so the leases lapse during the outage: 6 s down, with at most 5 s of lease left when it began
    lease = cluster.keys.lease(forks[0])
    cluster.wait_for(lambda: 0 < cluster.redis.pttl(lease) < (ttl_s - 3.0) * 1000, heartbeat_s + 5, "a late moment")
    left_ms = int(cluster.redis.pttl(lease))
    back = go_silent(fresh_redis, how)
    time.sleep(ttl_s - 2.0)  # not a synchronization: the outage, a fault injected for this long
    back()

    # Then both forks succeed on their first attempt, never revived: their worker took its lapsed leases back
    for fid in forks:
        cluster.result(fid, timeout=60)
    for fid in forks:
        assert_one_clean_attempt(cluster, fid, steps)
        retaken = cluster.redis.hget(cluster.keys.state(fid), "retaken")
        assert retaken is not None and int(retaken) >= 1, (left_ms, cluster.diagnostics(fid))
    assert all(proc.alive() for proc in cluster.procs)


@pytest.mark.parametrize("fresh_redis", [{"appendonly": True}], indirect=True)
def test_after_a_redis_outage_longer_than_the_lease_every_fork_still_succeeds(
    make_cluster: Callable[..., Cluster], fresh_redis: RedisServer
) -> None:
    # Given four long forks on two workers with the default 15 s lease
    cluster = make_cluster(fresh_redis.url, FORKQ_LEASE_TTL_S="15", FORKQ_HEARTBEAT_S="5")
    steps = 16
    cluster.script(*long_fork_script(steps, 0.4))
    cluster.start("w1", "w2", sweepers=1)
    forks = [cluster.launch() for _ in range(4)]
    cluster.wait_for(lambda: all(cluster.has_event(f, "model_call", step=2) for f in forks), 20, "the forks to run")

    # When Redis is down for 20 s, past every lease
    stop_redis(fresh_redis)
    time.sleep(20.0)  # not a synchronization: the outage, a fault injected for this long
    fresh_redis.restart()

    # Then every fork succeeds, once. A run whose lease lapsed less than the sweeper's grace (6.5 s) before
    # Redis came back took it back and finished on its first attempt; the others gave up once the grace had
    # passed, and the sweeper revived their forks, which resumed from their journals on a second attempt
    for fid in forks:
        cluster.result(fid, timeout=90)
    first_runs = []
    for fid in forks:
        cluster.assert_ended_once(fid)
        attempts = [d["attempt"] for d in cluster.started(fid)]
        assert attempts in ([1], [1, 2]), cluster.diagnostics(fid)
        assert len(cluster.of_type(fid, "revived")) == len(attempts) - 1
        effects = cluster.assert_effects_at_most_once(fid)
        assert effects == Counter({effect_key(fid, i, f"c{i}"): 1 for i in range(steps)})
        cluster.assert_requests_replayed_exactly(fid)
        [first_run] = [r for proc in cluster.procs for r in proc.task_returns(f"{fid}.1")]
        first_runs.append((first_run, attempts))
    assert all(proc.alive() for proc in cluster.procs)
    assert all(run == ("succeeded" if attempts == [1] else "lease_lost") for run, attempts in first_runs), first_runs


# ── poison forks and hostile messages ─────────────────────────────────────────────────────────


def test_a_poison_fork_fails_with_worker_lost_after_the_attempt_limit(
    make_cluster: Callable[..., Cluster], redis_url: str
) -> None:
    # Given a fork whose (idempotent, so re-run) tool SIGKILLs the process running it, every time
    cluster = make_cluster(redis_url, FORKQ_MAX_ATTEMPTS="2")
    cluster.script(step(0.1, call("k1", "kill_worker")))
    [prefork] = cluster.start("p1", pool="prefork", concurrency=1, sweepers=1)
    fid = cluster.launch()

    # When it has killed its worker's pool child at each attempt
    cluster.wait_for(lambda: cluster.store.state(fid).status.terminal, 2 * REVIVAL_S + 10, "the fork to end", fid)

    # Then it ends failed with worker_lost after two attempts, and does not loop
    result = cluster.assert_ended_once(fid, Status.FAILED)
    state = cluster.store.state(fid)
    assert (state.error or "").startswith("worker_lost"), state.error
    assert (result.error or "").startswith("worker_lost"), result.error
    assert state.attempt == 2
    assert [d["attempt"] for d in cluster.started(fid)] == [1, 2]
    assert cluster.effects()[effect_key(fid, 0, "k1")] == 2
    assert prefork.alive()
    assert cluster.redis.zscore(cluster.keys.running, fid) is None


def raw_envelope(payload: bytes, content_type: str, task_id: str) -> bytes:
    """A kombu Redis envelope for the test queue, as a hostile or buggy producer would push it."""
    return kombu_envelope(payload, queue=TEST_QUEUE, task_id=task_id, content_type=content_type)


class Pwned:
    """Creates a file when unpickled: proof that pickle was (not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_hostile_payloads_are_rejected_without_running_the_fork_or_crashing_the_worker(cluster: Cluster) -> None:
    # Given a queued fork, and hostile messages naming it queued ahead of its real job
    cluster.script(step(0.2, call("e1")))
    fid = cluster.launch()
    digest = cluster.store.state(fid).digest
    marker = cluster.directory / "pickle-was-loaded"
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    hostile = {
        "int-map-keys": raw_envelope(
            msgpack.packb([[fid, digest, None], {1: "x"}, embed]), "application/x-msgpack", "h-int"
        ),
        "int-keys-in-args": raw_envelope(
            msgpack.packb([[{1: fid}, digest, None], {}, embed]), "application/x-msgpack", "h-int-args"
        ),
        "wrong-content-type": raw_envelope(
            json.dumps([[fid, digest, None], {}, embed]).encode(), "application/json", "h-json"
        ),
        "pickle": raw_envelope(pickle.dumps(Pwned(marker)), "application/x-python-serialize", "h-pickle"),
        # 8 MiB of seed "chunks" for the real fork, with its real digest: far beyond any inline seed
        "oversized": raw_envelope(
            msgpack.packb([[fid, digest, [b"\0" * (1 << 20)] * 8], {}, embed]), "application/x-msgpack", "h-big"
        ),
    }
    for envelope in hostile.values():
        cluster.redis.rpush(TEST_QUEUE, envelope)  # consumed before the real job (kombu pops from the right)

    # When one worker (one job at a time, in queue order) consumes them all
    [worker] = cluster.start("w1", concurrency=1)
    cluster.wait_for(
        lambda: cluster.redis.llen(TEST_QUEUE) == 0 and cluster.redis.hlen("unacked") == 0, 20, "the queue to drain"
    )
    cluster.result(fid, timeout=10)

    # Then none ran the fork or loaded pickle, the worker is still up, and the real job ran the fork once
    assert worker.alive(), tail(worker.log())
    assert not marker.exists()
    log = worker.log()
    # forkq's broker channel refuses other content types before Celery reads them (docs/runtime.md)
    assert "content-type 'application/x-python-serialize' is not accepted" in log
    assert "content-type 'application/json' is not accepted" in log
    # and decodes job bodies with forkq's msgpack loader (int map keys refused) before Celery takes them
    undecodable = re.findall(r"refused \(.* bytes, not delivered\): its body is not a forkq job: .*strict_map_key", log)
    assert len(undecodable) == 2, log
    cluster.assert_ended_once(fid)
    assert [d["attempt"] for d in cluster.started(fid)] == [1]
    assert cluster.assert_effects_at_most_once(fid) == Counter({effect_key(fid, 0, "e1"): 1})
    # the oversized job (8 MiB inline, far past FORKQ_INLINE_SEED_MAX_BYTES) was refused: the real job ran the fork
    assert all(r.startswith(("rejected:", "refused:")) for r in cluster.task_returns("h-big")), cluster.task_returns(
        "h-big"
    )
    assert cluster.task_returns(f"{fid}.1") == ["succeeded"]


# ── graceful shutdown ─────────────────────────────────────────────────────────────────────────


def test_sigterm_releases_forks_in_flight_and_they_finish_on_another_worker_at_once(cluster: Cluster) -> None:
    # Given three forks of four 1.5 s model calls running on one worker, no sweeper, and a second worker
    cluster.script(step(1.5, call("e1")), step(1.5, call("e2")), step(1.5, call("e3")), step(0.3, text("done")))
    [w1] = cluster.start("w1")
    forks = [cluster.launch() for _ in range(3)]
    cluster.wait_for(lambda: all(len(cluster.started(f)) == 1 for f in forks), 10, "the forks to start on w1")
    [w2] = cluster.start("w2")

    # When w1 gets SIGTERM (Celery's warm shutdown) while every fork waits on a model call
    def in_model_call(fid: str, model_step: int) -> bool:
        return cluster.has_event(fid, "model_call", step=model_step) and not cluster.has_event(
            fid, "step", step=model_step
        )

    cluster.wait_for(lambda: all(in_model_call(f, 3) for f in forks), 10, "every fork's third model call")
    w1.send(signal.SIGTERM)

    # Then it exits promptly, its forks stop at a step boundary, are released and finish on w2 at once
    cluster.wait_for(lambda: not w1.alive(), 15, "w1 to exit")
    assert w1.process.returncode == 0
    for fid in forks:
        result = cluster.result(fid, timeout=10)
        assert result.output == "done"
        cluster.assert_ended_once(fid)
        attempts = cluster.started(fid)
        assert [d["attempt"] for d in attempts] == [1, 2], cluster.diagnostics(fid)
        assert (cluster.owner_pid(fid, 1), cluster.owner_pid(fid, 2)) == (w1.pid, w2.pid)
        [released] = cluster.of_type(fid, "released")
        second_start = cluster.of_type(fid, "started")[1]
        assert released.wire_data() == {"reason": "worker shutdown"}
        assert second_start.at_ms - released.at_ms < 2000  # re-enqueued, not waiting for a lease to expire
        assert cluster.of_type(fid, "revived") == []
        assert all(e.wire_data().get("status") != "cancelled" for e in cluster.events(fid))
        effects = cluster.assert_effects_at_most_once(fid)
        assert effects == Counter({effect_key(fid, i, f"e{i + 1}"): 1 for i in range(3)})
        cluster.assert_requests_replayed_exactly(fid)
        # the stop came at a step boundary: no model call was made twice (a response the model already
        # gave is recorded, not thrown away and paid for again on the next worker)
        steps = [e.data.step for e in cluster.of_type(fid, "model_call")]
        assert sorted(steps) == [1, 2, 3, 4], cluster.diagnostics(fid)


# ── the sweeper and cancels ───────────────────────────────────────────────────────────────────


def test_three_sweeper_processes_revive_each_of_fifty_expired_forks_once(
    make_cluster: Callable[..., Cluster], redis_url: str
) -> None:
    # Given three `forkq sweep` processes sweeping every 0.2 s, and no worker
    cluster = make_cluster(redis_url, FORKQ_SWEEP_S="0.2")
    cluster.script(step(0.1, text("unused")))
    cluster.start(sweepers=3)

    # When fifty forks are claimed by a worker that dies at once (their leases expire together)
    forks = [cluster.launch() for _ in range(50)]
    cluster.redis.delete(TEST_QUEUE)  # the launch jobs: only revivals are counted below
    dying = Leases(cluster.redis, cluster.keys, ttl_ms=1000, retention_s=3600)
    for fid in forks:
        assert isinstance(dying.claim(fid, "dead-worker"), Claim)

    # Then each fork is revived exactly once and enqueued exactly once, for attempt 2
    cluster.wait_for(
        lambda: all(cluster.store.state(f).status is Status.QUEUED for f in forks), 15, "every fork to be revived"
    )
    cluster.wait_for(lambda: cluster.redis.llen(TEST_QUEUE) >= 50, 5, "the revival jobs")
    cluster.wait_for_sweeps(4 * 0.2)  # a few more passes of the sweepers: none may revive a fork again
    revived = {fid: len(cluster.of_type(fid, "revived")) for fid in forks}
    assert revived == dict.fromkeys(forks, 1)
    jobs = [json.loads(raw) for raw in cluster.redis.lrange(TEST_QUEUE, 0, -1)]
    assert Counter(job["headers"]["id"] for job in jobs) == Counter(f"{fid}.2" for fid in forks)
    assert cluster.redis.zcard(cluster.keys.running) == 0
    sweepers = [p for p in cluster.procs if p.name.startswith("sweeper")]
    assert all(p.alive() for p in sweepers)


def test_a_fork_cancelled_while_its_dead_workers_lease_runs_out_is_never_run_again(cluster: Cluster) -> None:
    # Given a fork whose worker was SIGKILLed during its second model call
    cluster.script(step(0.2, call("e1")), step(2.5, call("e2")))
    cluster.start("w1", "w2", sweepers=1)
    fid = cluster.launch()
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=2), 10, "the second model call", fid)
    cluster.proc_of(cluster.owner_pid(fid, attempt=1)).send(signal.SIGKILL)

    # When the parent cancels it before the lease expires, and the sweeper then finds the expired lease
    assert cluster.client.cancel(fid) is Status.CANCELLED
    cluster.wait_for(
        lambda: cluster.redis.zscore(cluster.keys.running, fid) is None, REVIVAL_S + 2, "the sweeper to see it", fid
    )
    cluster.wait_for_sweeps(2 * SWEEP_S, fid)  # and a couple more sweeps

    # Then it stays cancelled and never runs again
    cluster.assert_ended_once(fid, Status.CANCELLED)
    assert [d["attempt"] for d in cluster.started(fid)] == [1]
    assert cluster.of_type(fid, "revived") == []
    assert cluster.redis.llen(TEST_QUEUE) == 0
    assert cluster.assert_effects_at_most_once(fid) == Counter({effect_key(fid, 0, "e1"): 1})


def test_a_fork_cancelled_after_its_revival_and_before_a_claim_is_never_run_again(cluster: Cluster) -> None:
    # Given a fork whose only worker was SIGKILLed mid-fork
    cluster.script(step(0.2, call("e1")), step(2.5, call("e2")))
    [w1] = cluster.start("w1")
    fid = cluster.launch()
    cluster.wait_for(lambda: cluster.has_event(fid, "model_call", step=2), 10, "the second model call", fid)
    w1.send(signal.SIGKILL)

    # When `forkq sweep --once` revives it once its lease expired and the grace passed (its job is now queued)
    cluster.wait_for(lambda: not cluster.redis.exists(cluster.keys.lease(fid)), LEASE_TTL_S + 2, "the lease to expire")
    # not a synchronization: time passes for the grace to lapse, as a sweep leaves a lapsed lease to its worker
    time.sleep(revival_grace_s(HEARTBEAT_S))
    swept = subprocess.run(
        [sys.executable, "-m", "workers.cli", "sweep", "--once"],
        cwd=REPO_ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert swept.returncode == 0 and "revive=1" in swept.stdout, swept.stdout + swept.stderr
    assert cluster.store.state(fid).status is Status.QUEUED

    # And the parent cancels it before any worker takes the job
    assert cluster.client.cancel(fid) is Status.CANCELLED
    cluster.start("w2")

    # Then the revived job is a no-op: the fork stays cancelled and never runs again
    cluster.wait_for(lambda: cluster.task_returns(f"{fid}.2") != [], 10, "the revived job to be consumed", fid)
    assert cluster.task_returns(f"{fid}.2") == ["duplicate:cancelled"]
    cluster.assert_ended_once(fid, Status.CANCELLED)
    assert [d["attempt"] for d in cluster.started(fid)] == [1]
    assert cluster.assert_effects_at_most_once(fid) == Counter({effect_key(fid, 0, "e1"): 1})


def test_a_worker_that_is_shutting_down_hands_a_new_delivery_back_without_claiming_the_fork(
    settings: Settings, redis_client: redis.Redis
) -> None:
    # Given a worker runtime whose worker is shutting down (worker_shutting_down set `stopping`), in process
    with ForkClient(settings) as client:
        handle = client.launch({**json.loads(PARENT_PATH.read_text(encoding="utf-8")), "approval_mode": "yolo"}, FORK)
        client.app.close()
    requeued: list[tuple[str, str, int]] = []
    runtime = WorkerRuntime(settings, requeue=lambda fid, digest, attempt: requeued.append((fid, digest, attempt)))
    runtime.stopping.set()

    # When a delivery of a queued fork reaches it (a job its consumer took just before it stopped)
    handed_back = False
    try:
        outcome = run_fork_job(runtime, RunForkJob(fork_id=handle.fork_id, digest=handle.digest))
    except Reject as exc:  # handing the message back to the broker is as good as re-enqueueing it
        outcome, handed_back = "rejected", bool(exc.requeue)
    finally:
        runtime.keeper.stop()
        runtime.redis.close()

    # Then it hands the job back without claiming the fork: no run, no attempt used, the fork still queued
    store = ForkStore(redis_client, Keys(TEST_NAMESPACE), ttl_s=3600)
    state = store.state(handle.fork_id)
    events = [e.type for e in store.events(handle.fork_id)]
    assert (state.status, state.attempt, events) == (Status.QUEUED, 0, ["queued"]), outcome
    assert handed_back or [fid for fid, _, _ in requeued] == [handle.fork_id], outcome

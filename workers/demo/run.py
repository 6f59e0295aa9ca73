"""`forkq demo`: six forks and subagents of an example parent conversation on two private workers, shown live.

Redis: `FORKQ_REDIS_URL` when set; else a server answering on 127.0.0.1:6379 (unless
`private_redis`); else a private `redis-server` on a unix socket. On a Redis the demo does not own
it works under its own namespace and queue (`forkq-demo-<random>`) and deletes their keys at the
end. Everything it starts (workers, Redis, temp dirs) is stopped on success, failure and Ctrl-C.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_config.settings import Settings, load_settings, redact_url
from workers.client import ForkClient, ForkHandle
from workers.demo.redis_server import RedisServer
from workers.demo.report import clip, report, say
from workers.errors import ConfigurationError
from workers.history.messages import Content
from workers.history.selection import is_real_user_turn
from workers.records.events import (
    FinishedEvent,
    ModelCallEvent,
    QueuedEvent,
    StartedEvent,
    StepEvent,
    StreamEvent,
    ToolEvent,
)
from workers.records.fork import ForkResult, Status

EXAMPLE_PARENT = Path(__file__).parent.parent / "examples" / "parent.json"
# FORKQ_SCRIPT of the demo's workers: every fork's k-th model call gets step k (look, read, answer)
DEMO_SCRIPT = Path(__file__).parent.parent / "examples" / "demo-script.json"
# FORKQ_AGENTS_DIR of the demo: one subagent definition (a read-only reviewer)
DEMO_AGENTS = Path(__file__).parent.parent / "examples" / "agents"
SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"
WORKER_NAMES = ("demo1", "demo2")
WORKER_CONCURRENCY = 4
READY_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.05
LOG_TAIL_LINES = 20
EXIT_INTERRUPTED = 130
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# the settings the demo chooses; its workers get these and defaults for everything else
DEMO_FIELDS = frozenset(("redis_url", "broker_url", "namespace", "queue", "provider", "script", "record_ttl_s"))
DEMO_FIELDS |= {"worker_pool", "worker_concurrency", "agents_dir"}

WORKSPACE_FILES: dict[str, str] = {
    "README.md": "# shorty\n\nA small URL shortener (FastAPI + SQLite). Copy made by `forkq demo`.\n",
    "app/__init__.py": "",
    "app/links.py": "def resolve(code: str) -> str | None:\n    return None\n",
    "tests/test_links.py": "def test_placeholder() -> None:\n    assert True\n",
}


@dataclass(frozen=True)
class DemoFork:
    """One Agent call of the demo: a label, its parameters, and the launch's own options."""

    label: str
    kind: str  # how the tour names it
    params: dict[str, str]
    options: dict[str, Any] = field(default_factory=dict)


def _fork(label: str, turns: str, description: str, prompt: str) -> DemoFork:
    params = {"description": description, "prompt": prompt, "subagent_type": "fork", "fork_turns": turns}
    return DemoFork(label, f"fork_turns {turns!r}", params)


DEMO_FORKS = (
    _fork("fork all", "all", "Changelog of the session", "Write the PR changelog of this session; edit no file."),
    _fork("fork 1", "1", "Write missing expiry tests", "Write the expiry tests we just listed (test_expiry.py)."),
    _fork("fork 3", "3", "Audit rate limiter races", "Audit app/ratelimit.py for races; change no file."),
    DemoFork(
        "completed",
        "completed turns",
        {
            "description": "PR description",
            "prompt": "Draft the PR description of the finished work.",
            "subagent_type": "fork",
        },
        {"seed_mode": "completed_turns"},
    ),
    DemoFork(
        "general",
        "general-purpose",
        {
            "description": "Describe the layout",
            "prompt": "List the working directory and describe the project.",
            "subagent_type": "general-purpose",
        },
    ),
    DemoFork(
        "reviewer",
        f"defined in {DEMO_AGENTS.name}/reviewer.md",
        {"description": "Review app/links.py", "prompt": "Review app/links.py for bugs.", "subagent_type": "reviewer"},
    ),
)


@dataclass
class DemoWorker:
    """A worker subprocess of the demo."""

    name: str
    nodename: str
    process: subprocess.Popen[bytes]
    log_path: Path


def run_demo(*, private_redis: bool = False) -> int:
    """Run the demo; 0 when every fork succeeded, 1 otherwise, 130 on Ctrl-C."""
    started = time.monotonic()
    code = EXIT_INTERRUPTED
    with _stop_signals(), ExitStack() as stack:
        try:
            code = _run(stack, private_redis=private_redis)
        except KeyboardInterrupt:
            print("\nforkq demo: interrupted", file=sys.stderr, flush=True)
        finally:
            _ignore_stop_signals()
            say("stopping the workers and everything else the demo started ...")
    say(f"done in {time.monotonic() - started:.1f} s")
    return code


def _run(stack: ExitStack, *, private_redis: bool) -> int:
    """Set everything up on `stack` (which tears it down), run the forks, report; the exit code."""
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="forkq-demo-")))
    settings = _demo_settings(stack, private_redis=private_redis)
    workers = _start_workers(stack, settings, tmp)
    client = ForkClient(settings)
    stack.callback(client.close)
    stack.callback(client.app.close)
    _wait_until_ready(client.app, workers)
    parent = _load_parent(_workspace(tmp))
    _describe_parent(parent)
    handles = {fork.label: client.launch(parent, fork.params, **fork.options) for fork in DEMO_FORKS}
    say("")
    say("live progress (times from the first launch, as recorded by Redis):")
    results = _follow(client, handles, workers)
    report(client, handles, results)
    ok = len(results) == len(handles) and all(r.status is Status.SUCCEEDED for r in results.values())
    if not ok:
        say(_log_tails(workers))
    say("")
    say(f"result: all {len(handles)} forks succeeded" if ok else "result: not every fork succeeded (see above)")
    return 0 if ok else 1


# ── Redis ─────────────────────────────────────────────────────────────────────────────────────


def _demo_settings(stack: ExitStack, *, private_redis: bool) -> Settings:
    """Choose the Redis (see the module docstring) and build the settings shared by client and workers."""
    env = load_settings()  # an invalid FORKQ_* variable: ConfigurationError naming it
    name = f"forkq-demo-{secrets.token_hex(4)}"
    broker_url: str | None = None
    if "redis_url" in env.model_fields_set:
        redis_url, broker_url = env.redis_url, env.broker_url
        where = f"{redact_url(redis_url)} (FORKQ_REDIS_URL)"
    elif not private_redis and _answers_ping(SHARED_REDIS_URL):
        redis_url, where = SHARED_REDIS_URL, f"{SHARED_REDIS_URL} (already running)"
    else:
        server = stack.enter_context(RedisServer(unix_socket=True))
        say(f"redis      private redis-server pid {server.pid}, socket {server.socket_path}")
        redis_url, broker_url, where = server.url, server.broker_url, ""
    if where:
        say(f"redis      {where}, namespace and queue {name!r} (deleted at the end)")
        # every key the demo creates there carries `name`: delete them once the workers have stopped
        stack.callback(_delete_keys, redis_url, name)
    return Settings(
        redis_url=redis_url,
        broker_url=broker_url,
        namespace=name,
        queue=name,
        provider="scripted",
        script=DEMO_SCRIPT,
        agents_dir=DEMO_AGENTS,
        worker_pool="threads",
        worker_concurrency=WORKER_CONCURRENCY,
        record_ttl_s=3600,  # if the demo itself is killed, its records still go away
    )


def _answers_ping(url: str) -> bool:
    """True when a Redis at `url` answers PING right now (no auth, no retries)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _delete_keys(redis_url: str, name: str) -> None:
    """Delete every key whose name contains the demo's namespace (forkq records, queue, kombu bindings)."""
    with redis.Redis.from_url(redis_url, socket_timeout=5) as client:
        # a SCAN pattern, not a key: forkq's keys start with the namespace, kombu's embed the queue name
        doomed = list(client.scan_iter(match=f"*{name}*", count=1000))
        if doomed:
            client.delete(*doomed)


# ── workers ───────────────────────────────────────────────────────────────────────────────────


def _worker_env(settings: Settings) -> dict[str, str]:
    """This process's environment with every FORKQ_* variable replaced by the settings the demo chose."""
    # nothing else passes: FORKQ_PROVIDER_ROUTES, say, would send the demo's forks to a real model
    # (and passing provider_routes={} to Settings would not help: pydantic-settings merges dicts with the env)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}
    for name, value in settings.model_dump(mode="json", include=set(DEMO_FIELDS)).items():
        if value is not None:  # pydantic-settings reads complex values as JSON
            env[f"FORKQ_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    env["FORKQ_BROKER_URL"] = settings.effective_broker_url
    return env


def _start_workers(stack: ExitStack, settings: Settings, tmp: Path) -> list[DemoWorker]:
    """Start the worker subprocesses; `stack` stops them (before Redis goes away)."""
    env = _worker_env(settings)
    workers: list[DemoWorker] = []
    stack.callback(_stop_workers, workers)
    for name in WORKER_NAMES:
        nodename = f"{name}-{settings.namespace}@%h"
        log_path = tmp / f"{name}.log"
        command = [sys.executable, "-m", "workers.cli", "worker", "--concurrency", str(WORKER_CONCURRENCY)]
        command += ["--loglevel", "WARNING", "--hostname", nodename]
        with log_path.open("ab") as log:
            process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        workers.append(DemoWorker(name, nodename, process, log_path))
    pids = ", ".join(f"{w.name} pid {w.process.pid}" for w in workers)
    say(f"workers    {pids} (threads pool, concurrency {WORKER_CONCURRENCY} each)")
    return workers


def _wait_until_ready(app: Celery, workers: list[DemoWorker]) -> None:
    """Ping the workers until each has answered once.

    Raises:
        ConfigurationError: a worker exited or did not answer in time; quotes the end of its log.
    """
    started = time.monotonic()
    waiting = {w.nodename.split("@", 1)[0]: w for w in workers}
    while waiting:
        for worker in waiting.values():
            if worker.process.poll() is not None:
                raise _worker_error(workers, f"worker {worker.name} exited with code {worker.process.returncode}")
        if time.monotonic() - started > READY_TIMEOUT_S:
            raise _worker_error(workers, f"workers {sorted(waiting)} did not answer a ping in {READY_TIMEOUT_S:.0f} s")
        for reply in app.control.ping(timeout=0.5) or []:
            for node in reply:
                waiting.pop(node.split("@", 1)[0], None)
    say(f"ready      both workers answered a ping after {time.monotonic() - started:.1f} s")


def _worker_error(workers: list[DemoWorker], what: str) -> ConfigurationError:
    message = f"{what}; expected both demo workers to start and answer. The end of their logs:\n{_log_tails(workers)}"
    return ConfigurationError(message, field="worker")


def _log_tails(workers: list[DemoWorker]) -> str:
    """The last lines of every worker log, indented."""
    blocks = []
    for worker in workers:
        try:
            lines = worker.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            lines = ["<log unreadable>"]
        body = "\n".join(f"    {line}" for line in lines) or "    <log empty>"
        blocks.append(f"  {worker.name} (pid {worker.process.pid}), last lines of its log:\n{body}")
    return "\n".join(blocks)


def _stop_workers(workers: list[DemoWorker]) -> None:
    """SIGTERM every worker (a warm shutdown), then SIGKILL those still running after STOP_TIMEOUT_S."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()


@contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM interrupts like Ctrl-C does; the previous handlers come back on exit (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)


def _ignore_stop_signals() -> None:
    """From here on the cleanup must finish: a second Ctrl-C or a SIGTERM would leave children running."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# ── parent and launch ─────────────────────────────────────────────────────────────────────────


def _workspace(tmp: Path) -> Path:
    """A small working directory for the forks' tools (the example's /workspace/shorty does not exist here)."""
    root = tmp / "shorty"
    for relative, text in WORKSPACE_FILES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def _load_parent(cwd: Path) -> dict[str, Any]:
    """The example parent snapshot, with its cwd pointed at the demo workspace."""
    parent: dict[str, Any] = json.loads(EXAMPLE_PARENT.read_text(encoding="utf-8"))
    parent["cwd"] = str(cwd)
    return parent


def _describe_parent(parent: Mapping[str, Any]) -> None:
    history = [Content.model_validate(m) for m in parent["history"]]
    real = sum(is_real_user_turn(c) for c in history)
    say("")
    say(f"parent     {EXAMPLE_PARENT.name}: session {parent['session_id'][:8]}…, model {parent['model']}")
    say(f"           {len(history)} messages, {real} real user turns, cwd {parent['cwd']}")
    say("launching  " + ", ".join(f"{f.label} ({f.kind})" for f in DEMO_FORKS))


# ── live progress ─────────────────────────────────────────────────────────────────────────────


def _follow(client: ForkClient, handles: Mapping[str, ForkHandle], workers: list[DemoWorker]) -> dict[str, ForkResult]:
    """Print every fork's events as they come (one line each, in Redis order) until all end or time runs out."""
    after = dict.fromkeys(handles, "0-0")
    results: dict[str, ForkResult] = {}
    origin: list[int] = []
    names = {str(w.process.pid): w.name for w in workers}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(results) < len(handles) and time.monotonic() < deadline:
        if all(w.process.poll() is not None for w in workers):
            say("  every worker has exited; see the end of their logs below")
            break
        batch = [
            (label, event)
            for label, handle in handles.items()
            if label not in results
            for event in client.store.events(handle.fork_id, after=after[label])
        ]
        batch.sort(key=lambda item: _stream_order(item[1].id))
        for label, event in batch:
            after[label] = event.id
            origin = origin or [event.at_ms]
            say(f"  +{(event.at_ms - origin[0]) / 1000:5.2f}s  {label:<9} {event.type:<10} {_detail(event, names)}")
            if event.terminal:
                results[label] = client.wait(handles[label].fork_id, timeout=5)
        if not batch:
            time.sleep(POLL_S)
    for label in [label for label in handles if label not in results]:
        status = client.status(handles[label].fork_id).status.value
        say(f"  {label}: still {status} after {RUN_TIMEOUT_S:.0f} s, giving up on it")
    return results


def _stream_order(event_id: str) -> tuple[int, int]:
    millis, _, seq = event_id.partition("-")
    return int(millis), int(seq or 0)


def _detail(event: StreamEvent, worker_names: Mapping[str, str]) -> str:
    """The event's data in words; other event types as `key value` pairs."""
    match event:
        case QueuedEvent(data=data):
            text = f"{data.kind}, seed of {data.messages} messages, digest {data.digest[:12]}…"
        case StartedEvent(data=data):
            text = f"claimed by {_worker_of(data.owner, worker_names)}, attempt {data.attempt}"
        case ModelCallEvent(data=data):
            text = f"model call {data.step} sent, request digest {data.request_digest[:12]}…"
        case StepEvent(data=data):
            text = (
                f"model call {data.step} answered: {_calls(data.tool_calls)}, "
                f"{data.input_tokens:,} tokens in / {data.output_tokens:,} out"
            )
        case ToolEvent(data=data):
            text = f"{data.tool} {'ok' if data.ok else 'error'}"
        case FinishedEvent(data=data):
            text = data.status.value + (f" ({data.error})" if data.error else "")
        case _:
            text = clip(", ".join(f"{key} {value}" for key, value in event.wire_data().items()), 90)
    return text


def _calls(tool_calls: list[str]) -> str:
    return "calls " + ", ".join(tool_calls) if tool_calls else "final answer"


def _worker_of(owner: str, worker_names: Mapping[str, str]) -> str:
    """The demo worker whose process holds `owner` (`host:pid:thread:random`)."""
    parts = owner.split(":")
    pid = parts[1] if len(parts) > 1 else ""
    return worker_names.get(pid, owner or "?")


# ── report ────────────────────────────────────────────────────────────────────────────────────

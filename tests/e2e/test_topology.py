"""deploy/docker-compose.yml, run without a container engine: the processes it declares, started locally.

Each service's argv (`entrypoint` + `command`), environment and mounted config files are read from
the compose file itself; only hosts, ports and paths are made local (service names → 127.0.0.1,
container ports → free ports, volumes → the repository's files or a temp dir), plus what a test
needs: the scripted provider (FORKQ_SCRIPT), one heartbeat file and one Celery node name per worker.
The secrets compose reads from deploy/.env are the test's own; the optional forkq.env is not read.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from broker_config.settings import Settings
from tests.conftest import missing_tool
from tests.live import wait_until
from workers.app import make_app
from workers.client import ForkClient
from workers.demo.redis_server import find_redis_server
from workers.records.fork import Status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PARENT = REPO_ROOT / "workers" / "examples" / "parent.json"
BIN = Path(sys.executable).parent
STEPS, STEP_DELAY_S = 8, 0.75  # a fork runs ~6 s: long enough to be seen running, and stopped mid-way
FORKS = 4


# ── the compose file ─────────────────────────────────────────────────────────────────────────

_VARIABLE = re.compile(
    r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\}|(?P<bare>[A-Za-z_]\w*))"
)


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Compose's interpolation: `$$`, `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg")
        value = variables.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op in (":-", "-") and unset:
            return arg
        if op in (":?", "?") and unset:
            raise AssertionError(f"compose needs {name}: {arg}")
        return value or ""

    return _VARIABLE.sub(one, text)


def interpolated(value: Any, variables: Mapping[str, str]) -> Any:
    """`value` with every string interpolated."""
    if isinstance(value, str):
        return interpolate(value, variables)
    if isinstance(value, list):
        return [interpolated(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: interpolated(v, variables) for k, v in value.items()}
    return value


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's `environment`, as a map (compose allows a map or a `KEY=VALUE` list)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def argv_of(service: dict[str, Any]) -> list[str]:
    """`entrypoint` + `command` (the compose file writes both as lists: no shell, no Dockerfile defaults)."""
    entrypoint, command = service.get("entrypoint") or [], service.get("command") or []
    assert isinstance(entrypoint, list) and isinstance(command, list), "entrypoint/command must be YAML lists"
    return [str(a) for a in [*entrypoint, *command]]


# ── local processes ──────────────────────────────────────────────────────────────────────────


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Proc:
    """One started service process (its own process group) and its log."""

    name: str
    service: str
    process: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]
    metrics_port: int | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


@dataclass
class Topology:
    """The compose services, started as local processes sharing one temp dir."""

    directory: Path
    compose: dict[str, Any]
    variables: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    ports: dict[tuple[str, int], int] = field(default_factory=dict)  # (service, container port) → local port

    def service(self, name: str) -> dict[str, Any]:
        return interpolated(self.compose["services"][name], self.variables)

    def local_port(self, service: str, container_port: int) -> int:
        return self.ports.setdefault((service, container_port), free_port())

    def localize(self, value: str) -> str:
        """A URL naming a compose service (`redis://:pw@redis:6379/0`) → the local process's host and port."""
        parts = urlsplit(value)
        if parts.hostname in self.compose["services"] and parts.port is not None:
            port = self.local_port(parts.hostname, parts.port)
            auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
            return parts._replace(netloc=f"{auth}127.0.0.1:{port}").geturl()
        return value

    def mounts(self, name: str, service: dict[str, Any]) -> dict[str, str]:
        """Container path → local path: bind mounts from the deploy dir, named volumes in the temp dir."""
        paths = {}
        for volume in service.get("volumes") or []:
            source, target = str(volume).split(":")[:2]
            if source.startswith((".", "/")):
                paths[target] = str((COMPOSE.parent / source).resolve())
            else:
                local = self.directory / f"{name}-{source}"
                local.mkdir(exist_ok=True)
                paths[target] = str(local)
        return paths

    def start(
        self, name: str, label: str, argv: list[str], env: dict[str, str], metrics_port: int | None = None
    ) -> Proc:
        log_path = self.directory / f"{label}.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FORKQ_", "FLOWER_"))}
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv,
                cwd=self.directory,
                env={**base, **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: cleaned up as one
            )
        proc = Proc(label, name, process, log_path, env, metrics_port)
        self.procs.append(proc)
        return proc

    def forkq_env(self, service: dict[str, Any], *, scripted: bool = True) -> dict[str, str]:
        env = {k: self.localize(v) for k, v in environment_of(service).items()}
        if scripted:  # the test's model: the scripted provider, whatever provider the deployment configures
            env |= {"FORKQ_PROVIDER": "scripted", "FORKQ_SCRIPT": str(self.directory / "script.json")}
        return env

    def start_redis(self) -> Proc:
        service = self.service("redis")
        mounts = self.mounts("redis", service)
        argv = [mounts.get(arg, arg) for arg in argv_of(service)]
        assert argv[0] == "redis-server", argv
        argv[0] = find_redis_server()
        port = self.local_port("redis", 6379)
        # later options win over the config file's: a loopback port of our own
        return self.start(
            "redis", "redis", [*argv, "--port", str(port), "--bind", "127.0.0.1"], environment_of(service)
        )

    def start_forkq(self, name: str, label: str) -> Proc:
        service = self.service(name)
        argv = argv_of(service)
        assert argv[0] in ("forkq", "celery"), argv
        argv[0] = str(BIN / argv[0])
        env = self.forkq_env(service)
        metrics_port = None
        if "FORKQ_METRICS_PORT" in env:
            metrics_port = free_port()
            env["FORKQ_METRICS_PORT"] = str(metrics_port)
        if argv[1:2] == ["worker"]:  # one container each in compose: here one node name and heartbeat each
            argv += ["--hostname", f"{label}@%h"]
            env["FORKQ_HEARTBEAT_FILE"] = str(self.directory / f"{label}.heartbeat")
            if "FORKQ_WORKSPACE_DIR" in env:  # the container's own tmpfs: here a folder of the test's
                env["FORKQ_WORKSPACE_DIR"] = str(self.directory / f"{label}-workspaces")
        return self.start(name, label, argv, env, metrics_port)

    def start_flower(self) -> Proc:
        service = self.service("flower")
        argv = argv_of(service)
        assert argv[0] == "celery" and "flower" in argv, argv
        argv[0] = str(BIN / "celery")
        port = self.local_port("flower", 5555)
        argv = [re.sub(r"^--port=\d+$", f"--port={port}", a) for a in argv]
        argv = [re.sub(r"^--address=.*$", "--address=127.0.0.1", a) for a in argv]
        assert f"--port={port}" in argv, argv
        return self.start("flower", "flower", argv, self.forkq_env(service, scripted=False))

    def healthcheck(self, proc: Proc) -> subprocess.CompletedProcess[str]:
        """Run the service's compose health check (`CMD` form, a forkq command) with the process's environment."""
        test = self.service(proc.service)["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "forkq", test
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FORKQ_", "FLOWER_"))}
        argv = [str(BIN / "forkq"), *test[2:]]
        return subprocess.run(argv, env={**base, **proc.env}, capture_output=True, text=True, timeout=30, check=False)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


# ── HTTP helpers ─────────────────────────────────────────────────────────────────────────────


def http(url: str, auth: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):  # not listening (yet)
        return 0, b""


def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = http(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, f"/metrics on port {port} answered {status}"
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def sample(samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def poll(predicate: Callable[[], Any], timeout: float, what: str, procs: list[Proc]) -> Any:
    """Poll until `predicate` returns something truthy; on timeout or a dead process, fail with the logs."""

    def logs() -> str:
        return "\n".join(f"── {p.name} (exit {p.process.poll()}):\n{p.log()[-3000:]}" for p in procs)

    def holds() -> Any:
        value = predicate()
        if not value and any(not p.alive() and p.name != "victim" for p in procs):
            pytest.fail(f"process died waiting for {what}\n{logs()}")
        return value

    return wait_until(holds, timeout, lambda: f"{what}\n{logs()}")


# ── the test ─────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def topology(tmp_path: Path, redis_executable: str) -> Iterator[Topology]:
    """The compose file's services as local processes; every process is stopped after the test."""
    if not COMPOSE.is_file():
        pytest.fail(f"{COMPOSE} is missing: the topology test starts what it declares")
    version = subprocess.run([redis_executable, "--version"], capture_output=True, text=True, check=True).stdout
    if " v=6." in version:  # the deployment's redis.conf is written for the compose file's Redis 7 image
        found = f"{redis_executable} is {version.strip()}"
        missing_tool("redis-server 7 or later", f"deploy/redis.conf needs Redis 7; {found}")
    compose = yaml.safe_load(COMPOSE.read_text())
    # a service added to the compose file must be added here too, not silently left out
    assert set(compose["services"]) == {"redis", "worker", "sweeper", "flower"}, sorted(compose["services"])
    variables = {
        "REDIS_PASSWORD": secrets.token_hex(16),
        "FLOWER_BASIC_AUTH": f"ops:{secrets.token_hex(8)}",
    }
    call = {"functionCall": {"id": "ls", "name": "list_directory", "args": {"path": "."}}}
    steps = [{"delay_s": STEP_DELAY_S, "content": {"role": "model", "parts": [call]}} for _ in range(STEPS)]
    (tmp_path / "script.json").write_text(json.dumps({"steps": steps}))
    topo = Topology(tmp_path, compose, variables)
    try:
        yield topo
    finally:
        topo.close()


def test_the_compose_topology_runs_forks_shows_them_in_flower_and_survives_a_worker_sigterm(
    topology: Topology, tmp_path: Path
) -> None:
    variables = topology.variables
    auth = variables["FLOWER_BASIC_AUTH"]

    # Given Redis with deploy/redis.conf, two workers, the sweeper and Flower, as compose declares them
    redis_proc = topology.start_redis()
    worker_env = topology.forkq_env(topology.service("worker"))
    settings = Settings(
        redis_url=worker_env["FORKQ_REDIS_URL"],
        namespace=worker_env["FORKQ_NAMESPACE"],
        queue=worker_env["FORKQ_QUEUE"],
    )
    client = redis.Redis.from_url(settings.redis_url)
    poll(lambda: _pings(client), 10, "Redis", [redis_proc])
    assert client.config_get("appendonly")["appendonly"] == "yes"  # deploy/redis.conf is the one running
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    workers = [topology.start_forkq("worker", f"worker{n}") for n in (1, 2)]
    sweeper = topology.start_forkq("sweeper", "sweeper")
    flower = topology.start_flower()
    procs = topology.procs
    flower_url = f"http://127.0.0.1:{topology.local_port('flower', 5555)}"

    # Flower learns workers from their events: once it lists both, it receives task events too
    def flower_workers() -> set[str]:
        status, body = http(f"{flower_url}/api/workers?status=true", auth)
        return {name for name, alive in json.loads(body).items() if alive} if status == 200 else set()

    poll(lambda: {"worker1", "worker2"} <= {n.split("@")[0] for n in flower_workers()}, 45, "workers in Flower", procs)
    assert http(f"{flower_url}/api/tasks")[0] == 401  # no credentials, no API

    # When forks are launched from the example parent
    project = tmp_path / "project"  # the parent's tree (snapshotted at launch), beside the topology's live files
    project.mkdir()
    (project / "README.md").write_text("# project\n", encoding="utf-8")
    parent = {**json.loads(PARENT.read_text()), "cwd": str(project)}
    app = make_app(settings)
    with ForkClient(settings, app=app) as forks, contextlib.closing(app), contextlib.closing(client):
        handles = [
            forks.launch(parent, {"description": f"t{n}", "prompt": f"look {n}", "subagent_type": "fork"})
            for n in range(FORKS)
        ]

        # Then Flower shows each running fork's progress: state PROGRESS, the step summary as its result
        def progressing(fork_id: str) -> dict[str, Any] | None:
            status, body = http(f"{flower_url}/api/task/info/{fork_id}.1", auth)
            info = json.loads(body) if status == 200 else {}
            return info if info.get("state") == "PROGRESS" else None

        info = poll(lambda: progressing(handles[0].fork_id), 30, "a PROGRESS state in Flower", procs)
        assert re.match(r"step \d+: called list_directory \(", info["result"]), info
        assert info["name"] == "forkq.run_fork"

        # And the workers' /metrics count the running forks and their model calls
        def counted(name: str) -> float:
            return sum(sample(metrics(w.metrics_port or 0), name) for w in workers)

        poll(lambda: counted("forkq_forks_running") == FORKS, 15, "all forks running", procs)
        poll(lambda: counted("forkq_model_call_seconds_count") >= FORKS, 15, "a step of every fork", procs)

        # When a worker running a fork gets SIGTERM mid-fork (Celery's warm shutdown; compose's stop_signal)
        def owner_pid(fork_id: str) -> int | None:
            state = forks.status(fork_id)
            return int(state.owner.split(":")[1]) if state.status == Status.RUNNING and state.owner else None

        owners = {h.fork_id: owner_pid(h.fork_id) for h in handles}
        victim = next(w for w in workers if w.process.pid in owners.values())
        survivor = next(w for w in workers if w is not victim)
        moved = [fid for fid, pid in owners.items() if pid == victim.process.pid]
        assert sample(metrics(victim.metrics_port or 0), "forkq_forks_running") == len(moved)
        victim.name = "victim"
        victim.process.send_signal(signal.SIGTERM)

        # Then it exits, and its forks finish on the other worker
        poll(lambda: not victim.alive(), 30, "the SIGTERMed worker to exit", procs)
        assert victim.process.returncode == 0, victim.log()[-3000:]
        results = [h.wait(timeout=45) for h in handles]
        assert [r.status for r in results] == [Status.SUCCEEDED] * FORKS, results
        for fid in moved:
            events = list(forks.events(fid))
            started = [e.wire_data() for e in events if e.type == "started"]
            assert [s["attempt"] for s in started] == [1, 2]
            assert int(started[-1]["owner"].split(":")[1]) == survivor.process.pid
            assert [e.wire_data() for e in events if e.type == "released"] == [{"reason": "worker shutdown"}]

    # And Flower has every run of the moved forks, with what each delivery did as its result
    def task_info(task_id: str) -> dict[str, Any]:
        status, body = http(f"{flower_url}/api/task/info/{task_id}", auth)
        return json.loads(body) if status == 200 else {}

    for fid in moved:
        first = poll(lambda fid=fid: _final(task_info(f"{fid}.1")), 15, f"{fid}.1 to end in Flower", procs)
        second = poll(lambda fid=fid: _final(task_info(f"{fid}.2")), 15, f"{fid}.2 to end in Flower", procs)
        # a custom final state: the delivery handed its fork to another worker
        assert (first["state"], first["result"]) == ("RELEASED", "'released'")
        assert (second["state"], second["result"]) == ("SUCCESS", "'succeeded'")
        assert second["worker"].startswith("worker") and second["worker"] != first["worker"]
    status, body = http(f"{flower_url}/api/tasks?limit=100", auth)
    assert status == 200
    assert {f"{h.fork_id}.1" for h in handles} <= set(json.loads(body))

    # And the survivor's /metrics counted its finished forks and the revived run (attempt 2)
    assert survivor.metrics_port is not None
    after = metrics(survivor.metrics_port)
    assert sample(after, "forkq_forks_finished_total", status="succeeded") >= len(moved)
    assert sample(after, "forkq_claim_attempt_count") - sample(after, "forkq_claim_attempt_bucket", le="1.0") >= len(
        moved
    )
    assert sample(after, "forkq_forks_running") == 0
    assert sample(after, "forkq_tool_calls_total", tool="list_directory", outcome="ok") >= 1
    # the sweeper serves its own (nothing expired: the SIGTERMed worker handed its forks over itself)
    assert sweeper.metrics_port is not None
    assert ("forkq_revivals_total", (("outcome", "revive"),)) in metrics(sweeper.metrics_port)

    # And the compose health checks pass: `forkq check --worker` on the worker, `forkq check` elsewhere
    for proc in (survivor, sweeper, flower):
        probe = topology.healthcheck(proc)
        assert probe.returncode == 0, (proc.name, probe.stdout, probe.stderr)
    assert "worker heartbeat" in topology.healthcheck(survivor).stdout
    assert flower.alive() and sweeper.alive()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _final(info: dict[str, Any]) -> dict[str, Any] | None:
    return info if info.get("state") not in (None, "PENDING", "RECEIVED", "STARTED", "PROGRESS") else None

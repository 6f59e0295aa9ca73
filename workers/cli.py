"""The `forkq` command: launch, status, result, events, cancel, resume, approve, deny, inspect, send, list,
agents, providers, worker, check, sweep, serve, demo.

Exit codes: 0 done, 1 failed (or no result yet), 2 bad input or settings (nothing was written), 3 the fork
is parked (`awaiting_approval` or `paused`: a person must act before it can end). Every command that prints
takes `--json`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from broker_config.settings import Settings, load_settings, redact_url
from workers.base.extras import require_extra
from workers.base.limits import MAX_SCHEMA_FILE_BYTES
from workers.cli_args import build_parser
from workers.errors import (
    ApplyConflict,
    ConfigurationError,
    ForkNotPaused,
    ForkParked,
    ForkqError,
    ForkTimeout,
    InvalidAgentParams,
    InvalidBudget,
    InvalidHistory,
    InvalidParentSnapshot,
    MessageRefused,
    SessionCancelled,
    WorkspaceTooLarge,
    utc_text,
)
from workers.history.snapshot import load_parent_snapshot, read_json_file
from workers.store.health import check_redis

if TYPE_CHECKING:  # a type only: `forkq status` starts without the records it reads
    from workers.records.parked import WaitingFor

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_PARKED = 0, 1, 2, 3
DEFAULT_DESCRIPTION_CHARS = 80  # the prompt's first words, when no --description is given
MAX_TEXT_FILE_BYTES = 256 * 1024  # `--persona FILE`, `send --file F`


def _settings() -> Settings:
    return load_settings()


def _client() -> Any:
    from workers.client import ForkClient  # no Celery: a send-only app is built on the first launch

    return ForkClient(_settings())


def _print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2))


def cmd_launch(args: argparse.Namespace) -> int:
    """Launch a fork (or subagent) from a parent snapshot file."""
    # the prompt's own words, made valid text: a bad byte in the prompt is then reported as the prompt's
    words = args.prompt.encode("utf-8", "replace").decode("utf-8").split()
    default_description = " ".join(words[:5])[:DEFAULT_DESCRIPTION_CHARS]
    params: dict[str, Any] = {
        "description": args.description if args.description is not None else default_description,
        "prompt": args.prompt,
    }
    for field in ("subagent_type", "fork_turns", "name", "model"):
        if getattr(args, field) is not None:
            params[field] = getattr(args, field)
    if args.fork_tools is not None:
        params["fork_tools"] = _tool_list(args.fork_tools)
    parent = load_parent_snapshot(Path(args.parent))
    schema = _json_file(args.output_schema, "--output-schema") if args.output_schema else None
    persona = _text_file(args.persona, "--persona", "persona") if args.persona is not None else None
    tool_filter = _tool_list(args.tool_filter, "tool_filter") if args.tool_filter is not None else None
    with _client() as client:
        handle = client.launch(
            parent,
            params,
            approval_policy=args.approval_policy,
            output_schema=schema,
            max_wall_s=args.max_wall_s,
            max_turns=args.max_turns,
            max_tokens=args.max_tokens,
            seed_mode=args.seed_mode,
            persona=persona,
            tool_filter=tool_filter,
            max_depth=args.max_depth,
            workspace=args.workspace,
            network=args.network,
        )
        status = client.status(handle.fork_id).status.value
    if args.json:
        _print_json({"fork_id": handle.fork_id, "status": status})
    else:
        print(handle.fork_id)
    return EXIT_OK


def _tool_list(text: str, field: str = "fork_tools") -> Any:
    """`--fork-tools`, `--tool-filter`: a JSON array, or names separated by commas (`""` is the empty list)."""
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidAgentParams(
                f"--{field.replace('_', '-')} is not a JSON array of tool names: {exc}; send a flat list such as "
                '\'["read_file", "grep_search"]\' or read_file,grep_search',
                field=field,
            ) from exc
    return [name for name in text.split(",")] if text else []


def _text_file(path: str, option: str, field: str) -> str:
    """A text option's file: its UTF-8 text, at most MAX_TEXT_FILE_BYTES."""
    try:
        with Path(path).open("rb") as handle:
            data = handle.read(MAX_TEXT_FILE_BYTES + 1)
    except OSError as exc:
        raise InvalidAgentParams(f"{option} {path!r}: cannot read it ({exc.strerror})", field=field) from exc
    if len(data) > MAX_TEXT_FILE_BYTES:
        raise InvalidAgentParams(
            f"{option} {path!r}: larger than {MAX_TEXT_FILE_BYTES // 1024} KiB; shorten it", field=field
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidAgentParams(f"{option} {path!r}: not UTF-8 text; save it as UTF-8", field=field) from exc


def cmd_send(args: argparse.Namespace) -> int:
    """Give a fork (by id, or a teammate by session and name) a message."""
    from workers.store.replies import SendReply

    fork_id, text = _send_target(args)
    with _client() as client:
        sent = client.send(fork_id, text) if fork_id is not None else client.send_to(args.session, args.to, text)
        status = client.status(sent.fork_id).status.value
    if args.json:
        _print_json({"fork_id": sent.fork_id, "outcome": sent.outcome, "status": status, "waiting": sent.waiting})
    elif sent.outcome is SendReply.CONTINUED:
        print(f"{sent.fork_id}: continued (queued again; `forkq result {sent.fork_id} --wait` for its answer)")
    else:
        print(f"{sent.fork_id}: in its inbox ({sent.waiting} waiting), read before its next model call")
    return EXIT_OK


def _send_target(args: argparse.Namespace) -> tuple[str | None, str]:
    """(fork id or None with --to, message) from `forkq send`'s arguments."""
    words = list(args.words)
    if (args.to is None) != (args.session is None):
        raise InvalidAgentParams("--to and --session go together: --session S --to NAME names a teammate", field="to")
    fork_id = None if args.to is not None else (words.pop(0) if words else None)
    if args.to is None and fork_id is None:
        raise InvalidAgentParams("name the fork: forkq send ID MESSAGE (or --session S --to NAME)", field="fork_id")
    if (args.file is None) == (len(words) != 1):
        raise InvalidAgentParams("give the message once: as one argument (quote it) or with --file F", field="message")
    text = words[0] if args.file is None else _text_file(args.file, "--file", "message")
    return fork_id, text


def cmd_list(args: argparse.Namespace) -> int:
    """List a parent session's forks."""
    with _client() as client:
        forks = client.list(args.session)
    if args.json:
        _print_json(forks)
        return EXIT_OK
    for fork in forks:
        name = f" {fork['name']}" if fork.get("name") else ""
        print(f"{fork['fork_id']} {fork['kind']}{name} {fork['status']}: {fork['description']}")
    return EXIT_OK


def cmd_agents(args: argparse.Namespace) -> int:
    """List the subagent definitions."""
    from workers.subagents.definitions import load_catalog

    listing = load_catalog(_settings().agents_dir).listing()
    if args.json:
        _print_json(listing)
        return EXIT_OK
    for agent in listing:
        tools = "every tool of the parent but the Agent tool" if agent["tools"] is None else ", ".join(agent["tools"])
        print(f"{agent['name']} ({agent['source']}): {agent['description']}")
        model = agent["model"] or "the parent's"
        print(f"    tools: {tools}; model: {model}" + _turns(agent["max_turns"]))
    return EXIT_OK


def _turns(max_turns: int | None) -> str:
    return "" if max_turns is None else f"; max_turns: {max_turns}"


def cmd_providers(args: argparse.Namespace) -> int:
    """List the subagent providers and their capabilities."""
    from workers.subagents.capabilities import providers

    listing = providers()
    if args.json:
        _print_json(listing)
        return EXIT_OK
    for provider in listing:
        caps = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in provider["capabilities"].items())
        print(f"{provider['name']}: {caps}")
        for mode, mode_caps in provider.get("seedModes", {}).items():
            print(f"    seed_mode {mode}: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in mode_caps.items()))
    return EXIT_OK


def _json_file(path: str, option: str) -> Any:
    what = f"{option} {path!r}"
    return read_json_file(
        Path(path), what=what, max_bytes=MAX_SCHEMA_FILE_BYTES, error=InvalidAgentParams, field="output_schema"
    )


def cmd_approve(args: argparse.Namespace) -> int:
    """Approve (or deny) a call a parked fork waits on."""
    from workers.store.replies import Decision

    with _client() as client:
        if args.command == "approve":
            status = client.approve(args.fork_id, args.call_id)
        else:
            status = client.deny(args.fork_id, args.call_id, args.reason)
    outcome = Decision.after(status)  # the fork goes on, or other calls still wait
    if args.json:
        decision = {"fork_id": args.fork_id, "call_id": args.call_id, "decision": args.command, "outcome": outcome}
        _print_json(decision)
    else:
        print("resumed: the fork is queued again" if outcome is Decision.QUEUED else "recorded: other calls still wait")
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
        _print_wait(state.fork_id, state.waiting_for)
        _print_pending([call.wire() for call in state.pending_approval])
    return EXIT_OK


def _print_wait(fork_id: str, wait: WaitingFor | None, file: Any = None) -> None:
    """What a fork waits for, in the CLI's words: the command that ends a parked fork's wait, or its model's."""
    from workers.records.parked import ModelWait, ResumeWait  # loaded already: the state was read

    if wait is None:
        return
    if isinstance(wait, ModelWait):
        print(f"  waiting for model {wait.model}: its {wait.limit.value} limit (FORKQ_MODEL_LIMITS)", file=file)
    elif isinstance(wait, ResumeWait) and wait.detail:  # a budget pause: the detail says what raises it
        print(f"  waiting for resume: {wait.reason}: {wait.detail}", file=file)
    elif isinstance(wait, ResumeWait):
        print(f"  waiting for resume: {wait.reason}; once that is fixed, `forkq resume {fork_id}`", file=file)
    else:
        names = ", ".join(f"{c.call_id} ({c.name})" for c in wait.calls)
        print(f"  waiting for approval of {names}: `forkq approve|deny {fork_id} CALL_ID`", file=file)


def _print_pending(calls: list[dict[str, Any]], file: Any = None) -> None:
    for call in calls:
        args_text = json.dumps(call.get("args", {}), ensure_ascii=False)
        print(f"  awaiting approval: {call.get('call_id')} {call.get('name')} {args_text}", file=file)


def cmd_result(args: argparse.Namespace) -> int:
    """Show a fork's final output (waiting for it with --wait); exit 3 at once for a parked fork."""
    from workers.client import parked_error
    from workers.records.fork import Status

    with _client() as client:
        try:
            result = client.wait(args.fork_id, timeout=args.timeout) if args.wait else client.result(args.fork_id)
            if result is None:
                state = client.status(args.fork_id)
                if state.status.parked:
                    raise parked_error(state)
                if args.json:
                    fields = {"fork_id": args.fork_id, "status": state.status.value, "output": None, "usage": None}
                    _print_json({**fields, "error": state.error or None})
                else:
                    print(f"fork {args.fork_id} is {state.status.value}: no result yet (use --wait)", file=sys.stderr)
                return EXIT_FAIL
        except ForkParked as parked:
            _print_parked(parked, as_json=args.json)
            return EXIT_PARKED
        notification = client.notification(args.fork_id) if args.notification else None
    fields = {"fork_id": result.fork_id, "status": result.status.value}
    if notification is not None and args.json:
        _print_json({**fields, "notification": notification})
    elif notification is not None:
        print(notification)
    elif args.json:
        _print_json({**fields, "output": result.output, "usage": result.usage.model_dump(), "error": result.error})
    else:
        print(result.output if result.output is not None else f"[{result.status.value}] {result.error}")
    return EXIT_OK if result.status is Status.SUCCEEDED else EXIT_FAIL


def _print_parked(parked: ForkParked, *, as_json: bool) -> None:
    """A parked fork, for `result`: its status and the calls it waits on (stdout with --json, else stderr)."""
    if as_json:
        fields = {"fork_id": parked.fork_id, "status": parked.status, "output": None, "usage": None, "error": None}
        _print_json({**fields, "waiting_for": parked.waiting_for, "pending_approval": parked.pending})
        return
    print(f"forkq result: {parked}", file=sys.stderr)
    _print_pending(parked.pending, file=sys.stderr)


def cmd_events(args: argparse.Namespace) -> int:
    """Print a fork's progress events, following them with --follow (--json: one JSON object per line)."""
    with _client() as client:
        client.status(args.fork_id)
        for event in client.events(args.fork_id, follow=args.follow):
            data = event.wire_data()  # as stored, whatever the type (an unknown one too)
            if args.json:
                line = json.dumps({"id": event.id, "at_ms": event.at_ms, "type": event.type, "data": data})
                print(line, flush=True)
                continue
            when = datetime.fromtimestamp(event.at_ms / 1000, tz=UTC).strftime("%H:%M:%S.%f")[:-3]
            print(f"{when} {event.type:<9} {json.dumps(data, ensure_ascii=False)}", flush=True)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a fork that has not ended, or (--session) every fork of a parent session."""
    if (args.fork_id is None) == (args.session is None):
        raise InvalidAgentParams(
            "name one fork id or one --session, not both nor neither: forkq cancel ID | forkq cancel --session S",
            field="session" if args.session is not None else "fork_id",
        )
    if args.session is not None:
        return _cancel_session(args.session, as_json=args.json)
    with _client() as client:
        status = client.cancel(args.fork_id).value
    if args.json:
        _print_json({"fork_id": args.fork_id, "status": status})
    else:
        print(status)
    return EXIT_OK


def _cancel_session(session: str, *, as_json: bool) -> int:
    with _client() as client:
        outcome = client.cancel_session(session)
    if as_json:
        _print_json(outcome.model_dump(mode="json"))
        return EXIT_OK
    print(
        f"session {session}: {outcome.cancelled} forks cancelled, {outcome.already_ended} had already ended; "
        f"launches into it are refused until {utc_text(outcome.refused_until_ms)}"
    )
    return EXIT_OK


def cmd_resume(args: argparse.Namespace) -> int:
    """Re-enqueue a paused fork (exit 1 when it was not paused)."""
    with _client() as client:
        try:
            client.resume(args.fork_id)
            resumed = True
        except ForkNotPaused:
            resumed = False
        status = client.status(args.fork_id).status.value
    if args.json:
        _print_json({"fork_id": args.fork_id, "resumed": resumed, "status": status})
    else:
        print(status if resumed else f"fork {args.fork_id} is {status}, not paused: nothing to resume")
    return EXIT_OK if resumed else EXIT_FAIL


def cmd_budget(args: argparse.Namespace) -> int:
    """Show a parent session's token budget, or set it (--tokens), resuming the forks it paused."""
    with _client() as client:
        budget = (
            client.budget(args.session) if args.tokens is None else client.set_budget(args.session, tokens=args.tokens)
        )
    if args.json:
        _print_json(budget.model_dump(mode="json"))
        return EXIT_OK
    print(f"session {budget.session}: {_budget_line(budget.tokens, budget.used, budget.left)}")
    if budget.resumed:
        print(f"resumed {len(budget.resumed)} fork(s) it paused: {', '.join(budget.resumed)}")
    return EXIT_OK


def _budget_line(limit: int | None, used: int, left: int | None) -> str:
    if limit is None:
        return f"no limit, used {used:,} tokens"
    return f"used {used:,} of {limit:,} tokens, {left:,} left"


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a fork's bootstrap record, seed resolved and verified (and what it waits for, when parked)."""
    with _client() as client:
        record = client.inspect(args.fork_id)
        wait = client.status(args.fork_id).waiting_for
    budget = record["budget"]
    if args.json:
        _print_json({**record, "waiting_for": None if wait is None else wait.model_dump(mode="json")})
    else:
        print(f"fork {record['fork_id']} ({record['kind']}), digest {record['digest']}")
        print(
            f"fork_turns={record['fork_turns']!r} model={record['model']!r} cwd={record['cwd']!r} "
            f"depth={record['depth']} messages={len(record['initial_messages'])}"
        )
        print(
            f"subagent_type={record['subagent_type']!r} name={record['name']!r} "
            f"approval_policy={record['approval_policy']} max_wall_s={record['max_wall_s']} "
            f"max_turns={record['max_turns']} fork_tools={record['fork_tools']}"
        )
        agent = f"agent={record['agent']} ({record['agent_source']})" if record["agent"] else "agent=none"
        print(
            f"seed_mode={record['seed_mode']} {agent} persona={record['persona']} "
            f"tool_filter={record['tool_filter']} max_depth={record['max_depth']}"
        )
        schema = record["output_schema"]
        print(f"output_schema: {'none' if schema is None else json.dumps(schema, ensure_ascii=False)[:500]}")
        print(f"task prompt: {record['task_prompt'][:200]}")
        print(f"workspace: {_workspace_line(record['workspace'])}")
        print(f"max_tokens: {_budget_line(budget['max_tokens'], budget['used'], budget['left'])}")
        session = budget["session"]
        line = _budget_line(session["tokens"], session["used"], session["left"])
        print(f"session budget ({session['session']}): {line}")
        print(f"tenant: {record['tenant']}")
        for decided in record["approvals"]:
            print(f"approval: {_decision_line(decided)}")
        _print_wait(args.fork_id, wait)
    return EXIT_OK


def _decision_line(decided: dict[str, Any]) -> str:
    """One audited decision on a parked call, as `inspect` prints it."""
    who = decided["decided_by"] or "unrecorded"
    at = "" if decided["decided_ms"] is None else f" at {utc_text(decided['decided_ms'])}"
    tenant = f" of tenant {decided['decided_tenant']}" if decided["decided_tenant"] else ""
    why = f" ({decided['reason']})" if decided["reason"] else ""
    return f"{decided['decision']} {decided['name']} ({decided['call_id']}) by {who}{tenant}{at}{why}"


def cmd_changes(args: argparse.Namespace) -> int:
    """Print a snapshot fork's changes: a patch, its files (--stat), or both as JSON."""
    with _client() as client:
        changes = client.changes(args.fork_id)
        if args.json:
            _print_json({"fork_id": args.fork_id, "files": changes.stat(), "patch": changes.patch().decode("utf-8")})
        elif args.stat:
            for stat in changes.stat():
                counts = "binary" if stat["binary"] else f"+{stat['added']} -{stat['removed']}"
                print(f"{stat['status']:<8} {counts:<14} {stat['path']}")
        else:
            sys.stdout.flush()
            sys.stdout.buffer.write(changes.patch())
            sys.stdout.buffer.flush()
    return EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    """Apply a snapshot fork's changes to the parent's cwd or --dir: all or nothing (a conflict exits 2)."""
    with _client() as client:
        try:
            paths = client.apply(args.fork_id, args.dir, check=args.check)
        except ApplyConflict as exc:
            print(f"forkq apply: {exc}", file=sys.stderr)
            return EXIT_USAGE
    verb = "would change" if args.check else "changed"
    print(f"{verb} {len(paths)} file(s)" + "".join(f"\n  {p}" for p in paths))
    return EXIT_OK


def _workspace_line(ref: dict[str, Any] | None) -> str:
    if ref is None:
        return "shared (launched before workspaces)"
    if ref["mode"] == "shared":
        return f"shared: {ref['root']}"
    network = "" if ref["network"] else ", no network"
    return f"snapshot of {ref['root']} (manifest {ref['manifest'] or 'empty'}{', git' if ref['git'] else ''}{network})"


def cmd_worker(args: argparse.Namespace) -> int:
    """Run a Celery worker for forkq's queue; refuses to start without a provider or on a Redis that may evict."""
    require_extra("worker", "forkq worker")
    from workers.app import make_app
    from workers.providers.routing import provider_problems
    from workers.workspace.sandbox import sandbox_problems

    settings = _settings()
    # before Redis: naming no provider, or a machine that cannot sandbox commands, is the first thing to fix
    problems = provider_problems(settings) + sandbox_problems(settings.sandbox)
    health = check_redis(settings)
    if problems or (health.problems and health.reachable):  # settings to fix: exit 2
        raise ConfigurationError("worker refuses to start: " + "; ".join(problems + health.problems))
    if health.problems:  # an outage, not a usage error: exit 1, so that a supervisor retries
        print(f"forkq worker: cannot start: {'; '.join(health.problems)}", file=sys.stderr)
        return EXIT_FAIL
    # --pool/--concurrency go through the settings: Celery's CLI would let app.conf override a "prefork"
    settings = settings.model_copy(
        update={
            "worker_pool": args.pool or settings.worker_pool,
            "worker_concurrency": args.concurrency or settings.worker_concurrency,
        }
    )
    app = make_app(settings)
    # forkq keeps its own state in Redis: no revoke lists to sync at start (mingle), no gossip
    argv = ["worker", "-Q", settings.queue, "-P", settings.worker_pool, "-c", str(settings.worker_concurrency)]
    argv += ["-l", args.loglevel, "--without-mingle", "--without-gossip"]
    if args.hostname:
        argv += ["-n", args.hostname]
    return _run_worker(app, argv)


def _run_worker(app: Any, argv: list[str]) -> int:
    """Run `celery worker` and return its exit code: non-zero when start-up failed, so supervisors restart it.

    Celery's `app.start` drops the code the worker command exits with (a bootstep that raises at start,
    such as a taken FORKQ_METRICS_PORT, sets the worker's exit code to 1 and `start` still returns
    None), so the code is taken from the worker itself when it shuts down.
    """
    from celery.signals import worker_shutdown

    codes: list[int] = []

    def record(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            codes.append(int(getattr(sender, "exitcode", 0) or 0))

    worker_shutdown.connect(record, weak=False)
    try:
        code = app.start(argv)
    finally:
        worker_shutdown.disconnect(record)
    return int(code or (codes[-1] if codes else 0))


def cmd_check(args: argparse.Namespace) -> int:
    """Exit 0 when Redis is reachable and fit for forkq (and, with --worker, a worker is alive)."""
    settings = _settings()
    health = check_redis(settings)
    if args.worker:  # the worker's liveness: its heartbeat file, rewritten by its event loop
        from workers.service.heartbeat import heartbeat_problem  # the worker side: only for --worker

        stale = heartbeat_problem(settings.heartbeat_file, settings.heartbeat_s)
        health.problems += [stale] if stale else []
        sandbox = _sandbox_status(settings.sandbox, health.problems)
    if args.json:
        report = {
            "ok": not health.problems,
            "redis": redact_url(settings.redis_url),
            "queue": settings.queue,
            "worker_heartbeat": str(settings.heartbeat_file) if args.worker else None,
            "sandbox": sandbox if args.worker else None,
            "problems": health.problems,
            "warnings": health.warnings,
        }
        _print_json(report)
        return EXIT_FAIL if health.problems else EXIT_OK
    for warning in health.warnings:
        print(f"forkq check: warning: {warning}", file=sys.stderr)
    if args.worker:
        print(f"sandbox: {sandbox}")
    for problem in health.problems:
        print(f"forkq check: {problem}", file=sys.stderr)
    if not health.problems:
        worker = f", worker heartbeat {settings.heartbeat_file}" if args.worker else ""
        print(f"forkq check: ok (redis {redact_url(settings.redis_url)}, queue {settings.queue!r}{worker})")
    return EXIT_FAIL if health.problems else EXIT_OK


def _sandbox_status(mode: str, problems: list[str]) -> str:
    """This host's sandbox, as `forkq check --worker` shows it; a problem is added when it is on and unusable."""
    from workers.workspace.sandbox import probe, sandbox_problems

    problems += sandbox_problems(mode)
    if mode == "off":
        return "off (FORKQ_SANDBOX=off: snapshot forks' commands run unconfined); " + probe().line()
    return probe().line()


def cmd_sweep(args: argparse.Namespace) -> int:
    """Revive forks whose worker is gone or whose lease expired: one lease pass with --once, else every FORKQ_SWEEP_S
    (and a look at the workers' connections every FORKQ_PRESENCE_CHECK_S) until stopped."""
    require_extra("worker", "forkq sweep")
    from workers.app import make_app, runtime_of, serve_runtime_metrics
    from workers.service.tasks import make_sweeper

    settings = _settings()
    app = make_app(settings)
    runtime = runtime_of(app)
    sweeper = make_sweeper(app, runtime)
    if args.once:
        outcomes = sweeper.sweep_once()
        if args.json:
            _print_json({"outcomes": dict(sorted(outcomes.items()))})
        else:
            print("forkq sweep: " + (", ".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "nothing expired"))
        return EXIT_OK
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = None if settings.metrics_port is None else serve_runtime_metrics(runtime, settings.metrics_port)
    where = redact_url(settings.redis_url)
    if args.json:  # JSON lines: the start, then each pass that found an expired lease
        started = {"event": "started", "every_s": settings.sweep_s, "redis": where, "queue": settings.queue}
        started["connections_every_s"] = settings.presence_check_s
        print(json.dumps(started), flush=True)
    else:
        looks = f", workers' connections every {settings.presence_check_s} s" if settings.presence_check_s else ""
        print(f"forkq sweep: every {settings.sweep_s} s{looks} on {where}; Ctrl-C stops", flush=True)
    try:
        sweeper.run(stop, on_pass=_print_pass if args.json else None)
    finally:
        if server is not None:
            server.close()
    return EXIT_OK


def _print_pass(outcomes: Counter[str]) -> None:
    if outcomes:
        print(json.dumps({"event": "pass", "outcomes": dict(sorted(outcomes.items()))}), flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the HTTP API (docs/api.md) until stopped; refuses to start without tokens (see workers/api/server.py)."""
    require_extra("serve", "forkq serve")
    from workers.api.server import run_server  # FastAPI and uvicorn: only for this command

    return run_server(
        _settings(), host=args.host, port=args.port, insecure_no_auth=args.insecure_no_auth, log_level=args.log_level
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the newcomer's demo (see workers/demo/run.py)."""
    require_extra("demo", "forkq demo")
    from workers.demo.run import run_demo

    code: int = run_demo(private_redis=args.private_redis)
    return code


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "launch": cmd_launch,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "resume": cmd_resume,
    "result": cmd_result,
    "approve": cmd_approve,
    "deny": cmd_approve,
    "events": cmd_events,
    "inspect": cmd_inspect,
    "changes": cmd_changes,
    "apply": cmd_apply,
    "agents": cmd_agents,
    "send": cmd_send,
    "list": cmd_list,
    "budget": cmd_budget,
    "providers": cmd_providers,
    "worker": cmd_worker,
    "check": cmd_check,
    "sweep": cmd_sweep,
    "serve": cmd_serve,
    "demo": cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `forkq` console script."""
    args = build_parser().parse_args(argv)
    try:
        code: int = COMMANDS[args.command](args)
    except (
        InvalidAgentParams,
        InvalidBudget,
        InvalidParentSnapshot,
        InvalidHistory,
        ConfigurationError,
        MessageRefused,
        WorkspaceTooLarge,
        SessionCancelled,
    ) as exc:
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

"""The arguments of the `forkq` command: its parser, and the argument types that refuse bad values at once.

A value argparse refuses (a fork id that is not one, a timeout that is not a finite number of seconds,
a count that is not a positive whole number, text that is not valid Unicode) exits 2 with argparse's
usage line and a message naming the option. Only light modules are imported here, so that
`forkq status` starts fast; `workers.cli` maps each command to its handler.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from workers.base.keys import FORK_ID_RE, SESSION_RE
from workers.base.limits import MAX_TOKENS, shown, text_problem

Parser = argparse.ArgumentParser

RESULT_EPILOG = (
    "exit codes: 0 succeeded; 1 failed or cancelled, no result yet, or --wait timed out; 2 bad input; 3 parked "
    "(awaiting_approval: approve or deny its calls; paused: fix the reason, then forkq resume), said at once "
    "with the pending calls, even with --wait"
)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "FATAL")  # Celery's; it raises on others
WORKER_EPILOG = (
    "exit codes: 0 after a warm shutdown; 1 Redis unreachable or Celery's start-up failed (a supervisor "
    "restarts it); 2 invalid settings, no provider, or a Redis unfit for forkq (fix them first)"
)


def fork_id(text: str) -> str:
    """A fork id as `forkq launch` prints it (it is part of every Redis key)."""
    if not FORK_ID_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{shown(text)} is not a fork id: ids are 1-128 letters, digits, '_', '.', '-', starting with a "
            "letter or digit, as `forkq launch` prints them"
        )
    return text


def session(text: str) -> str:
    """A parent session id (part of the session's Redis keys)."""
    if not SESSION_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{shown(text)} is not a parent session id: 1-200 characters without braces, spaces or control characters"
        )
    return text


def seconds(text: str) -> float:
    """A finite number of seconds, 0 or more (`nan`, `inf` and negative values are refused)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(
            f"{shown(text)} is not a finite number of seconds, 0 or more; give one such as 30 or 0.5"
        )
    return value


def count(text: str) -> int:
    """A positive whole number (digits only, at most 20 of them)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 20 and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a positive whole number; give one such as 8")
    return int(text)


def tokens(text: str) -> int:
    """A whole number of tokens, 0 or more (digits only, at most 16 of them: a budget is at most 10^15)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 16 and int(text) <= MAX_TOKENS):
        raise argparse.ArgumentTypeError(
            f"{shown(text)} is not a whole number of tokens from 0 to 10^15; give one such as 200000"
        )
    return int(text)


def on_off(value: str) -> bool:
    """`true`/`false` (also on/off, yes/no, 1/0), as the launch option `network` is written elsewhere."""
    words = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}
    if value.lower() not in words:
        raise argparse.ArgumentTypeError(f"{shown(value)} is not true or false")
    return words[value.lower()]


def text(value: str) -> str:
    """Text that can be stored as UTF-8 (a byte that is not UTF-8 reaches Python as a lone surrogate)."""
    problem = text_problem(shown(value), value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def package_version() -> str:
    """The installed forkq's version (`forkq --version`, the HTTP API's OpenAPI document)."""
    try:
        return version("forkq")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def build_parser() -> Parser:
    """The argument parser of `forkq`; `args.command` names the command."""
    parser = argparse.ArgumentParser(
        prog="forkq",
        description="Background fork subagents on Celery and Redis.",
        epilog="exit codes: 0 ok, 1 failed, 2 bad input or settings, 3 parked (forkq result)",
    )
    parser.add_argument("--version", action="version", version=f"forkq {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, **extra: Any) -> Parser:
        return sub.add_parser(name, help=help_text, description=help_text, **extra)

    def by_id(name: str, help_text: str, **extra: Any) -> Parser:
        command = add(name, help_text, **extra)
        command.add_argument("fork_id", type=fork_id)
        command.add_argument("--json", action="store_true", help="print JSON")
        return command

    _launch_arguments(add("launch", "Launch a fork or subagent from a parent snapshot."))
    by_id("status", "Show a fork's state.")
    _cancel_command(add)
    by_id("resume", "Queue a paused fork again (once the tools it lacked are installed).")
    result = by_id("result", "Show a fork's final output.", epilog=RESULT_EPILOG)
    result.add_argument("--wait", action="store_true", help="block until the fork ends (or parks)")
    result.add_argument("--timeout", type=seconds, default=None, help="seconds to wait at most (finite, 0 or more)")
    result.add_argument(
        "--notification", action="store_true", help="print the <task-notification> the parent's model reads"
    )
    by_id("approve", "Approve a call a parked fork waits on; it resumes on any worker.").add_argument("call_id")
    deny = by_id("deny", "Deny a call a parked fork waits on; the model reads the denial.")
    deny.add_argument("call_id")
    deny.add_argument("--reason", type=text, help="why (the model reads it)")
    events = by_id("events", "Print a fork's progress events (--json: one JSON object per line).")
    events.add_argument("--follow", action="store_true", help="keep printing until the fork ends")
    by_id("inspect", "Print a fork's bootstrap record and launch options.")
    _workspace_commands(by_id)
    send = add(
        "send",
        "Give a fork a message: continue a succeeded fork, or reach a running or parked one before its next call.",
        epilog="forms: forkq send ID MESSAGE | forkq send ID --file F | forkq send --session S --to NAME MESSAGE",
    )
    send.add_argument("words", nargs="*", metavar="ID MESSAGE", help="the fork id, then the message")
    send.add_argument("--file", help="read the message from this file (UTF-8)")
    send.add_argument("--session", help="the parent session of the teammate named by --to")
    send.add_argument("--to", help="the teammate's name (with --session), instead of a fork id")
    send.add_argument("--json", action="store_true", help="print JSON")
    listing = add("list", "List the forks of a parent session (id, kind, name, description, status, times).")
    listing.add_argument("--session", required=True, help="the parent session id")
    listing.add_argument("--json", action="store_true", help="print JSON")
    _budget_command(add)
    add("agents", "List the subagent definitions (built-ins and FORKQ_AGENTS_DIR).").add_argument(
        "--json", action="store_true", help="print JSON"
    )
    add("providers", "List the subagent providers (spawn, fork) and their capabilities.").add_argument(
        "--json", action="store_true", help="print JSON"
    )
    _process_commands(add)
    return parser


def _cancel_command(add: Callable[..., Parser]) -> None:
    """`forkq cancel ID`, or `forkq cancel --session S`: every fork of a session, and a tombstone against launches."""
    cancel = add(
        "cancel",
        "Cancel a fork; or, with --session, every fork of a parent session and their nested subagents (launches "
        "into it are then refused for FORKQ_SESSION_TOMBSTONE_S).",
        epilog="forms: forkq cancel ID | forkq cancel --session S",
    )
    cancel.add_argument("fork_id", nargs="?", type=fork_id, help="the fork to cancel")
    cancel.add_argument("--session", type=session, help="cancel every fork of this parent session instead")
    cancel.add_argument("--json", action="store_true", help="print JSON")


def _budget_command(add: Callable[..., Parser]) -> None:
    """`forkq budget`: a parent session's token budget, shown or set."""
    budget = add(
        "budget",
        "Show a parent session's token budget (limit, used, left), or set it with --tokens: raised above what its "
        "forks used, every fork it paused resumes.",
    )
    budget.add_argument("--session", required=True, help="the parent session id")
    budget.add_argument("--tokens", type=tokens, help="the budget in tokens (input plus output) shared by the session")
    budget.add_argument("--json", action="store_true", help="print JSON")


def _workspace_commands(by_id: Callable[..., Parser]) -> None:
    """`forkq changes` and `forkq apply`: a snapshot fork's changes, read or applied."""
    changes = by_id("changes", "Print a snapshot fork's changes as a patch `git apply` accepts (binary files too).")
    changes.add_argument("--stat", action="store_true", help="print the changed files and their line counts")
    apply = by_id("apply", "Apply a snapshot fork's changes to the parent's cwd (or --dir), all or nothing.")
    apply.add_argument("--dir", help="the folder to apply them to (default: the parent's cwd at launch)")
    apply.add_argument("--check", action="store_true", help="only check that they apply; write nothing")


def _launch_arguments(launch: Parser) -> None:
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
    # checked with the launch (exit 2, one line naming the field), like ForkClient.launch's own arguments
    launch.add_argument("--max-wall-s", dest="max_wall_s", type=float, help="wall-clock limit in seconds")
    launch.add_argument("--max-turns", dest="max_turns", type=int, help="model calls at most")
    launch.add_argument(
        "--max-tokens",
        dest="max_tokens",
        type=int,
        help="tokens at most (input plus output, cached input as the provider bills it); then the fork pauses",
    )
    launch.add_argument(
        "--seed-mode",
        dest="seed_mode",
        choices=["fork-turns", "completed-turns", "fork_turns", "completed_turns"],
        help="a fork's seed: fork-turns (default: --fork-turns of it) or completed-turns (the completed turns only)",
    )
    launch.add_argument("--persona", help="file whose text replaces the child's system prompt (not fork_turns forks)")
    launch.add_argument(
        "--tool-filter", dest="tool_filter", help="comma list of the tools the child keeps (not fork_turns forks)"
    )
    launch.add_argument("--max-depth", dest="max_depth", type=int, help="deepest nesting below this launch")
    launch.add_argument(
        "--workspace",
        choices=("snapshot", "shared"),
        help="the fork's files: its own copy of the parent's cwd (snapshot, the default: FORKQ_WORKSPACE) or the "
        "cwd in place (shared)",
    )
    launch.add_argument(
        "--no-network", dest="network", action="store_false", help="cut a snapshot fork's tools off the network"
    )
    launch.add_argument(
        "--network", dest="network", type=on_off, help="true (the default) or false: the same as --no-network"
    )
    launch.add_argument("--json", action="store_true", help="print JSON")


def _process_commands(add: Callable[..., Parser]) -> None:
    """The commands about processes rather than one fork: worker, check, sweep, demo."""
    worker = add("worker", "Run a worker (a Celery worker for forkq's queue).", epilog=WORKER_EPILOG)
    worker.add_argument("--concurrency", type=count, help="forks at once (default FORKQ_WORKER_CONCURRENCY)")
    worker.add_argument("--pool", choices=["threads", "prefork", "solo"], help="default FORKQ_WORKER_POOL")
    worker.add_argument("--loglevel", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    worker.add_argument("--hostname", help="Celery node name, e.g. worker1@%%h")
    check = add("check", "Check that Redis is reachable and fit for forkq.")
    check.add_argument(
        "--worker",
        action="store_true",
        help="also check this host's worker heartbeat (FORKQ_HEARTBEAT_FILE): the worker probe",
    )
    check.add_argument("--json", action="store_true", help="print JSON")
    sweep = add("sweep", "Revive forks whose worker died (lease expired).")
    sweep.add_argument("--once", action="store_true", help="one pass, then exit")
    sweep.add_argument(
        "--json", action="store_true", help="print JSON: the pass's outcomes, or one line per event while it runs"
    )
    _serve_command(add)
    demo = add("demo", "Launch forks from an example conversation on private workers (a tour: no --json).")
    demo.add_argument(
        "--private-redis",
        action="store_true",
        help="start a private redis-server even if one listens on 127.0.0.1:6379 (FORKQ_REDIS_URL still wins)",
    )


def _serve_command(add: Callable[..., Parser]) -> None:
    """`forkq serve`: the HTTP API (the "serve" extra)."""

    def port(text: str) -> int:
        if not (text.isascii() and text.isdigit() and 0 < int(text) <= 65535):
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a TCP port; give one from 1 to 65535")
        return int(text)

    serve = add("serve", "Serve the HTTP API: REST under /v1, events as SSE, behind FORKQ_API_TOKENS (docs/api.md).")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8700, help="TCP port (default 8700)")
    serve.add_argument(
        "--insecure-no-auth", action="store_true", help="serve without tokens: only on a loopback --host, for local use"
    )
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])

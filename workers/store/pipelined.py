"""Lua scripts in one pipelined round trip, and *riders*: scripts that go in the round trip of a fork's next write.

`run_scripts` sends EVALSHA straight (a redis-py `Script` in a pipeline asks `SCRIPT EXISTS` first: a second round
trip every time). Only a script Redis lost (a restart, `SCRIPT FLUSH`) is loaded, and only the calls it refused run
again, so none runs twice.

A `Rider` is a script call that needs no round trip of its own: the worker's budget read before a model call rides
on the checkpoint that precedes the call, and the call's budget charge and admission release ride on the journal
append that follows it (`workers.service.runner.FencedChannel`). A rider must be safe to run twice (a write retried
through a Redis outage runs its riders again): a read, or a write keyed so that a repeat changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

log = logging.getLogger("forkq.store")


class ScriptCall(NamedTuple):
    """One script with its keys and arguments."""

    script: Script
    keys: list[str]
    args: list[Any]


def run_scripts(client: redis.Redis, calls: Sequence[ScriptCall], *, raise_on_error: bool = True) -> list[Any]:
    """Run `calls` in one pipelined round trip; their replies in order.

    With `raise_on_error` False, a call Redis refused (a script error, OOM) has its exception as its reply, and
    the others' replies stand; a connection error or timeout always raises.
    """
    pipe = client.pipeline(transaction=False)
    for script, keys, args in calls:
        pipe.evalsha(script.sha, len(keys), *keys, *args)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, redis.ConnectionError | redis.TimeoutError):
            raise reply
    again = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if again:
        for script in {calls[i].script.sha: calls[i].script for i in again}.values():
            script.sha = client.script_load(script.script)
        for i, reply in zip(again, run_scripts(client, [calls[i] for i in again], raise_on_error=False), strict=True):
            replies[i] = reply
    if raise_on_error:
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
    return replies


def _ignore(reply: Any) -> None:
    """A rider whose reply nobody needs."""


def _logged(exc: Exception) -> None:
    log.warning("a script riding on a fork's write did not run: %s", exc)


@dataclass(frozen=True)
class Rider:
    """A script call sent with a fork's next fenced write; its reply (or the error that kept it from running)
    goes to `settle` (or `failed`)."""

    call: ScriptCall
    settle: Callable[[Any], None] = _ignore
    failed: Callable[[Exception], None] = _logged

    def answer(self, reply: Any) -> None:
        """Hand the rider its reply: `settle` it, or `failed` when Redis refused it."""
        if isinstance(reply, Exception):
            self.failed(reply)
        else:
            self.settle(reply)


class Rides(Protocol):
    """Where riders wait for the next write of their fork (`FencedChannel`)."""

    def ride(self, rider: Rider) -> None:
        """Send `rider` with the fork's next write."""
        ...

    def ahead(self, make: Callable[[], Rider | None]) -> None:
        """Before each model call, send `make()`'s rider (if any) with the checkpoint that precedes the call."""
        ...

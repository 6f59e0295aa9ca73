"""Every Redis key forkq uses, and the only place key names are built.

All per-fork keys carry the fork id in a hash tag (`{f-…}`), so one fork's keys share a slot. The
running index is the one key shared by every fork (claim, sweep and release scripts touch it with a
fork's keys), so forkq runs on a single primary (with replicas or Sentinel), not on Redis Cluster.
Chunks are content-addressed and shared by the forks of one parent session, under its hash tag.

Each key: type; content; TTL; writer → readers.

- `{ns}:{<fork_id>}:bootstrap`: string; canonical msgpack `BootstrapRecord`, write-once (SET NX);
  retention; client.launch → worker, inspect.
- `{ns}:{<fork_id>}:state`: hash; `ForkState` (status, attempt, epoch, owner, times incl.
  `first_started_ms`, error, `pending`: JSON of the calls an `awaiting_approval` fork is parked on,
  `waiting`: why a `paused` fork waits, `parked_ms`, `model_wait`: JSON of a running fork's wait for its
  model's admission, cleared when admitted and by the next claim),
  and for the worker's retried writes `released_by` (owner token of the run that last gave the lease
  up: finish, release, park), `emitted` (mark of the running run's last checkpoint) and `retaken`
  (how often a run took back its lease after it lapsed in a Redis outage, never revived);
  retention; launch, worker, cancel, approve/deny → status, wait, worker.
- `{ns}:{<fork_id>}:result`: string; canonical msgpack `ForkResult` (final output, usage); retention;
  worker (once) → result, wait.
- `{ns}:{<fork_id>}:events`: stream; progress events (`type`, `at` ms, `data` JSON), the newest
  ~10,000 (every append trims it: `workers.store.script_parts.EVENTS_MAXLEN`); retention; launch, worker,
  sweeper, cancel, resume, approve/deny → events, wait.
- `{ns}:{<fork_id>}:lease`: string; the owner token of the worker running the fork; PX lease TTL,
  renewed by the worker's heartbeat, deleted by Lua compare-and-set only; worker → worker, sweeper.
- `{ns}:{<fork_id>}:journal`: list; canonical msgpack `JournalEntry` per model response and tool
  call/result, appended only under the current epoch (and, while the fork is parked and has no
  owner, a person's `approval` entries); retention; worker, approve/deny → worker (replay), cancel,
  inspect, transcript: each reads it through the journal's fold (`workers.records.conversation`).
  A `message` entry is a user message `send` gave the fork, moved there from its inbox by the worker.
- `{ns}:{<fork_id>}:inbox`: list; UTF-8 texts of messages `send` gave the fork, oldest first, at most
  `workers.base.limits.MAX_INBOX_MESSAGES`; retention; send → worker (which moves them, under its epoch, into
  the journal before a model call, or when the fork would otherwise end).
- `{ns}:running`: sorted set; fork ids of running forks scored by their lease deadline (Redis ms);
  none; worker (claim, heartbeat, finish) → sweeper. The one key shared by all forks.
- `{ns}:sweep`: hash; `last` (Redis ms of the latest sweeper pass) and `grace_until` (Redis ms until
  which a lapsed lease is left to its worker: set when no pass reached Redis for a while, an outage);
  a day, renewed by every pass; sweeper → sweeper.
- `{ns}:procs`: hash; presence token of a live worker runtime (`host:pid:random`) → the `CLIENT ID`
  of the connection it keeps open (`workers.store.presence`); none; worker (named at start and after
  every reconnect, removed at shutdown) → sweeper (which removes a runtime whose connection is gone).
- `{ns}:dead`: list; JSON `{task_id, reason}` of rejected job messages, newest first, capped at
  1,000; a queue item refused before delivery (not an envelope, compressed, not a forkq job; a
  control message; an `unacked` entry kombu cannot restore) also has `queue`, its first 64 KiB as
  `raw` (UTF-8) or `raw_base64`, `raw_bytes`, `raw_truncated` and `raw_blake2b`; none; worker → operators.
- `{ns}:dead:items` (on the broker's Redis, which may be another server): list; every queue item a
  worker's channel refused, whole (at most the envelope limit, ~11.6 MiB): a line of JSON `{queue,
  reason, task_id, raw_bytes, raw_blake2b, at}`, a newline, then the item's bytes; newest first, capped
  at 16 items (LTRIM), 7 days after the last refusal (EXPIRE); written on the connection the item came
  from, before `{ns}:dead`, so an item is kept even while the records Redis is down; worker → operators.
- `<session>` in the keys below is a parent session's *scope* (`session_scope`): the session id itself for the
  tenant `default` (so records from before tenants keep their keys), else `<session id> @<tenant>`. A session id
  has no whitespace, so no id a caller names reaches another tenant's session: each tenant has its own.
- `{ns}:{parent:<session>}:names`: hash; teammate name → the fork id of the last teammate launched
  with that name from the session (a name belongs to one live teammate at a time); retention, renewed
  by every named launch; launch (compare-and-set) → launch, send_to.
- `{ns}:{parent:<session>}:chunk:<digest>`: string; a chunk named by the BLAKE2b-256 of its bytes:
  canonical msgpack list of wire Contents (a seed chunk), the parent's context (system instruction
  and tool declarations), or a seed index (canonical msgpack list of a seed's chunk digests, in order;
  named by a record's `seed_index` in place of its `seed_chunks` when the seed has 9 chunks or more,
  and shared by the forks of one seed); retention, renewed on reuse; launch → worker, inspect.
- `{ns}:{parent:<session>}:forks`: sorted set; the ids of the forks launched from one parent session,
  scored by launch time (Redis ms), entries older than the retention dropped at each launch; retention,
  renewed by every launch from the session; launch (with the record, atomically) → `forkq serve`'s
  session listing, session cancel.
- `{ns}:{parent:<session>}:cancelled`: string; the tombstone of a cancelled session: the Redis ms until which
  launches into it are refused (`workers.store.sessions`); `FORKQ_SESSION_TOMBSTONE_S`, written again by each
  cancel of the session; session cancel (before it reads the session's forks) → launch, nested launch, teammate
  name claim (each refuses atomically while it exists).
- `{ns}:{parent:<session>}:budget`: hash; the session's token budget: `tokens` (the limit a person set;
  absent: no limit) and `used` (billed tokens of every model response of the session's forks and their nested
  subagents, each charged once: `workers.store.budget`); retention, renewed by every charge and every set;
  set_budget (`forkq budget`, `PUT /v1/sessions/{id}/budget`) and the worker's budget guard (charge) → the
  guard (before each model call), budget readers (`forkq budget`, inspect, the API, the web view).
- `{ns}:{parent:<session>}:budget:charged`: hash; fork id → the last model step (`ModelRequest.step`) whose usage
  was charged to the session: a charge for a step at or below it is a retry or a revival's repeat, and is not
  counted again; retention, renewed with the budget; worker's budget guard → itself.
- `{ns}:{parent:<session>}:budget:paused`: set; ids of the session's forks the session budget paused, emptied (and
  each resumed) by a raise of the budget; retention; worker (with the pause, then a check of the budget) →
  set_budget.
- `{ns}:idempotency:<digest>`: string; JSON `{body, fork_id}`: the SHA-256 of the canonical body of a launch
  sent with an `Idempotency-Key` and the fork it launched, under the SHA-256 of the caller's token and that
  key (so keys of any length or alphabet make a bounded key, and two callers never share one);
  `FORKQ_API_IDEMPOTENCY_TTL_S`; `forkq serve` (SET NX, deleted again if the launch is refused) →
  `forkq serve`.
- `{ns}:{ws:<scope>}:blob:<digest>`: string; a workspace file's bytes (or a symlink's target), named by the
  SHA-256 of those bytes (`workers.workspace.manifest`); retention from the latest launch or step that named it
  (EXPIRE, only ever lengthened); launch, `forkq serve`'s upload, worker (a step's changed files) → worker,
  changes, apply. `<scope>` is the tenant (`default` until tenants exist): a client only ever learns which
  of its own scope's blobs exist.
- `{ns}:{ws:<scope>}:manifest:<digest>`: string; canonical msgpack manifest of a workspace (path, mode, size,
  digest per file), named by its SHA-256 and named in turn by a snapshot fork's bootstrap record; retention as
  blobs; launch, `forkq serve` → worker, changes, apply, inspect.
- `{ns}:{adm:<model>}:…`: model admission (`workers.store.admission`, docs/capacity.md), per model name (one
  with braces, spaces, `|` or over 200 characters goes by `h-` and the BLAKE2b-64 hex of its name); each key
  empties (and so vanishes) once its model's calls are over, but `…:log` and `…:tokens`, which expire a minute
  (and a hold TTL) after the model's last admitted call, and `…:cooldown`, which expires with its latest
  cooldown; worker → worker:
  - `…:holds`: sorted set; one member per admitted call in flight (`<presence token>|<fork id>|<n>`, its waiter
    id), scored by its expiry (Redis ms, the lease TTL ahead), renewed by its process's coordinator every
    heartbeat; removed when the call ends, when it expires (a silent worker), or by the sweeper when the holding
    process's connection is gone (a dead worker).
  - `…:queue`: sorted set; waiting calls (waiter ids) scored by their virtual start tag (fair queuing across
    parent sessions); granted in score order.
  - `…:waiters`: hash; waiter id → JSON `{s: parent session, t: token estimate, e: endpoint}` of a queued call.
  - `…:tags`: hash; parent session → the virtual finish tag of its last queued call; `_v` the virtual clock
    (the start tag of the last grant).
  - `…:log`: sorted set; calls admitted in the last 60 s (waiter ids), scored by admission time (Redis ms): `rpm`
    counts them (kept, with `…:tokens`, only for a model with an `rpm` or `tpm` limit).
  - `…:tokens`: hash; admitted call → its tokens (the estimate, settled to the reported usage), `_sum` the total
    of the calls in `…:log`: `tpm` reads it.
  - `…:cooldown`: hash; provider endpoint (base URL) → Redis ms until which no call to it for this model may go
    out (set from a 429 or 503 with `Retry-After`).
  - `…:granted`: hash; presence token → newline-separated waiter ids of that process granted since its last look.
- `{ns}:admission:alive`: hash; presence token → Redis ms until which its process's waiters count as alive
  (renewed by each of its coordinator's looks), `_pruned` its size after the last pruning; none: lapsed entries
  are pruned each time it doubles (past 256); worker → worker (a waiter of a lapsed process is dropped).
- `{ns}:admission:models`: set; models whose admission keys exist (so the sweeper finds a dead process's holds);
  none: a model with no call in flight or queued is removed when the sweeper frees a dead process's holds (its
  next call adds it again); worker → sweeper.

`retention` is `FORKQ_RECORD_TTL_S`, set at launch and renewed when a fork finishes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Final

from broker_config.settings import DEFAULT_TENANT, TENANT_RE

FORK_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# \x1c-\x1f are whitespace to Python's `\s` but not to other engines' (pydantic-core's, which checks the API's
# path against this pattern): named, so the pattern means the same wherever it is checked
SESSION_RE: Final = re.compile(r"[^{}\s\x1c-\x1f]{1,200}")
TENANT_SEPARATOR: Final = " @"  # between a session id and its tenant in a session's scope (`session_scope`)
HEX_DIGEST_RE: Final = re.compile(r"[0-9a-f]{64}")
MODEL_RE: Final = re.compile(r"[^{}\s|]{1,200}")  # a model name used as it is in admission keys
ADMISSION_PARTS: Final = ("holds", "queue", "waiters", "tags", "log", "tokens", "cooldown", "granted")


@dataclass(frozen=True, slots=True)
class Keys:
    """Key templates under one namespace."""

    namespace: str = "forkq"

    def _fork(self, fork_id: str, suffix: str) -> str:
        if not FORK_ID_RE.fullmatch(fork_id):
            raise ValueError(f"fork id {fork_id!r} is not valid; ids are 1-128 letters, digits, '_', '.', '-'")
        return f"{self.namespace}:{{{fork_id}}}:{suffix}"

    def bootstrap(self, fork_id: str) -> str:
        """The fork's immutable bootstrap record."""
        return self._fork(fork_id, "bootstrap")

    def state(self, fork_id: str) -> str:
        """The fork's state hash."""
        return self._fork(fork_id, "state")

    def result(self, fork_id: str) -> str:
        """The fork's final result."""
        return self._fork(fork_id, "result")

    def events(self, fork_id: str) -> str:
        """The fork's progress event stream."""
        return self._fork(fork_id, "events")

    def lease(self, fork_id: str) -> str:
        """The fork's lease (owner token)."""
        return self._fork(fork_id, "lease")

    def inbox(self, fork_id: str) -> str:
        """Messages sent to the fork, not yet delivered."""
        return self._fork(fork_id, "inbox")

    def journal(self, fork_id: str) -> str:
        """The fork's step journal."""
        return self._fork(fork_id, "journal")

    @property
    def running(self) -> str:
        """Running forks by lease deadline, for the sweeper."""
        return f"{self.namespace}:running"

    @property
    def sweep(self) -> str:
        """The sweepers' clock: their latest pass, and the grace after an outage."""
        return f"{self.namespace}:sweep"

    @property
    def procs(self) -> str:
        """Live worker runtimes: presence token → the id of the Redis connection each keeps open."""
        return f"{self.namespace}:procs"

    @property
    def dead_letters(self) -> str:
        """Rejected job messages, for operators."""
        return f"{self.namespace}:dead"

    @property
    def dead_items(self) -> str:
        """Refused queue items, whole, on the broker's Redis (`workers.broker.connection`)."""
        return f"{self.namespace}:dead:items"

    def session_names(self, parent_session: str) -> str:
        """Teammate names of one parent session → fork ids."""
        return self._session_key(parent_session, "names")

    def chunk(self, parent_session: str, digest_hex: str) -> str:
        """A content-addressed seed chunk shared by the forks of one parent session."""
        return self._session_key(parent_session, f"chunk:{digest_hex}")

    def session_forks(self, parent_session: str) -> str:
        """The forks launched from one parent session, by launch time."""
        return self._session_key(parent_session, "forks")

    def session_cancelled(self, parent_session: str) -> str:
        """The tombstone of a cancelled parent session: launches into it are refused while it exists."""
        return self._session_key(parent_session, "cancelled")

    def session_budget(self, parent_session: str) -> str:
        """The token budget of one parent session: its limit and what its forks used."""
        return self._session_key(parent_session, "budget")

    def session_budget_charged(self, parent_session: str) -> str:
        """Per fork of one parent session, the last model step charged to its budget."""
        return self._session_key(parent_session, "budget:charged")

    def session_budget_paused(self, parent_session: str) -> str:
        """The forks of one parent session that its budget paused."""
        return self._session_key(parent_session, "budget:paused")

    def _session_key(self, parent_session: str, suffix: str) -> str:
        """`suffix` under one parent session's hash tag, so a session's keys share a Redis Cluster slot."""
        _check_session(parent_session)
        return f"{self.namespace}:{{parent:{parent_session}}}:{suffix}"

    def blob(self, scope: str, digest_hex: str) -> str:
        """A workspace file's bytes, by the SHA-256 of those bytes, in one scope (tenant)."""
        _check_scope(scope)
        if not HEX_DIGEST_RE.fullmatch(digest_hex):
            raise ValueError(f"blob digest {digest_hex!r} must be 64 lowercase hex digits (a SHA-256)")
        return f"{self.namespace}:{{ws:{scope}}}:blob:{digest_hex}"

    def manifest(self, scope: str, digest_hex: str) -> str:
        """A workspace manifest, by the SHA-256 of its canonical bytes, in one scope (tenant)."""
        _check_scope(scope)
        if not HEX_DIGEST_RE.fullmatch(digest_hex):
            raise ValueError(f"manifest digest {digest_hex!r} must be 64 lowercase hex digits (a SHA-256)")
        return f"{self.namespace}:{{ws:{scope}}}:manifest:{digest_hex}"

    def idempotency(self, digest_hex: str) -> str:
        """A launch's Idempotency-Key (hashed with the caller's token) → its body's digest and fork id."""
        if not HEX_DIGEST_RE.fullmatch(digest_hex):
            raise ValueError(f"idempotency digest {digest_hex!r} must be 64 lowercase hex digits (a SHA-256)")
        return f"{self.namespace}:idempotency:{digest_hex}"

    def admission(self, model: str) -> tuple[str, ...]:
        """One model's admission keys, in `ADMISSION_PARTS` order."""
        tag = model if MODEL_RE.fullmatch(model) else "h-" + hashlib.blake2b(model.encode(), digest_size=8).hexdigest()
        return tuple(f"{self.namespace}:{{adm:{tag}}}:{part}" for part in ADMISSION_PARTS)

    @property
    def admission_alive(self) -> str:
        """Worker processes with waiting calls → until when they count as alive."""
        return f"{self.namespace}:admission:alive"

    @property
    def admission_models(self) -> str:
        """Models whose admission keys exist."""
        return f"{self.namespace}:admission:models"


def _check_scope(scope: str) -> None:
    if not FORK_ID_RE.fullmatch(scope):
        raise ValueError(f"workspace scope {scope!r} is not valid; scopes are 1-128 letters, digits, '_', '.', '-'")


def session_scope(session: str, tenant: str) -> str:
    """Where `tenant`'s parent session `session` lives (its keys, its records' `parent_session`): the id itself for
    the tenant `default`, else the id and the tenant, which no session id can spell (ids have no whitespace)."""
    return session if tenant == DEFAULT_TENANT else f"{session}{TENANT_SEPARATOR}{tenant}"


def session_named(scope: str) -> str:
    """The session id a caller named, from its scope (`session_scope`)."""
    return scope.split(TENANT_SEPARATOR, 1)[0]


def _check_session(parent_session: str) -> None:
    session, _, tenant = parent_session.partition(TENANT_SEPARATOR)
    if not SESSION_RE.fullmatch(session) or (tenant and not TENANT_RE.fullmatch(tenant)):
        raise ValueError(f"parent session id {parent_session!r} must be 1-200 characters without braces or spaces")

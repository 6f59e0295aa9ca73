"""Redis access for workspaces: content-addressed blobs and manifests, per scope (tenant).

Every blob is stored once per digest (`SET NX`), so siblings and later launches of one tree store nothing
twice. The question (`missing`) runs as one Lua script per batch of keys (TTL, then EXPIRE for a key whose TTL
is shorter), and the store (`put`) as one SET NX EX per blob. A launch stores the files its snapshot reads
through a `BlobStream`: a thread that sends each blob's SET NX EX as soon as it is hashed (small ones without
asking first) and reads the answers one send behind. A manifest is written only after every blob it
names: a manifest that exists therefore means its blobs exist, which lets a launch of an unchanged tree
skip asking about each of them. Blobs and manifests expire with the forks' records: they live
`FORKQ_RECORD_TTL_S` plus `TTL_SLACK_S`, a TTL is only ever lengthened (what EXPIRE GT does, written out in
Lua for Redis 6.2), and a launch whose manifest has less than the retention plus `RENEW_BELOW_S` left
renews the manifest and every blob it names. So the files of a fork outlive its records by up to an hour
(a fork whose runs outlast that slack, continuation included, gets its records renewed, not its files).

Reads verify every blob against its digest: a damaged or substituted value is an error, never a file.
`put` verifies what it stores too, unless its caller has just checked the bytes against their digest itself
(`verified=True`: a snapshot that hashed them, or the API after its own check of an upload).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import redis

from workers.base.keys import Keys
from workers.errors import RecordIntegrityError, WorkspaceError
from workers.workspace.manifest import Manifest, blob_digest

DEFAULT_SCOPE: Final = "default"
SEND_UNASKED: Final = 32 * 1024  # a blob a launch just read, up to this size, is sent without asking first
JOIN_BELOW: Final = 64 * 1024  # a smaller blob is copied beside its command into one send; a larger one is not
BATCH_BYTES: Final = 8 * 1024 * 1024  # bytes one pipeline carries: bounded memory, few round trips
BATCH_KEYS: Final = 1000  # keys one EXISTS/MGET pipeline asks about
TTL_SLACK_S: Final = 2 * 3600  # blobs outlive the records of the forks launched with them by this much
# a launch renews its manifest's blobs once the manifest has less than retention + this left: launches within
# the hour ask nothing of the tree's blobs, and blobs still outlive every record by at least an hour
RENEW_BELOW_S: Final = 3600
# KEYS: blob keys; ARGV[1]: the TTL. Renews each present key's TTL (never shortens it), and answers the 1-based
# positions of the absent ones. Not EXPIRE GT: Redis 6.2 (the server `forkq demo` falls back to) lacks it.
MISSING_LUA: Final = """
local ttl, absent = tonumber(ARGV[1]), {}
for i, key in ipairs(KEYS) do
  local left = redis.call('TTL', key)
  if left == -2 then
    absent[#absent + 1] = i
  elseif left >= 0 and left < ttl then
    redis.call('EXPIRE', key, ttl)
  end
end
return absent
"""


@dataclass(frozen=True, slots=True)
class BlobStore:
    """Blobs and manifests of one scope (tenant) in Redis."""

    client: redis.Redis
    keys: Keys
    ttl_s: int
    scope: str = DEFAULT_SCOPE

    @property
    def blob_ttl_s(self) -> int:
        """The TTL a blob or manifest gets: the records' retention plus the slack."""
        return self.ttl_s + TTL_SLACK_S

    def _blob(self, digest: str) -> str:
        return self.keys.blob(self.scope, digest)

    def missing(self, digests: Iterable[str]) -> list[str]:
        """The digests of `digests` this scope does not hold (in the order given, each once); the others'
        TTLs are renewed (never shortened), so they outlive the launch that asked. One script per batch."""
        wanted = list(dict.fromkeys(digests))
        script = self.client.register_script(MISSING_LUA)  # its SHA-1, computed here; EVALSHA
        absent: list[str] = []
        for batch in _batches(wanted, BATCH_KEYS):
            positions = script(keys=[self._blob(d) for d in batch], args=[self.blob_ttl_s])
            absent += [batch[int(i) - 1] for i in positions]
        return absent

    def put(self, blobs: Mapping[str, bytes], *, verified: bool = False) -> None:
        """Store blobs by digest; existing ones are kept and renewed. Each is checked against its bytes unless
        `verified`: the caller has just checked them itself (never pass it for bytes from elsewhere).

        Raises:
            WorkspaceError: a blob's bytes do not have its digest.
        """
        if not verified:
            for digest, data in blobs.items():
                if blob_digest(data) != digest:
                    raise WorkspaceError(
                        f"blob {digest}: its bytes have digest {blob_digest(data)}; nothing was stored"
                    )
        # SET NX EX per blob, then a renewal for the ones that existed (rare: `missing` was asked just before). One
        # command a blob: a script would copy each blob twice more in Redis (its arguments, then the value)
        pipe, keys, carried = self.client.pipeline(transaction=False), [], 0
        for digest, data in blobs.items():
            keys.append(self._blob(digest))
            pipe.set(keys[-1], data, nx=True, ex=self.blob_ttl_s)
            carried += len(data)
            if carried >= BATCH_BYTES:
                self._renew_existing(keys, pipe.execute())
                pipe, keys, carried = self.client.pipeline(transaction=False), [], 0
        self._renew_existing(keys, pipe.execute())

    def _renew_existing(self, keys: list[str], stored: list[object]) -> None:
        """Renew the keys of `keys` whose SET NX answered None: they existed."""
        existed = [key for key, done in zip(keys, stored, strict=True) if not done]
        self.renew(existed)

    def renew(self, keys: list[str]) -> None:
        """Move the TTL of each of `keys` that exists out to the blobs' TTL (never in); one script per batch."""
        script = self.client.register_script(MISSING_LUA)  # its SHA-1, computed here; EVALSHA
        for batch in _batches(keys, BATCH_KEYS):
            script(keys=batch, args=[self.blob_ttl_s])

    def get(self, digests: Iterable[str]) -> Iterator[tuple[str, bytes]]:
        """`(digest, bytes)` of each digest, verified, in batches: while the caller handles one batch (a build writes
        its files), a thread fetches and verifies the next.

        Raises:
            WorkspaceError: a blob is gone (expired with its forks' records).
            RecordIntegrityError: a stored blob's bytes do not have its digest.
        """
        batches = list(_batches(list(dict.fromkeys(digests)), BATCH_KEYS))
        if len(batches) < 2:
            for batch in batches:
                yield from self._fetch(batch)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="forkq-blob-fetch") as pool:
            ahead = pool.submit(self._fetch, batches[0])
            for following in [*batches[1:], None]:
                fetched = ahead.result()
                if following is not None:
                    ahead = pool.submit(self._fetch, following)
                yield from fetched

    def _fetch(self, batch: Sequence[str]) -> list[tuple[str, bytes]]:
        """One MGET of `batch`, each blob verified."""
        values = self.client.mget([self._blob(d) for d in batch])
        found: list[tuple[str, bytes]] = []
        for digest, data in zip(batch, values, strict=True):
            if not isinstance(data, bytes):
                raise WorkspaceError(
                    f"workspace blob {digest} is not in Redis (scope {self.scope!r}): it expired with its "
                    "forks' records, or was never uploaded; launch the fork again"
                )
            if blob_digest(data) != digest:
                raise RecordIntegrityError(
                    f"workspace blob {digest}: the stored bytes have digest {blob_digest(data)}; the blob was "
                    "modified in Redis",
                    key=self._blob(digest),
                )
            found.append((digest, data))
        return found

    def put_manifest(self, manifest: Manifest, encoded: bytes | None = None) -> str:
        """Store a manifest whose blobs are all stored (`encoded`: its bytes, when the caller has them); its digest.
        A stored manifest with less than the retention plus `RENEW_BELOW_S` left renews its blobs' TTLs, then its
        own (one pass over them)."""
        data = manifest.encode() if encoded is None else encoded
        digest = blob_digest(data)
        key = self.keys.manifest(self.scope, digest)
        if self.client.set(key, data, nx=True, ex=self.blob_ttl_s):
            return digest
        left = self.client.ttl(key)
        if isinstance(left, int) and left < self.ttl_s + RENEW_BELOW_S:
            if self.missing(manifest.digests()):  # renews every blob it names; one gone (flushed): store again
                raise WorkspaceError(f"workspace manifest {digest}: some of its blobs are gone; upload them again")
            self.renew([key])
        return digest

    def manifest_fresh(self, digest: str) -> bool:
        """Whether this scope holds the manifest `digest` with more than the retention plus `RENEW_BELOW_S` left:
        stored, with its blobs, and not due for the renewal `put_manifest` makes (one command)."""
        left = self.client.ttl(self.keys.manifest(self.scope, digest))
        return isinstance(left, int) and left >= self.ttl_s + RENEW_BELOW_S

    def has_manifest(self, digest: str) -> bool:
        """Whether this scope holds the manifest `digest` (and so every blob it names)."""
        return bool(self.client.exists(self.keys.manifest(self.scope, digest)))

    def get_manifest(self, digest: str) -> Manifest:
        """The manifest `digest`, verified.

        Raises:
            WorkspaceError: it is not stored in this scope.
            RecordIntegrityError: the stored bytes do not have its digest.
        """
        key = self.keys.manifest(self.scope, digest)
        data = self.client.get(key)
        if not isinstance(data, bytes):
            raise WorkspaceError(
                f"workspace manifest {digest} is not in Redis (scope {self.scope!r}): it expired with its forks' "
                "records, or was never uploaded"
            )
        if blob_digest(data) != digest:
            raise RecordIntegrityError(f"workspace manifest {digest}: the stored bytes were modified", key=key)
        return Manifest.decode(data, what=f"workspace manifest {digest}")


class BlobStream:
    """Blobs a launch has just read and checked against their digests, stored in Redis by a thread of the stream's
    own while the snapshot reads on; `close` waits for it (and raises what it raised).

    The thread takes whatever blobs are waiting, asks about the ones over `SEND_UNASKED` bytes (`missing`, one
    script, on a pooled connection: sending them would cost more than the question) and sends the absent ones and
    every smaller one (asking would cost about what sending does), each as one `SET NX EX` packed here (redis-py's
    packing costs more than hashing a small file), on a connection of its own, large bytes not copied. It reads the
    answers one send behind (after a send, those of the send before it, which Redis has most likely handled), so
    it never waits for Redis to catch up but at the end. A blob that existed (SET NX answered nil) has its TTL
    renewed then. Use it as a context manager: on an error the thread stops and its connection is
    dropped, answers unread.
    """

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self.stored: set[str] = set()  # digests sent, or found stored (and renewed) by `missing`
        self.sent_bytes = 0  # bytes of the blobs sent
        self._waiting: queue.SimpleQueue[list[tuple[str, bytes]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = False  # set on an error of the caller's: send nothing more
        self._error: BaseException | None = None
        self._own: redis.Redis | None = None  # the thread's connection, taken on its first send
        self._unread: list[str] = []  # keys of the SETs whose answers are unread, in order
        ttl = b"%d" % store.blob_ttl_s
        self._tail = b"\r\n$2\r\nNX\r\n$2\r\nEX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl)

    def add(self, blobs: Sequence[tuple[str, bytes]]) -> None:
        """Hand `blobs` (digest, bytes checked against it) to the thread."""
        if blobs:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="forkq-blob-stream", daemon=True)
                self._thread.start()
            self._waiting.put(list(blobs))

    def close(self) -> None:
        """Wait until every blob handed over is stored and every answer read.

        Raises:
            redis.RedisError: the thread's, if it failed (its connection is then dropped).
        """
        self._finish()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._stop = True
            self._finish()

    def _finish(self) -> None:
        if self._thread is not None:
            self._waiting.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        try:
            done = False
            while not done:
                blobs: list[tuple[str, bytes]] = []
                for batch in [self._waiting.get(), *_drain(self._waiting)]:  # what waits goes in one send
                    done = done or batch is None
                    blobs += batch or []
                if self._stop:
                    break
                self._send(blobs)
            if not self._stop:
                self._read_answers()
        except BaseException as exc:
            self._error = exc
        finally:
            if self._own is not None:
                if self._error is not None or self._stop:
                    self._own.connection.disconnect()  # type: ignore[union-attr]  # answers unread
                self._own.close()

    def _send(self, blobs: list[tuple[str, bytes]]) -> None:
        """Send a SET NX EX for each blob not sent yet, the large ones only if Redis lacks them."""
        large = [d for d, data in blobs if len(data) > SEND_UNASKED and d not in self.stored]
        absent = set(self.store.missing(large)) if large else set()
        self.stored.update(large)
        parts: list[bytes | bytearray] = []
        joined = bytearray()
        earlier = len(self._unread)  # answers of the sends before this one
        for digest, data in blobs:
            if len(data) > SEND_UNASKED:
                if digest not in absent:
                    continue
                absent.discard(digest)
            elif digest in self.stored:
                continue
            self.stored.add(digest)
            key = self.store._blob(digest).encode()
            joined += b"*6\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, len(data))
            if len(data) < JOIN_BELOW:
                joined += data
            else:
                parts += [joined, data]  # the large bytes are sent as they are, not copied
                joined = bytearray()
            joined += self._tail
            self._unread.append(key.decode())
            self.sent_bytes += len(data)
        if joined:
            parts.append(joined)
        if parts:
            self._connection().send_packed_command(parts, check_health=False)  # type: ignore[no-untyped-call]
        self._read_answers(earlier)

    def _connection(self) -> redis.connection.Connection:
        if self._own is None:
            self._own = redis.Redis(connection_pool=self.store.client.connection_pool, single_connection_client=True)
        connection = self._own.connection
        assert connection is not None  # a single-connection client holds one until closed
        return connection

    def _read_answers(self, count: int | None = None) -> None:
        """Read the first `count` unread answers (all when None); renew the keys that existed (on a pooled
        connection: this one may have answers still unread)."""
        count = len(self._unread) if count is None else count
        if not count:
            return
        connection = self._connection()
        existed = [key for key in self._unread[:count] if connection.read_response() is None]
        del self._unread[:count]
        self.store.renew(existed)


def _drain(waiting: queue.SimpleQueue[list[tuple[str, bytes]] | None]) -> Iterator[list[tuple[str, bytes]] | None]:
    """What `waiting` holds now, without waiting."""
    while True:
        try:
            yield waiting.get_nowait()
        except queue.Empty:
            return


def _batches(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]

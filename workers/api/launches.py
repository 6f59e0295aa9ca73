"""Launches over HTTP: through `ForkClient.launch_checked` (the request's models were checked as a launch from
Python checks them; the same plan and history selection), once per `Idempotency-Key`.

The key (scoped by the caller's token) is claimed in Redis before the launch with the digest of the
request's canonical body and the fork id the launch will use: the same key with the same body gets that
fork again; with another body, 409. Several servers receiving the same key at once launch one fork.
A refused launch gives its claim up, so nothing of it stays in Redis.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Final

from broker_config.settings import DEFAULT_TENANT
from workers.api.idempotency import Claim, IdempotencyKeys
from workers.api.models import LaunchOptions, LaunchRequest
from workers.api.workspaces import Workspaces, workspace_scope
from workers.client import ForkClient, new_fork_id
from workers.errors import ForkNotFound, IdempotencyConflict, InvalidAgentParams
from workers.records.fork import Status

IN_FLIGHT_WAIT_S: Final = 10.0  # how long a repeat waits for the first launch with its key to write its fork
IN_FLIGHT_POLL_S: Final = 0.05


@dataclass(frozen=True, slots=True)
class Outcome:
    """A launch's answer: the fork, its status, and whether this request launched it (or repeated a key's)."""

    fork_id: str
    status: Status
    created: bool


def key_digest(token_id: str, key: str) -> str:
    """SHA-256 of the caller's token id and the Idempotency-Key: a bounded Redis key, one per caller."""
    return hashlib.sha256(f"{token_id}\n{key}".encode()).hexdigest()


class Launcher:
    """Launches forks for the API: `ForkClient.launch` with the request's options, optionally once per key."""

    def __init__(self, client: ForkClient, keys: IdempotencyKeys, workspaces: Workspaces) -> None:
        self.client = client
        self.keys = keys
        self.workspaces = workspaces

    def launch(
        self, body: LaunchRequest, *, key: str | None = None, token_id: str = "", tenant: str = DEFAULT_TENANT
    ) -> Outcome:
        """Launch the fork the request describes, for `tenant`, or, for a key seen before with the same body, find it.

        Raises:
            InvalidAgentParams, InvalidParentSnapshot: as `ForkClient.launch` (nothing is written).
            WorkspaceError: the workspace options do not fit, or name a manifest the caller's scope does not hold.
            IdempotencyConflict: the key was used with another body, or its first launch is still under way.
        """
        if tenant != DEFAULT_TENANT and body.options.fork_id is not None:
            # fork ids are global: a chosen one could collide with another tenant's fork, and tell that it exists
            raise InvalidAgentParams(
                "options.fork_id cannot be chosen with a tenant's token (fork ids are shared by every tenant); "
                "leave it out, and send an Idempotency-Key header to make the launch safe to retry",
                field="fork_id",
            )
        scope = workspace_scope(token_id)
        if key is None:
            return self._launch(body, body.options, scope, tenant)
        digest = key_digest(token_id, key)
        claim = Claim(body=body.digest, fork_id=body.options.fork_id or new_fork_id())
        deadline = time.monotonic() + IN_FLIGHT_WAIT_S
        while time.monotonic() < deadline:
            held = self.keys.claim(digest, claim)
            if held is None:  # ours: launch, and give the key up if the launch is refused
                try:
                    chosen = body.options.model_copy(update={"fork_id": claim.fork_id})
                    return self._launch(body, chosen, scope, tenant)
                except BaseException:
                    self.keys.release(digest, claim)
                    raise
            if held.body != claim.body:
                raise IdempotencyConflict(
                    f"Idempotency-Key {key!r} was used for another launch (fork {held.fork_id}) with a different "
                    "body; send that body again, or use a new key for a new launch",
                    fork_id=held.fork_id,
                    field="Idempotency-Key",
                )
            try:
                return Outcome(held.fork_id, self.client.status(held.fork_id).status, created=False)
            except ForkNotFound:  # its launch is under way, or was refused and gives the key up
                time.sleep(IN_FLIGHT_POLL_S)
        raise IdempotencyConflict(
            f"Idempotency-Key {key!r}: the first launch with it is still under way; try again in a moment",
            field="Idempotency-Key",
        )

    def _launch(self, body: LaunchRequest, options: LaunchOptions, scope: str, tenant: str) -> Outcome:
        ws = self.workspaces.for_launch(scope, options.workspace, options.workspace_manifest, options.network)
        # the snapshot came with this request alone: nothing of it is kept for sibling launches
        chosen = options.model_copy(
            update={"workspace": ws.workspace, "workspace_manifest": ws.manifest, "network": ws.network}
        )
        # read_files=False: a request names a path of the parent's machine, never one of this server to read
        launch = self.client.launch_checked
        handle = launch(body.parent, body.agent, chosen, keep=False, read_files=False, tenant=tenant)
        return Outcome(handle.fork_id, self.client.status(handle.fork_id).status, created=True)

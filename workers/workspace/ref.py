"""What a bootstrap record says of a fork's files: `snapshot` (its own copy, named by manifest) or `shared`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from workers.base.keys import HEX_DIGEST_RE


class WorkspaceMode(StrEnum):
    """Where a fork's tools act: a snapshot of the parent's tree, or the parent's tree in place."""

    SNAPSHOT = "snapshot"  # the fork's own copy, built on whichever worker runs it; changes come back as a patch
    SHARED = "shared"  # the parent's `cwd` in place: every worker must see that path


class WorkspaceRef(BaseModel):
    """A fork's workspace as its bootstrap record holds it (part of its immutable inputs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # records are validated strictly: the stored word is made its enum first
    mode: Annotated[WorkspaceMode, BeforeValidator(WorkspaceMode)]
    # snapshot: the digest of the base manifest (its blobs are in `scope`); None for an empty workspace
    manifest: str | None = Field(None, pattern=HEX_DIGEST_RE.pattern)
    scope: str = "default"  # whose blobs: the tenant's
    root: str = "."  # the parent's cwd: the path the fork's history names its files by
    network: bool = True  # `network: false` cuts a snapshot fork's tools off the network
    git: bool = False  # the base came from a git work tree: the workspace gets a repository of it

    @property
    def snapshot(self) -> bool:
        """Whether the fork has its own copy of the files."""
        return self.mode is WorkspaceMode.SNAPSHOT

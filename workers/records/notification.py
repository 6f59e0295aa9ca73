"""What the parent's model reads when a fork ends: a `<task-notification>` with XML-escaped fields.

Only the final output reaches the parent, with status and usage; never the fork's intermediate work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from workers.records.fork import ForkResult, Status

NO_OUTPUT: Final = "(subagent produced no model-visible output)"
_STATUS: Final = {Status.SUCCEEDED: "completed", Status.FAILED: "failed", Status.CANCELLED: "cancelled"}


def escape(text: str) -> str:
    """`&`, `<` and `>` as XML entities (what xml.sax.saxutils.escape does, without loading the XML package)."""
    return text.replace("&", "&amp;").replace(">", "&gt;").replace("<", "&lt;")


MAX_LISTED_FILES = 50  # changed files a notification names; the rest are counted


def render_task_notification(result: ForkResult, *, description: str, changed_files: Sequence[str] = ()) -> str:
    """The notification message for an ended fork (every field XML-escaped).

    A snapshot fork that changed files lists them (`changed_files`), so the parent's model knows there is a
    patch to review (`forkq changes ID`) and apply (`forkq apply ID`); its own tree was not touched.
    """
    status = _STATUS.get(result.status, result.status.value)
    usage = result.usage
    summary = f'Agent "{description}" {status}'  # not nested in the f-string below: Python 3.11 refuses that
    lines = [
        "<task-notification>",
        f"<task-id>{escape(result.fork_id)}</task-id>",
        f"<status>{status}</status>",
        f"<summary>{escape(summary)}</summary>",
    ]
    if result.status is Status.SUCCEEDED:
        output = result.output if result.output and result.output.strip() else NO_OUTPUT
        lines.append(f"<result>{escape(output)}</result>")
    else:
        lines.append(f"<error>{escape(result.error or 'no reason given')}</error>")
    # cached tokens only when the provider reported some: 0 would also read "none were reported"
    cached = (
        f"<cached_input_tokens>{usage.cached_input_tokens}</cached_input_tokens>" if usage.cached_input_tokens else ""
    )
    if changed_files:
        lines.append(_changed(result.fork_id, changed_files))
    lines += [
        "<usage>"
        f"<total_tokens>{usage.total_tokens}</total_tokens>"
        f"{cached}"
        f"<tool_uses>{usage.tool_uses}</tool_uses>"
        f"<duration_ms>{usage.duration_ms}</duration_ms>"
        "</usage>",
        "</task-notification>",
    ]
    return "\n".join(lines)


def _changed(fork_id: str, paths: Sequence[str]) -> str:
    listed = [escape(p) for p in paths[:MAX_LISTED_FILES]]
    if len(paths) > MAX_LISTED_FILES:
        listed.append(f"(and {len(paths) - MAX_LISTED_FILES} more)")
    hint = escape(
        f"not applied to your files: review with `forkq changes {fork_id}`, apply with `forkq apply {fork_id}`"
    )
    return f'<changed-files count="{len(paths)}" note="{hint}">\n' + "\n".join(listed) + "\n</changed-files>"

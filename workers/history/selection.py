"""What a fork inherits: history selection, curation and the fork's seed (docs/fork-history.md).

Pure functions over `list[Content]`: no Redis, no Celery, no I/O. The pipeline of `build_fork_seed`:

    raw parent history ─ startup prefix / synthetic prefix detection
        ─ curation (merge user Contents, drop invalid model runs)
        ─ window: `all`, or from the N-th most recent real user turn (orphan responses dropped)
        ─ boundary repair (redacted sibling calls, placeholder responses, directive)
        ─ deep copy → ForkSeed(initial_messages, task_prompt)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from workers.history.messages import (
    Content,
    FunctionResponse,
    Part,
    copy_contents,
    dump_contents,
    load_contents,
    parse_content,
)
from workers.history.params import ForkTurns, normalize_fork_turns

__all__ = [
    "FORK_ACK_TEXT",
    "FORK_BEGIN_PROMPT",
    "FORK_INSTRUCTIONS",
    "FORK_PLACEHOLDER_OUTPUT",
    "ForkSeed",
    "as_contents",
    "build_fork_seed",
    "build_fork_seed_wire",
    "curate_history",
    "fork_directive_text",
    "is_real_user_turn",
    "is_system_reminder_content",
    "is_system_reminder_text",
    "repair_fork_end",
    "select_fork_history",
    "select_fork_parts",
    "select_turns",
    "startup_context_length",
]

REMINDER_OPEN: Final = "<system-reminder>"
REMINDER_CLOSE: Final = "</system-reminder>"
LEGACY_STARTUP_ACK: Final = "Got it. Thanks for the context!"
SUMMARY_MARKER: Final = "Resume the prior task"
SUMMARY_ACK: Final = "Got it. Thanks for the additional context!"
ATTACHMENT_PREFIXES: Final = (
    "<plan-mode-active>",
    "<background-tasks>",
    "The following files were recently accessed before context was compacted.",
    "Recently accessed file (full current content embedded):",
    "Recent visual snapshots preserved from before context was compacted",
)

FORK_PLACEHOLDER_OUTPUT: Final = "Fork started — processing in background"
FORK_ACK_TEXT: Final = "Understood. Executing directive now."
FORK_BEGIN_PROMPT: Final = "Begin."
FORK_INSTRUCTIONS: Final = """\
<fork-instructions>
You are a forked worker running in the background, detached from the conversation above. You are
NOT the main agent and nobody will answer questions: the parent agent receives only your final
message, never your intermediate work.
- Scope: do exactly the directive below, nothing more. Do not spawn sub-agents or forks; do the work
  yourself with your tools. Stay inside the working directory.
- Work autonomously: when something is ambiguous, choose the most reasonable reading and say so.
- Verification: check your work (run the relevant tests, linters or commands) before you finish.
- Final message, for the parent: the result first; then the files you changed (paths) or "no files
  changed"; then how you verified it and what you could not verify; then anything left undone.
</fork-instructions>"""


class ForkSeed(BaseModel):
    """What a fork starts from: its initial messages and the prompt of its first turn."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = 1
    initial_messages: list[Content]
    task_prompt: str

    def to_wire(self) -> dict[str, Any]:
        """The seed as plain data (wire Contents), ready for `workers.base.codec.encode`."""
        return {
            "schema_version": self.schema_version,
            "initial_messages": dump_contents(self.initial_messages),
            "task_prompt": self.task_prompt,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ForkSeed:
        """The inverse of `to_wire`."""
        return cls(
            schema_version=data["schema_version"],
            initial_messages=load_contents(data["initial_messages"]),
            task_prompt=data["task_prompt"],
        )


# ── messages ──────────────────────────────────────────────────────────────────────────────────


def fork_directive_text(directive: str) -> str:
    """The text that hands a fork its instructions and its directive."""
    return f"{FORK_INSTRUCTIONS}\n\nDirective:\n{directive}"


def is_system_reminder_text(text: str) -> bool:
    """True when `text` starts with `<system-reminder>` and, trailing whitespace trimmed, closes it."""
    return text.startswith(REMINDER_OPEN) and text.rstrip().endswith(REMINDER_CLOSE)


def _is_reminder_part(part: Part) -> bool:
    return part.text is not None and is_system_reminder_text(part.text)


def is_system_reminder_content(content: Content) -> bool:
    """True for a pure reminder: at least one part, and every part a system-reminder text."""
    return bool(content.parts) and all(_is_reminder_part(p) for p in content.parts)


def _first_text(content: Content) -> str | None:
    return content.parts[0].text if content.parts else None


def _has_call(content: Content) -> bool:
    return any(p.function_call is not None for p in content.parts)


def _is_real_part(part: Part) -> bool:
    if part.function_response is not None:
        return False
    if part.text is None:
        return True  # media and other payloads are real input
    return part.text.strip() != "" and not is_system_reminder_text(part.text)


def is_real_user_turn(content: Content) -> bool:
    """A user Content with a part that is not a tool response, a reminder, or blank text."""
    return content.role == "user" and any(_is_real_part(p) for p in content.parts)


# ── synthetic prefixes ────────────────────────────────────────────────────────────────────────


def _startup_length(history: Sequence[Content]) -> int:
    if history and history[0].role == "user" and is_system_reminder_content(history[0]):
        # a summary wrapped in reminder tags is still a summary: startup detection never takes it
        return 0 if _summary_length(history, 0) else 1
    if (
        len(history) >= 2
        and history[0].role == "user"
        and history[1].role == "model"
        and _first_text(history[1]) == LEGACY_STARTUP_ACK
    ):
        return 2
    return 0


def _is_attachments(content: Content) -> bool:
    return content.role == "user" and any(
        p.text is not None and p.text.startswith(ATTACHMENT_PREFIXES) for p in content.parts
    )


def _summary_length(history: Sequence[Content], start: int) -> int:
    """Length (0, 2, 3 or 4) of a compacted-history summary standing at `start`."""
    if len(history) < start + 2:
        return 0
    head, ack = history[start], history[start + 1]
    head_text = _first_text(head)
    if head.role != "user" or head_text is None or SUMMARY_MARKER not in head_text:
        return 0
    if ack.role != "model" or _first_text(ack) != SUMMARY_ACK:
        return 0
    length = 2
    if len(history) > start + 2 and _is_attachments(history[start + 2]):
        length = 3
        follow = start + 3
        if len(history) > follow and history[follow].role == "model" and _has_call(history[follow]):
            length = 4
    return length


def startup_context_length(history: Sequence[Content], *, include_summary: bool = False) -> int:
    """Length of the synthetic prefix: the startup context, plus the compacted summary if asked.

    Startup alone (0, 1 or 2) never counts a summary; with `include_summary` a summary at index 0
    or right after a one-entry startup reminder is added (not after the legacy pair).
    """
    startup = _startup_length(history)
    if include_summary and startup in (0, 1):
        return startup + _summary_length(history, startup)
    return startup


# ── curation ──────────────────────────────────────────────────────────────────────────────────


def _is_valid_part(part: Part) -> bool:
    text = part.text
    if text is None:
        return _has_payload(part)
    return text != "" or bool(part.thought) or part.thought_signature is not None or part.function_call is not None


def _has_payload(part: Part) -> bool:
    # a part is empty when every key it has is null (null counts as absent)
    return any(v is not None for v in part.__dict__.values()) or any(
        v is not None for v in (part.__pydantic_extra__ or {}).values()
    )


def _is_valid_model_content(content: Content) -> bool:
    parts = content.parts
    return bool(parts) and all(map(_is_valid_part, parts))


def _merge_user(first: Content, second: Content) -> Content:
    return first.model_copy(update={"parts": [*first.parts, *second.parts]})


def curate_history(history: Sequence[Content]) -> list[Content]:
    """Merge adjacent user Contents and drop every model run that holds an invalid Content.

    The result shares unchanged Contents with the input; merged ones are new objects.
    """
    out: list[Content] = []
    run_start = -1  # index in `out` where the current model run began; -1 outside a run
    run_valid = True
    for content in history:
        if content.role == "user":
            if run_start >= 0 and not run_valid:
                del out[run_start:]
            run_start, run_valid = -1, True
            if out and out[-1].role == "user":
                out[-1] = _merge_user(out[-1], content)
            else:
                out.append(content)
            continue
        if run_start < 0:
            run_start = len(out)
        run_valid = run_valid and _is_valid_model_content(content)
        out.append(content)
    if run_start >= 0 and not run_valid:
        del out[run_start:]
    return out


# ── selection ─────────────────────────────────────────────────────────────────────────────────


def _drop_orphan_responses(window: list[Content]) -> list[Content]:
    """Drop tool responses in the window's first Content: their calls stand before the window."""
    if not window:
        return window
    first = window[0]
    kept = [p for p in first.parts if p.function_response is None]
    if len(kept) == len(first.parts):
        return window
    return [first.model_copy(update={"parts": kept}), *window[1:]]


def _numeric_window(history: Sequence[Content], turns: int) -> tuple[list[Content], list[Content]]:
    """(startup prefix, window) for `fork_turns=N`, sharing objects with `history`."""
    prefix = list(history[: startup_context_length(history)])
    curated = curate_history(history[startup_context_length(history, include_summary=True) :])
    starts = [i for i, c in enumerate(curated) if is_real_user_turn(c)]
    if not starts:
        return prefix, []
    start = starts[-turns] if len(starts) >= turns else starts[0]
    return prefix, _drop_orphan_responses(curated[start:])


def _select(history: Sequence[Content], fork_turns: object) -> tuple[list[Content], list[Content]]:
    """(kept prefix, body to repair), uncopied, for a `fork_turns` not normalized yet."""
    return select_turns(history, normalize_fork_turns(fork_turns))


def select_turns(history: Sequence[Content], turns: ForkTurns) -> tuple[list[Content], list[Content]]:
    """`select_fork_parts` for Contents and a normalized `fork_turns` (`AgentParams.turns`): the prefix is empty
    for `all`. The Contents are shared with `history`: never change them in place."""
    if turns == "all":
        return [], curate_history(history)
    return _numeric_window(history, turns)


def select_fork_history(history: Sequence[Content | Mapping[str, Any]], fork_turns: object = None) -> list[Content]:
    """The slice of the parent's history a fork inherits, before boundary repair (a deep copy).

    `all` (or None): the curated history. `"N"`: the startup prefix plus the curated window that
    starts at the N-th most recent real user turn, orphan tool responses dropped from its start.

    Raises:
        InvalidAgentParams: `fork_turns` is not `all` or a positive integer string.
    """
    prefix, body = _select(as_contents(history), fork_turns)
    return copy_contents([*prefix, *body])


# ── boundary repair ───────────────────────────────────────────────────────────────────────────


def _redacted_calls(content: Content) -> Content:
    parts = [
        p.model_copy(update={"function_call": p.function_call.model_copy(update={"args": {}})})
        if p.function_call is not None
        else p
        for p in content.parts
    ]
    return content.model_copy(update={"parts": parts})


def _placeholder_answers(content: Content, directive: str) -> Content:
    answers = [
        Part(
            function_response=FunctionResponse(
                id=p.function_call.id, name=p.function_call.name, response={"output": FORK_PLACEHOLDER_OUTPUT}
            )
        )
        for p in content.parts
        if p.function_call is not None
    ]
    return Content(role="user", parts=[*answers, Part(text=fork_directive_text(directive))])


def _is_answered_results(content: Content) -> bool:
    has_response = any(p.function_response is not None for p in content.parts)
    return has_response and all(p.function_response is not None or _is_reminder_part(p) for p in content.parts)


def _repair_end(body: list[Content], directive: str) -> tuple[list[Content], str]:
    """Make the history end where a fork can start; returns (messages, task prompt)."""
    body = list(body)
    while body:
        last = body[-1]
        if last.role == "model":
            if not _has_call(last):
                break
            body[-1:] = [
                _redacted_calls(last),
                _placeholder_answers(last, directive),
                Content(role="model", parts=[Part(text=FORK_ACK_TEXT)]),
            ]
            return body, FORK_BEGIN_PROMPT
        if _is_answered_results(last):
            break
        responses = [p for p in last.parts if p.function_response is not None]
        body[-1:] = [last.model_copy(update={"parts": responses})] if responses else []
    return body, fork_directive_text(directive)


def build_fork_seed(
    parent_history: Sequence[Content | Mapping[str, Any]], *, fork_turns: object = None, directive: str
) -> ForkSeed:
    """Run the whole pipeline (docs/fork-history.md): select, repair the boundary, deep-copy.

    `parent_history` ends with the model Content that holds the launching Agent call(s); wire
    dicts are accepted and parsed. `fork_turns=None` means `all`.

    Raises:
        InvalidAgentParams: `fork_turns` is invalid.
        InvalidHistory: a wire dict in `parent_history` is not a valid Content.
    """
    wire, task_prompt = build_fork_seed_wire(parent_history, fork_turns=fork_turns, directive=directive)
    return ForkSeed.model_construct(schema_version=1, initial_messages=load_contents(wire), task_prompt=task_prompt)


def build_fork_seed_wire(
    parent_history: Sequence[Content | Mapping[str, Any]], *, fork_turns: object = None, directive: str
) -> tuple[list[dict[str, Any]], str]:
    """`build_fork_seed` in wire form: (the seed's messages as fresh wire dicts, task prompt).

    For callers that only store or send the seed (the launching client): it skips building
    Content objects for a copy that would only be dumped again.
    """
    prefix, body = select_fork_parts(parent_history, fork_turns)
    repaired, task_prompt = repair_fork_end(body, directive)
    return dump_contents([*prefix, *repaired]), task_prompt


def select_fork_parts(
    parent_history: Sequence[Content | Mapping[str, Any]], fork_turns: object = None
) -> tuple[list[Content], list[Content]]:
    """The selection step alone: (startup prefix kept as is, body whose end `repair_fork_end` repairs).

    Neither depends on the directive, so a launcher may keep them for sibling forks of one parent.
    The Contents are shared with `parent_history` (or new where curation merged some): never change
    them in place.

    Raises:
        InvalidAgentParams: `fork_turns` is invalid.
    """
    return _select(as_contents(parent_history), fork_turns)


def repair_fork_end(body: list[Content], directive: str) -> tuple[list[Content], str]:
    """The boundary repair: (messages, task prompt); `body`'s Contents before the repaired end are kept as
    the same objects, and only the repaired end (at most the last three messages) depends on `directive`."""
    return _repair_end(body, directive)


def as_contents(history: Iterable[Content | Mapping[str, Any]]) -> list[Content]:
    """Contents as given, wire dicts parsed (`InvalidHistory` names a bad one's index)."""
    return [c if isinstance(c, Content) else parse_content(dict(c), index=i) for i, c in enumerate(history)]

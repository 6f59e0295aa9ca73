"""The completed-turn fork's seed: every turn the parent completed, nothing of its in-flight one.

Pure functions over `list[Content]`, beside `workers.history.selection` (the `fork_turns` seed). A parent
launches a fork in the middle of its own turn: its history ends with the launching Agent call, unanswered.
The seed is the prefix of that history which ends at the last completed turn (docs/fork-history.md, "The
completed-turn fork"):

    raw parent history ─ end: the last model Content without calls that curation keeps, before the turn in
        flight (from the last real user turn on, unless the history ends with a model reply); a prefix that
        is only the startup context holds no turn
        ─ curation of the prefix (as for `all`) ─ unpaired calls and responses dropped
        ─ deep copy → ForkSeed(initial_messages, task_prompt)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from workers.history.messages import (
    Content,
    FunctionCall,
    FunctionResponse,
    copy_contents,
    dump_contents,
    load_contents,
)
from workers.history.selection import (
    ForkSeed,
    as_contents,
    curate_history,
    fork_directive_text,
    is_real_user_turn,
    startup_context_length,
)

__all__ = [
    "build_completed_seed",
    "build_completed_seed_wire",
    "completed_task_prompt",
    "completed_turns_end",
    "select_completed_parts",
    "select_completed_turns",
]


def _has_call(content: Content) -> bool:
    return any(p.function_call is not None for p in content.parts)


# ── the end of the last completed turn ────────────────────────────────────────────────────────


def _in_flight_start(history: Sequence[Content]) -> int:
    """Where the turn in flight starts: its real user turn; the history's length when none is in flight."""
    if history and history[-1].role == "model" and not _has_call(history[-1]):
        return len(history)  # the last turn ended with the model's reply
    real = [i for i, content in enumerate(history) if is_real_user_turn(content)]
    return real[-1] if real else len(history)


def completed_turns_end(history: Sequence[Content]) -> int:
    """The length of the raw prefix of `history` that ends with its last completed turn; 0 when none has.

    The turn in flight starts at the last real user turn, unless the history ends with a model Content
    without calls (that turn ended): then, as without any real user turn, nothing is in flight. The prefix
    ends at the last model Content without function calls before the turn in flight that curation keeps
    (its model run is valid). A prefix made only of the startup context (the legacy pair) holds no
    completed turn; one that ends at a compacted summary's acknowledgement does.
    """
    end = _in_flight_start(history)
    while end > 0:
        if history[end - 1].role == "user":
            end -= 1
            continue
        start = end  # history[start:end] is a whole model run: a user Content or the history's end follows it
        while start > 0 and history[start - 1].role == "model":
            start -= 1
        run = history[start:end]
        if curate_history(run):  # curation keeps the run whole or drops it whole
            ends = [i for i, content in enumerate(run, start) if not _has_call(content)]
            if ends:
                end = ends[-1] + 1
                break
        end = start
    return 0 if end <= startup_context_length(history) else end


# ── balance: every call answered by the next Content, every response answering one ──────────────


def _answers(response: FunctionResponse, call: FunctionCall) -> bool:
    # as the adapters pair them: by id when the response has one, else by name
    if response.id is not None:
        return bool(call.id) and call.id == response.id
    return call.name == response.name


def _pairing(model: Content, answer: Content | None) -> tuple[set[int], set[int]]:
    """(indices of `model`'s call parts, indices of `answer`'s response parts) that pair one to one."""
    if answer is None or answer.role != "user":
        return set(), set()
    waiting: dict[int, FunctionCall] = {}
    ids: set[str] = set()
    for index, part in enumerate(model.parts):
        call = part.function_call
        if call is None or (call.id and call.id in ids):  # a repeated id cannot be told apart: left unpaired
            continue
        waiting[index] = call
        if call.id:
            ids.add(call.id)
    calls: set[int] = set()
    responses: set[int] = set()
    for index, part in enumerate(answer.parts):
        response = part.function_response
        match = None if response is None else next((i for i, c in waiting.items() if _answers(response, c)), None)
        if match is not None:
            del waiting[match]
            calls.add(match)
            responses.add(index)
    return calls, responses


def _without(content: Content, dropped: list[int]) -> list[Content]:
    """`content` without the parts at `dropped`: itself when none are, nothing when no part is left."""
    if not dropped:
        return [content]
    parts = [p for i, p in enumerate(content.parts) if i not in dropped]
    return [content.model_copy(update={"parts": parts})] if parts else []


def _balanced(contents: Sequence[Content]) -> list[Content]:
    """Drop every call the next Content does not answer and every response that answers no call before it.

    A Content left without parts is dropped, and the user Contents that then meet are merged (curation).
    """
    kept: list[Content] = []
    answered: set[int] = set()  # the response parts of the current user Content that answer the call before it
    for index, content in enumerate(contents):
        if content.role == "model":
            after = contents[index + 1] if index + 1 < len(contents) else None
            calls, answered = _pairing(content, after)
            dropped = [i for i, p in enumerate(content.parts) if p.function_call is not None and i not in calls]
        else:
            dropped = [i for i, p in enumerate(content.parts) if p.function_response is not None and i not in answered]
            answered = set()
        kept.extend(_without(content, dropped))
    return curate_history(kept) if len(kept) < len(contents) else kept


# ── selection and seed ────────────────────────────────────────────────────────────────────────


def select_completed_parts(parent_history: Sequence[Content | Mapping[str, Any]]) -> list[Content]:
    """The completed-turn seed's messages, uncopied: shared with `parent_history` (or new where curation
    merged or balancing trimmed some); never change them in place.

    Raises:
        InvalidHistory: a wire dict in `parent_history` is not a valid Content.
    """
    history = as_contents(parent_history)
    end = completed_turns_end(history)
    return _balanced(curate_history(history[:end])) if end else []


def select_completed_turns(parent_history: Sequence[Content | Mapping[str, Any]]) -> list[Content]:
    """The completed turns of the parent's history, curated and balanced, as a deep copy (empty: none completed).

    Raises:
        InvalidHistory: a wire dict in `parent_history` is not a valid Content.
    """
    return copy_contents(select_completed_parts(parent_history))


def completed_task_prompt(messages: Sequence[object], directive: str) -> str:
    """The completed-turn fork's task prompt: the directive alone for an empty seed, else with the fork instructions."""
    return fork_directive_text(directive) if messages else directive


def build_completed_seed(parent_history: Sequence[Content | Mapping[str, Any]], *, directive: str) -> ForkSeed:
    """The completed-turn fork's seed: the parent's completed turns (a deep copy) and the task prompt.

    Raises:
        InvalidHistory: a wire dict in `parent_history` is not a valid Content.
    """
    wire, task_prompt = build_completed_seed_wire(parent_history, directive=directive)
    return ForkSeed.model_construct(schema_version=1, initial_messages=load_contents(wire), task_prompt=task_prompt)


def build_completed_seed_wire(
    parent_history: Sequence[Content | Mapping[str, Any]], *, directive: str
) -> tuple[list[dict[str, Any]], str]:
    """`build_completed_seed` in wire form: (the seed's messages as fresh wire dicts, task prompt)."""
    messages = select_completed_parts(parent_history)
    return dump_contents(messages), completed_task_prompt(messages, directive)

"""Hypothesis strategies for realistic Gemini parent histories (wire dicts), used by the property tests.

A generated history is what a parent agent sends when it launches a fork: an optional startup context
(pure reminder or legacy pair), an optional compacted-history summary, then turns of prompts, model
texts, thoughts and tool calls answered by tool responses, with the noise real histories carry (blank
prompts, mid-history reminders, invalid model Contents, media, unknown keys), ending with the model
Content that launches the fork(s), or sometimes with something else.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

LEGACY_STARTUP_ACK = "Got it. Thanks for the context!"
SUMMARY_ACK = "Got it. Thanks for the additional context!"
ATTACHMENT_TEXTS = (
    "<plan-mode-active>\nPlan mode is on.",
    "<background-tasks>\n- build (running)",
    "The following files were recently accessed before context was compacted.\n- src/app.py",
    "Recently accessed file (full current content embedded):\nsrc/app.py\nprint('hi')",
    "Recent visual snapshots preserved from before context was compacted: 1 image",
)
BLANK_TEXTS = ("", " ", "\n", "  \t\n", "\u3000", "\r\n ")
TOOL_NAMES = ("read_file", "run_shell_command", "glob", "replace", "web_fetch")

# No "<" in free text: generated words can never open a reminder or a summary marker by accident.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,!?é—ß😀\n"
UNKNOWN_KEYS = ("xTrace", "providerMeta", "videoMetadata", "cacheHint", "z")  # camelCase, never a field's alias


_SEEDS = st.integers(0, 2**32 - 1)
_BOOLEANS = st.booleans()


@functools.cache
def _sampled(options: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.sampled_from(options)  # built once: building a strategy costs more than drawing from it


@functools.cache
def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(low, high)


@dataclass
class GeneratedHistory:
    """A raw parent history and what the generator knows about it."""

    raw: list[dict[str, Any]]
    startup_length: int
    summary_length: int
    launch_calls: list[dict[str, Any]] = field(default_factory=list)  # the final Agent calls, if the history ends so


def reminder_text(body: str) -> str:
    """A system-reminder text part's text."""
    return f"<system-reminder>\n{body}\n</system-reminder>"


class _Builder:
    """Draws the pieces of one history; call ids are unique within it.

    The structure (turns, steps, kinds of parts, the end) is drawn from hypothesis so that it shrinks;
    cosmetic payloads (words, JSON values, unknown keys) come from one drawn `random.Random`, which keeps
    generation fast enough for hundreds of examples.
    """

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.rng = random.Random(draw(_SEEDS))
        self.ids: Iterator[int] = itertools.count(1)

    def choice(self, options: tuple[str, ...]) -> str:
        return self.draw(_sampled(options))

    def flip(self) -> bool:
        return self.draw(_BOOLEANS)

    def integer(self, low: int, high: int) -> int:
        return self.draw(_integers(low, high))

    # ── cosmetic payloads ──────────────────────────────────────────────────────────────────────

    def words(self) -> str:
        """Free text, never blank, never starting a reminder."""
        return "w" + "".join(self.rng.choices(ALPHABET, k=self.rng.randint(0, 24)))

    def json_value(self, depth: int = 0) -> Any:
        """A JSON value as tools send them: scalars (nulls included), short lists and objects."""
        kind = self.rng.randint(0, 7 if depth < 2 else 5)
        if kind == 6:
            return [self.json_value(depth + 1) for _ in range(self.rng.randint(0, 3))]
        if kind == 7:
            return {k: self.json_value(depth + 1) for k in self.rng.sample("abcxyz", self.rng.randint(0, 3))}
        scalars = (None, self.rng.random() < 0.5, self.rng.randint(-(2**53), 2**53), self.rng.uniform(-1e6, 1e6))
        return scalars[kind] if kind < 4 else self.words()[1:]

    def json_object(self, keys: str = "pqr") -> dict[str, Any]:
        return {k: self.json_value(1) for k in self.rng.sample(keys, self.rng.randint(0, len(keys)))}

    def maybe_extra(self, obj: dict[str, Any], chance: float = 0.1) -> dict[str, Any]:
        if self.rng.random() < chance:
            value = self.json_object("abc") if self.rng.random() < 0.5 else self.words()
            obj[self.rng.choice(UNKNOWN_KEYS)] = value or {"a": None}
        return obj

    # ── parts ──────────────────────────────────────────────────────────────────────────────────

    def text_part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"text": text}
        if self.rng.random() < 0.03:
            part["thoughtSignature"] = None  # a null own key counts as absent
        return self.maybe_extra(part, 0.05)

    def media_part(self) -> dict[str, Any]:
        if self.rng.random() < 0.5:
            data = self.rng.choice(("iVBORw0KGgo=", ""))
            return {"inlineData": self.maybe_extra({"mimeType": "image/png", "data": data})}
        return {"fileData": {"fileUri": "gs://bucket/" + self.words().strip(), "mimeType": "application/pdf"}}

    def reminder_part(self) -> dict[str, Any]:
        return self.text_part(reminder_text(self.words()) + self.rng.choice(("", "\n", "  ")))

    def prompt_part(self) -> dict[str, Any]:
        kind = self.choice(("text", "text", "text", "blank", "reminder", "media", "reminder-then-text"))
        if kind == "blank":
            return self.text_part(self.rng.choice(BLANK_TEXTS))
        if kind == "reminder":
            return self.reminder_part()
        if kind == "media":
            return self.media_part()
        if kind == "reminder-then-text":  # contains a reminder, but is a real prompt
            return self.text_part(reminder_text(self.words()) + " and also " + self.words())
        return self.text_part("prompt: " + self.words())

    def thought_part(self) -> dict[str, Any]:
        text = self.rng.choice(("", "**Planning** ", self.words()))
        return self.maybe_extra({"text": text, "thought": True, "thoughtSignature": "sig-" + self.words()})

    def call_part(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        call = self.maybe_extra({"id": f"call-{next(self.ids)}", "name": name, "args": args})
        part: dict[str, Any] = {"functionCall": call}
        if self.rng.random() < 0.2:
            part["thoughtSignature"] = "sig-call"
        return part

    def tool_call_part(self) -> dict[str, Any]:
        return self.call_part(self.rng.choice(TOOL_NAMES), self.json_object())

    def response_part(self, call: dict[str, Any]) -> dict[str, Any]:
        key = self.rng.choice(("output", "output", "error"))
        response: dict[str, Any] = {"id": call["id"], "name": call["name"], "response": {key: self.json_value()}}
        if self.rng.random() < 0.15:
            response["parts"] = [self.media_part()]
        return {"functionResponse": self.maybe_extra(response)}

    # ── contents ───────────────────────────────────────────────────────────────────────────────

    def content(self, role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return self.maybe_extra({"role": role, "parts": parts}, 0.05)

    def user_prompt(self, *, allow_pure_reminder: bool = True) -> dict[str, Any]:
        parts = [self.prompt_part() for _ in range(self.integer(1, 3))]
        if not allow_pure_reminder and all(p.get("text", "").startswith("<system-reminder>") for p in parts):
            parts.append(self.text_part("prompt: " + self.words()))
        return self.content("user", parts)

    def reminder_content(self) -> dict[str, Any]:
        return self.content("user", [self.reminder_part() for _ in range(self.rng.randint(1, 2))])

    def invalid_model_content(self) -> dict[str, Any]:
        shape = self.choice(("empty-text", "no-parts", "no-parts-key", "empty-part", "text-then-empty"))
        if shape == "empty-text":
            return {"role": "model", "parts": [{"text": ""}]}
        if shape == "no-parts":
            return {"role": "model", "parts": []}
        if shape == "no-parts-key":
            return {"role": "model"}
        if shape == "empty-part":
            return {"role": "model", "parts": [{}]}
        return {"role": "model", "parts": [{"text": self.words()}, {"text": ""}]}

    def model_reply(self, *, calls: list[dict[str, Any]]) -> dict[str, Any]:
        parts: list[dict[str, Any]] = []
        if self.rng.random() < 0.4:
            parts.append(self.thought_part())
        if not calls or self.rng.random() < 0.5:
            parts.append(self.text_part("answer: " + self.words()))
        return self.content("model", [*parts, *calls])

    def tool_exchange(self) -> list[dict[str, Any]]:
        """A model Content with 1-3 calls, the user Content answering them, and maybe a prompt after it."""
        calls = [self.tool_call_part() for _ in range(self.integer(1, 3))]
        answers = [self.response_part(p["functionCall"]) for p in calls]
        follow = self.choice(("none", "none", "part", "content", "reminder-part", "reminder-content"))
        if follow == "part":  # the user typed while the tools ran, sent with the results
            answers.append(self.prompt_part())
        if follow == "reminder-part":
            answers.append(self.reminder_part())
        out = [self.model_reply(calls=calls), self.content("user", answers)]
        if follow == "content":
            out.append(self.user_prompt())
        if follow == "reminder-content":
            out.append(self.reminder_content())
        return out

    def model_steps(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for _ in range(self.integer(0, 4)):
            step = self.choice(("text", "text", "tools", "tools", "tools", "invalid", "reminder", "reminder"))
            if step == "text":
                out.append(self.model_reply(calls=[]))
            elif step == "tools":
                out.extend(self.tool_exchange())
            elif step == "invalid":
                out.append(self.invalid_model_content())
            else:
                out.append(self.reminder_content())
        return out

    # ── prefixes and the end ───────────────────────────────────────────────────────────────────

    def startup(self) -> list[dict[str, Any]]:
        kind = self.choice(("none", "reminder", "legacy"))
        if kind == "reminder":
            return [self.reminder_content()]
        if kind == "legacy":
            env = self.content("user", [self.text_part("This is the Gemini CLI. " + self.words())])
            return [env, self.content("model", [self.text_part(LEGACY_STARTUP_ACK)])]
        return []

    def summary(self) -> list[dict[str, Any]]:
        head = self.content("user", [self.text_part("Summary so far. Resume the prior task: " + self.words())])
        out = [head, self.content("model", [self.text_part(SUMMARY_ACK)])]
        length = self.integer(2, 4)
        if length >= 3:
            texts = self.rng.sample(ATTACHMENT_TEXTS, self.rng.randint(1, 3))
            out.append(self.content("user", [self.text_part(t) for t in texts]))
        if length == 4:
            out.append(self.content("model", [self.tool_call_part()]))
        return out

    def launch(self, sibling_directives: list[str]) -> dict[str, Any]:
        calls = [
            self.call_part(
                "Agent",
                {"description": "fork work", "prompt": directive, "subagent_type": "fork", "fork_turns": "2"},
            )
            for directive in sibling_directives
        ]
        return self.model_reply(calls=calls)


@st.composite
def parent_histories(draw: st.DrawFn) -> GeneratedHistory:
    """A raw parent history (wire dicts) as a parent sends it when it launches a fork."""
    b = _Builder(draw)
    raw = b.startup()
    startup_length = len(raw)
    summary: list[dict[str, Any]] = []
    if startup_length != 2 and b.integer(0, 3) == 0:
        summary = b.summary()
        raw.extend(summary)
        if len(summary) == 4:  # its call is answered by the Content after it
            call = summary[3]["parts"][0]["functionCall"]
            raw.append(b.content("user", [b.response_part(call)]))
    for turn in range(b.integer(0, 6)):
        # a pure reminder at index 0 would be a startup context, not a turn
        raw.append(b.user_prompt(allow_pure_reminder=bool(raw) or turn > 0))
        raw.extend(b.model_steps())
    end = b.choice(("launch", "launch", "launch", "launch", "text", "tools", "prompt", "invalid"))
    launch_calls: list[dict[str, Any]] = []
    if end == "launch":
        count = b.integer(1, 3)
        launch = b.launch([f"<<directive-{i}>> {b.words()}" for i in range(count)])
        raw.append(launch)
        launch_calls = [p["functionCall"] for p in launch["parts"] if "functionCall" in p]
    elif end == "text":
        raw.append(b.model_reply(calls=[]))
    elif end == "tools":  # a call that is still running when the fork launches elsewhere
        raw.append(b.model_reply(calls=[b.tool_call_part()]))
    elif end == "prompt":
        raw.append(b.user_prompt(allow_pure_reminder=bool(raw)))
    else:
        raw.append(b.invalid_model_content())
    return GeneratedHistory(raw, startup_length, len(summary), launch_calls)


FORK_TURNS = st.integers(1, 4).map(str) | st.just("1000")

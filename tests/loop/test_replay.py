"""Replay rebuilds the live loop's requests: one path from a journal entry to the loop's state.

For generated scripts (model texts, thoughts, one or several function calls, calls the provider
garbled, responses ended as a malformed call, final answers failing the output schema) and generated
tool results (outputs and errors, parked calls approved or denied by a person), the child loop runs
in process over the in-memory journal; the digest of every model request it makes must equal the
digest of the request rebuilt by replaying the journal written before it, at every step, and so
must those of a run revived from a drawn crash point. No Redis: the loop layer has none.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.records.test_journal import MemoryJournal
from workers.history.messages import Content
from workers.history.selection import ForkSeed
from workers.loop.child import ChildLoop, Parked, model_request
from workers.loop.replay import replay
from workers.providers import ModelRequest, ModelResponse, TokenUsage
from workers.records.conversation import MALFORMED_CALL, Conversation, calls_of
from workers.records.fork import BootstrapRecord, ForkResult
from workers.records.journal import JournalEntry, request_digest
from workers.tools.registry import Tool, ToolContext, ToolError, ToolRegistry

FORK_ID = "f-replay"
SEED = ForkSeed(
    initial_messages=[
        Content.model_validate({"role": "user", "parts": [{"text": "Please tidy the config."}]}),
        Content.model_validate({"role": "model", "parts": [{"text": "Forking that off."}]}),
    ],
    task_prompt="Begin.",
)
SCHEMA = {"type": "object", "required": ["ok"]}
FINAL_ANSWER = '{"ok": true}'  # what the model answers past the script's end: valid with or without a schema
# declared: a read-only tool, one needing approval, an idempotent one, and one this worker lacks
DECLARED = ("lookup", "write", "retry", "ghost")
CALLED = (*DECLARED, "undeclared")  # the model may also call a tool the parent never declared
WORDS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?é—😀\n"


def answer(args: Mapping[str, Any], _: ToolContext) -> Any:
    """A tool whose result is the one the script generated for this call."""
    if "fail" in args:
        raise ToolError(str(args["fail"]))
    return args.get("out")


def registry() -> ToolRegistry:
    tools = ToolRegistry()
    schema = {"type": "object"}
    tools.register(Tool("lookup", "Read something.", schema, answer))
    tools.register(Tool("write", "Change something.", schema, answer, mutating=True))
    tools.register(Tool("retry", "Change something, idempotently.", schema, answer, mutating=True, idempotent=True))
    tools.register(Tool("undeclared", "Never declared by the parent.", schema, answer))
    return tools


def declarations() -> list[dict[str, Any]]:
    return [{"name": name, "description": f"The {name} tool.", "parameters": {"type": "object"}} for name in DECLARED]


def digest_of(request: ModelRequest) -> str:
    """What the model sees: the whole request without the directive."""
    return request_digest(request.model_dump(mode="json", exclude={"directive"}))


# ── generated scripts ─────────────────────────────────────────────────────────────────────────

_TEXT = st.text(WORDS, max_size=12)
_KEYS = st.text(WORDS, min_size=1, max_size=5)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def call_step(draw: st.DrawFn, step: int) -> ModelResponse:
    """A model response with one to three function calls (some garbled by the provider), maybe text first."""
    parts: list[dict[str, Any]] = []
    if draw(st.booleans()):
        parts.append({"text": draw(_TEXT), **({"thought": True} if draw(st.booleans()) else {})})
    invalid: dict[str, str] = {}
    for index in range(draw(st.integers(1, 3))):
        call_id = f"c{step}.{index}" if draw(st.integers(0, 3)) else None  # some calls come without an id
        name = draw(st.sampled_from(CALLED))
        if call_id is not None and draw(st.integers(0, 4)) == 0:
            invalid[call_id] = f"arguments of {name} are not a JSON object: {draw(_TEXT)!r}"
            parts.append({"functionCall": {"id": call_id, "name": name, "args": {}}})
            continue
        result = {"fail": draw(_TEXT)} if draw(st.integers(0, 3)) == 0 else {"out": draw(_VALUES)}
        # a person's decision, should the call park: taken from the call so a revived run decides alike
        args = {**result, "approve": draw(st.booleans())}
        parts.append({"functionCall": {**({"id": call_id} if call_id else {}), "name": name, "args": args}})
    content = Content.model_validate({"role": "model", "parts": parts})
    return ModelResponse(content=content, usage=_usage(draw), finish_reason="tool_calls", invalid_calls=invalid)


@st.composite
def malformed_step(draw: st.DrawFn) -> ModelResponse:
    """A response the provider ended as a malformed function call: no call, maybe some text."""
    content = Content.model_validate({"role": "model", "parts": [{"text": draw(_TEXT)}]})
    return ModelResponse(content=content, usage=_usage(draw), finish_reason=MALFORMED_CALL)


@st.composite
def bad_answer_step(draw: st.DrawFn) -> ModelResponse:
    """A final answer that fails the output schema (not JSON, or JSON without `ok`): it gets feedback."""
    text = draw(st.sampled_from(["not json", "[1, 2]", '{"fixed": true}', ""]))
    content = Content.model_validate({"role": "model", "parts": [{"text": text}]})
    return ModelResponse(content=content, usage=_usage(draw), finish_reason="stop")


def _usage(draw: st.DrawFn) -> TokenUsage:
    return TokenUsage(input_tokens=draw(st.integers(0, 500)), output_tokens=draw(st.integers(0, 50)))


@dataclass
class Case:
    """One generated fork: its launch options and the model's responses, step by step."""

    mode: str
    policy: str
    schema: bool
    surface: bool
    responses: list[ModelResponse]

    def record(self) -> BootstrapRecord:
        options: dict[str, Any] = {"approval_policy": self.policy}
        if self.schema:
            options["output_schema"] = SCHEMA
        return BootstrapRecord(
            fork_id=FORK_ID,
            parent_session="s-replay",
            kind="fork",
            seed_chunks=[],
            message_count=len(SEED.initial_messages),
            task_prompt=SEED.task_prompt,
            directive="Tidy the config.",
            description="replay",
            tools_json=json.dumps(declarations(), separators=(",", ":")),
            model="test-model",
            approval_mode=self.mode,
            cwd=tempfile.gettempdir(),
            options=options,
        )


@st.composite
def cases(draw: st.DrawFn) -> Case:
    schema = draw(st.booleans())
    kinds = ["calls", "calls", "malformed", *(["bad_answer"] if schema else [])]
    responses: list[ModelResponse] = []
    for step in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(kinds))
        if kind == "calls":
            responses.append(draw(call_step(step)))
        elif kind == "malformed":
            responses.append(draw(malformed_step()))
        else:
            responses.append(draw(bad_answer_step()))
    mode, policy = draw(st.sampled_from([("yolo", "deny"), ("default", "deny"), ("default", "park")]))
    return Case(mode=mode, policy=policy, schema=schema, surface=draw(st.booleans()), responses=responses)


# ── running a case ────────────────────────────────────────────────────────────────────────────


@dataclass
class ScriptProvider:
    """Answers step k with the script's k-th response (a final answer past its end); keeps each request's digest."""

    responses: list[ModelResponse]
    requests: list[tuple[int, str]] = field(default_factory=list)
    name: str = "script"

    def generate(self, request: ModelRequest) -> ModelResponse:
        self.requests.append((request.step, digest_of(request)))
        if request.step < len(self.responses):
            return self.responses[request.step]
        return ModelResponse(content=Content.model_validate({"role": "model", "parts": [{"text": FINAL_ANSWER}]}))

    def digests(self) -> dict[int, str]:
        steps = [step for step, _ in self.requests]
        assert len(steps) == len(set(steps)), f"a model call was made twice: {steps}"
        return dict(self.requests)


@dataclass
class Run:
    journal: MemoryJournal
    provider: ScriptProvider
    result: ForkResult


def drive(case: Case, entries: list[JournalEntry]) -> Run:
    """Run the fork over `entries` to its end; a parked step gets each call's scripted decision, then runs on."""
    record, provider = case.record(), ScriptProvider(case.responses)
    journal = MemoryJournal(entries=list(entries))
    for _ in range(len(case.responses) + 2):  # at most one park per step
        loop = ChildLoop(
            record=record, seed=SEED, provider=provider, tools=registry(), io=journal, entries=list(journal.entries)
        )
        try:
            result = loop.run()
        except Parked as parked:
            # the live state where the loop parked is the replay of its journal, field by field
            assert loop.state == replay(SEED, journal.entries)
            for call in parked.calls:  # what the client writes while the fork is parked
                decision = "approve" if call.args.get("approve") else "deny"
                entry = JournalEntry(
                    seq=len(journal.entries),
                    step=call.step,
                    kind="approval",
                    call_index=call.index,
                    call_id=call.call_id,
                    name=call.name,
                    decision=decision,
                    reason=None if decision == "approve" else "not now",
                )
                journal.entries.append(JournalEntry.decode(entry.encode(), fork_id=FORK_ID))
        else:
            assert loop.state == replay(SEED, journal.entries)  # and so is the state it ended in
            return Run(journal, provider, result)
    raise AssertionError("the fork kept parking")


def first_entries(case: Case) -> list[JournalEntry]:
    """The journal a first run starts from: empty, or the tool surface its runner recorded."""
    return [JournalEntry(seq=0, step=0, kind="surface", tools=["lookup", "write", "retry"])] if case.surface else []


# ── the properties ────────────────────────────────────────────────────────────────────────────


def assert_replay_rebuilds_every_request(case: Case, entries: list[JournalEntry], live: dict[int, str]) -> None:
    """At each model entry, the journal before it replays to the request the live run made at that step
    (`live`: each step's request digest)."""
    record = case.record()
    models = [(k, e) for k, e in enumerate(entries) if e.kind == "model"]
    assert [e.step for _, e in models] == sorted(live), "a model request with no model entry, or the reverse"
    for k, entry in models:
        state = replay(SEED, entries[:k])
        assert (state.step, state.pending, state.final) == (entry.step, [], None), k
        rebuilt = digest_of(model_request(record, record.tools, state.step, state.messages))
        assert rebuilt == live[entry.step] == entry.request_digest, f"step {entry.step} (entry {k})"
        assert_paired(state.messages[len(SEED.initial_messages) :], state.step)
    assert [replay(SEED, entries[:k]).next_seq for k in range(len(entries) + 1)] == list(range(len(entries) + 1))


def assert_paired(messages: list[Content], step: int) -> None:
    """The fork's own messages as a model must read them: each model Content followed by a user Content,
    which answers its calls (same ids and names, in call order) when it made any."""
    assert [m.role for m in messages[::2]] == ["user"] * len(messages[::2]), messages
    assert [m.role for m in messages[1::2]] == ["model"] * len(messages[1::2]), messages
    assert len(messages) == 2 * step + 1
    for made, answered in zip(messages[1::2], messages[2::2], strict=True):
        calls = [(c.id, c.name) for _, c in calls_of(made)]
        responses = [(p.function_response.id, p.function_response.name) for p in answered.parts if p.function_response]
        assert responses == calls


def assert_usage(run: Run, state: Conversation) -> None:
    usage = run.result.usage
    assert (usage.model_calls, usage.tool_uses) == (state.step, state.usage.tool_uses)
    assert (usage.input_tokens, usage.output_tokens) == (state.usage.input_tokens, state.usage.output_tokens)
    assert usage.model_dump(exclude={"duration_ms"}) == state.usage.model_dump(exclude={"duration_ms"})


def dangling_without_rerun(state: Conversation) -> bool:
    """A call started and never answered that a revival does not run again (its result becomes an error)."""
    tools = registry()
    return any(p.started and not getattr(tools.get(p.call.name), "idempotent", False) for p in state.pending)


def note_coverage(entries: list[JournalEntry]) -> None:
    """What the examples exercised (shown by `pytest --hypothesis-show-statistics`)."""
    for kind in sorted({e.kind for e in entries}):
        event(f"journal has {kind}")
    if any(e.finish_reason == MALFORMED_CALL for e in entries):
        event("a response ended as a malformed call")
    if any(e.invalid_calls for e in entries):
        event("a call garbled by the provider")


PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(case=cases(), cut=st.floats(0, 1))
def test_every_live_request_equals_the_request_replay_rebuilds_from_the_journal_before_it(
    case: Case, cut: float
) -> None:
    # Given a live run of a generated fork
    live = drive(case, first_entries(case))
    made = live.provider.digests()
    note_coverage(live.journal.entries)

    # Then at every step the journal before it replays to the request it made, and to its usage at the end
    assert_replay_rebuilds_every_request(case, live.journal.entries, made)
    assert_usage(live, replay(SEED, live.journal.entries))

    # and so does the journal of a worker revived from a point of that journal (the dead one made the
    # requests before it); when it re-runs no interrupted call it makes the very same requests
    entries = live.journal.entries[: round(cut * len(live.journal.entries))]
    revived = drive(case, entries)
    before = {e.step: made[e.step] for e in entries if e.kind == "model"}
    assert_replay_rebuilds_every_request(case, revived.journal.entries, {**before, **revived.provider.digests()})
    assert_usage(revived, replay(SEED, revived.journal.entries))
    if dangling_without_rerun(replay(SEED, entries)):
        event("revived past an interrupted call")
    else:
        assert {step: made[step] for step in revived.provider.digests()} == revived.provider.digests()
        assert revived.journal.entries[: len(entries)] == entries
        assert (revived.result.output, revived.result.error) == (live.result.output, live.result.error)

"""The step journal: entries, replay, and the child loop resumed from every possible crash point.

No Redis and no workers: an in-memory journal writer stands in for the fenced Lua append (same seq
check), so the resume rules (re-call nothing recorded, re-run an interrupted tool only when it is
idempotent, identical request digests) are checked at every cut of a real run's journal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.factories import model, user
from workers.base.codec import encode
from workers.errors import LeaseLost, RecordDecodeError
from workers.history.messages import Content
from workers.history.selection import ForkSeed
from workers.loop.child import INTERRUPTED_ERROR, ChildLoop, PrimedCall, Stopped, first_model_call
from workers.loop.replay import replay
from workers.providers import ModelRequest, ModelResponse
from workers.providers.scripted import Script, ScriptedProvider
from workers.records.events import Event
from workers.records.fork import BootstrapRecord, Status
from workers.records.journal import JournalEntry, RequestDigests, request_digest
from workers.tools.registry import Tool, ToolContext, ToolRegistry

FORK_ID = "f-journal"
SEED = ForkSeed(initial_messages=[user("Please fix the parser."), model("On it.")], task_prompt="Begin.")


def call_part(call_id: str, name: str) -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": name, "args": {"n": call_id}}}


def model_wire(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "model", "parts": list(parts)}


# step 0: an idempotent and a non-idempotent call; step 1: one non-idempotent call; then a final text
SCRIPT = Script.model_validate(
    {
        "steps": [
            {"content": model_wire({"text": "Two things."}, call_part("c1", "idem"), call_part("c2", "effect"))},
            {"content": model_wire(call_part("c3", "effect"))},
            {"content": model_wire({"text": "All done."})},
        ]
    }
)


@dataclass
class MemoryJournal:
    """The fenced append's contract in memory: seq must be the next position; refuses from `refuse_at` on."""

    entries: list[JournalEntry] = field(default_factory=list)
    refuse_at: int | None = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    stop_reason: Callable[[], str | None] = lambda: None
    inbox: list[str] = field(default_factory=list)  # messages `send` left, delivered as the fenced inbox does

    def take_mail(self) -> list[str]:
        return list(self.inbox)

    def deliver(self, entries: list[JournalEntry]) -> None:
        for entry in entries:
            self.append(entry)
        del self.inbox[: len(entries)]

    def emit(self, event: Event) -> None:
        self.events.append((event.type, event.data.wire()))  # as the stream holds it

    def checkpoint(self) -> None:
        reason = self.stop_reason()
        if reason is not None:
            raise Stopped(reason)

    def append(self, entry: JournalEntry, *, boundary: bool = False) -> None:
        if boundary:
            self.checkpoint()
        if self.refuse_at is not None and entry.seq >= self.refuse_at:
            raise LeaseLost(f"fork {FORK_ID}: journal entry {entry.seq} refused (stale)", fork_id=FORK_ID)
        if entry.seq != len(self.entries):
            raise LeaseLost(f"fork {FORK_ID}: journal entry {entry.seq} refused (seq)", fork_id=FORK_ID)
        # stored and read back as bytes, as Redis does
        self.entries.append(JournalEntry.decode(entry.encode(), fork_id=FORK_ID))


@dataclass
class RecordingProvider:
    """The scripted provider, remembering every request it was sent."""

    inner: ScriptedProvider = field(default_factory=lambda: ScriptedProvider(SCRIPT))
    requests: list[ModelRequest] = field(default_factory=list)
    name: str = "recording"

    def generate(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        return self.inner.generate(request)

    def digests(self) -> dict[int, str]:
        return {r.step: request_digest(r.model_dump(mode="json", exclude={"directive"})) for r in self.requests}


@dataclass
class CountingTools:
    """Tools that count their side effects by idempotency key."""

    effects: Counter[str] = field(default_factory=Counter)

    def handler(self, args: Mapping[str, Any], ctx: ToolContext) -> str:
        self.effects[ctx.idempotency_key] += 1
        return f"did {args['n']}"

    def registry(self) -> ToolRegistry:
        registry = ToolRegistry()
        registry.register(Tool("effect", "A side effect.", {"type": "object"}, self.handler, mutating=True))
        registry.register(
            Tool("idem", "An idempotent side effect.", {"type": "object"}, self.handler, mutating=True, idempotent=True)
        )
        return registry


@dataclass
class Run:
    loop: ChildLoop
    journal: MemoryJournal
    provider: RecordingProvider
    tools: CountingTools
    events: list[tuple[str, dict[str, Any]]]


def make_run(tmp_path: Path, entries: list[JournalEntry] | None = None, stop_after_steps: int | None = None) -> Run:
    record = BootstrapRecord(
        fork_id=FORK_ID,
        parent_session="s-journal",
        kind="fork",
        seed_chunks=[],
        message_count=len(SEED.initial_messages),
        task_prompt=SEED.task_prompt,
        directive="Fix the parser.",
        description="fix parser",
        tools_json='[{"name":"effect"},{"name":"idem"}]',
        model="test-model",
        approval_mode="yolo",  # the side effects under test run without approval
        cwd=str(tmp_path),
    )
    provider = RecordingProvider()
    tools = CountingTools()
    events: list[tuple[str, dict[str, Any]]] = []

    def stop_reason() -> str | None:
        steps = sum(1 for kind, _ in events if kind == "step")
        return "shutdown" if stop_after_steps is not None and steps >= stop_after_steps else None

    journal = MemoryJournal(entries=list(entries or []), events=events, stop_reason=stop_reason)
    loop = ChildLoop(
        record=record,
        seed=SEED,
        provider=provider,
        tools=tools.registry(),
        io=journal,
        entries=list(entries or []),
    )
    return Run(loop, journal, provider, tools, events)


def outcome_of(entries: list[JournalEntry]) -> list[tuple[Any, ...]]:
    """What a journal says happened: model responses with their request digests, and tool results."""
    return [
        (e.step, e.kind, e.content, e.request_digest, e.call_id, e.response)
        for e in entries
        if e.kind != "tool_started"  # an idempotent call re-run after a crash is started twice
    ]


def key(step: int, call_id: str) -> str:
    return f"{FORK_ID}:{step}:{call_id}"


# ── entries ───────────────────────────────────────────────────────────────────────────────────


def test_an_entry_round_trips_through_its_canonical_bytes() -> None:
    entry = JournalEntry(seq=3, step=1, kind="tool_result", call_index=0, call_id="c1", name="x", response={"a": 1})

    data = entry.encode()

    assert JournalEntry.decode(data, fork_id=FORK_ID) == entry
    assert data == JournalEntry.decode(data, fork_id=FORK_ID).encode()


@pytest.mark.parametrize(
    "data",
    [b"\xc1 not msgpack", encode({"seq": 0, "step": 0, "kind": "model", "evil": 1}), encode({"seq": "zero"})],
    ids=["not-msgpack", "unknown-field", "wrong-types"],
)
def test_a_malformed_entry_is_a_decode_error_naming_the_fork(data: bytes) -> None:
    with pytest.raises(RecordDecodeError, match=FORK_ID):
        JournalEntry.decode(data, fork_id=FORK_ID)


# ── replay ────────────────────────────────────────────────────────────────────────────────────


def test_replay_of_an_empty_journal_is_the_seed_and_the_task_prompt() -> None:
    state = replay(SEED, [])

    assert state.messages == [*SEED.initial_messages, user("Begin.")]
    assert (state.step, state.next_seq, state.pending, state.final) == (0, 0, [], None)


def test_replay_of_a_started_but_unfinished_call_leaves_it_pending_and_marked_started() -> None:
    # Given step 0's model response with two calls, the first answered, the second started and never finished
    step0 = Content.model_validate(SCRIPT.steps[0].content.to_wire())
    entries = [
        JournalEntry(seq=0, step=0, kind="model", content=step0.to_wire(), request_digest="d0", input_tokens=5),
        JournalEntry(seq=1, step=0, kind="tool_started", call_index=0, call_id="c1", name="idem"),
        JournalEntry(
            seq=2, step=0, kind="tool_result", call_index=0, call_id="c1", name="idem", response={"output": 1}
        ),
        JournalEntry(seq=3, step=0, kind="tool_started", call_index=1, call_id="c2", name="effect"),
    ]

    state = replay(SEED, entries)

    assert (state.step, state.next_seq, state.usage.tool_uses, state.usage.input_tokens) == (1, 4, 1, 5)
    assert [(p.index, p.call.id, p.started) for p in state.pending] == [(1, "c2", True)]
    assert list(state.answers) == [0]
    assert state.messages[-1] == step0  # no partial answer joins the messages
    assert state.final is None


def test_replay_of_a_call_never_started_leaves_it_pending_and_not_started() -> None:
    step0 = SCRIPT.steps[0].content
    entries = [JournalEntry(seq=0, step=0, kind="model", content=step0.to_wire())]

    state = replay(SEED, entries)

    assert [(p.index, p.started) for p in state.pending] == [(0, False), (1, False)]


def test_replay_of_a_finished_run_has_the_final_answer(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    result = run.loop.run()

    state = replay(SEED, run.journal.entries)

    assert state.final is not None and state.pending == []
    assert state.step == 3 and state.usage.tool_uses == 3
    assert result.output == "All done."
    assert state.messages[-1] == SCRIPT.steps[2].content


# ── the child loop resumed from its journal ───────────────────────────────────────────────────


def test_a_run_journals_each_model_response_and_each_call_before_and_after_it(tmp_path: Path) -> None:
    run = make_run(tmp_path)

    result = run.loop.run()

    assert result.status is Status.SUCCEEDED
    kinds = [(e.kind, e.step, e.call_id) for e in run.journal.entries]
    assert kinds == [
        ("model", 0, None),
        ("tool_started", 0, "c1"),
        ("tool_result", 0, "c1"),
        ("tool_started", 0, "c2"),
        ("tool_result", 0, "c2"),
        ("model", 1, None),
        ("tool_started", 1, "c3"),
        ("tool_result", 1, "c3"),
        ("model", 2, None),
    ]
    assert [e.seq for e in run.journal.entries] == list(range(9))
    assert run.tools.effects == Counter({key(0, "c1"): 1, key(0, "c2"): 1, key(1, "c3"): 1})
    # each model entry records the digest of the request that produced it; model_call events carry it too
    digests = run.provider.digests()
    assert {e.step: e.request_digest for e in run.journal.entries if e.kind == "model"} == digests
    assert {d["step"] - 1: d["request_digest"] for k, d in run.events if k == "model_call"} == digests


def test_resuming_from_every_cut_of_the_journal_recalls_nothing_and_rebuilds_identical_requests(
    tmp_path: Path,
) -> None:
    # Given the journal of a complete run, and its requests
    original = make_run(tmp_path)
    expected = original.loop.run()
    full = original.journal.entries
    original_digests = original.provider.digests()

    for cut in range(len(full) + 1):
        # When a worker died after `cut` entries and another resumes from them
        resumed = make_run(tmp_path, entries=full[:cut])
        result = resumed.loop.run()
        state = replay(SEED, full[:cut])
        dangling = [p for p in state.pending if p.started]

        # Then no recorded model call is made again, and no recorded tool result is produced again
        assert min(resumed.provider.digests(), default=state.step) >= state.step, cut
        answered = {key(e.step, e.call_id or "") for e in full[:cut] if e.kind == "tool_result"}
        assert not answered & set(resumed.tools.effects), cut
        assert result.status is Status.SUCCEEDED, cut
        assert [e.seq for e in resumed.journal.entries] == list(range(len(resumed.journal.entries)))
        if dangling and dangling[0].call.name == "effect":
            # an interrupted non-idempotent call is answered with the interrupted error, never re-run
            assert key(state.step - 1, dangling[0].call.id or "") not in resumed.tools.effects, cut
            continue
        # Otherwise every request the resumed run makes is byte-identical to the original's
        for step, digest in resumed.provider.digests().items():
            assert digest == original_digests[step], (cut, step)
        assert result.output == expected.output
        assert outcome_of(resumed.journal.entries) == outcome_of(full), cut


def test_an_interrupted_non_idempotent_call_is_answered_with_the_interrupted_error(tmp_path: Path) -> None:
    # Given a journal that ends with c2 (not idempotent) started and never finished
    original = make_run(tmp_path)
    original.loop.run()
    cut = next(i for i, e in enumerate(original.journal.entries) if e.kind == "tool_started" and e.call_id == "c2")

    resumed = make_run(tmp_path, entries=original.journal.entries[: cut + 1])
    resumed.loop.run()

    # Then c2 is not run again; its recorded result and the next request carry the interrupted error
    assert key(0, "c2") not in resumed.tools.effects
    c2_result = next(e for e in resumed.journal.entries if e.kind == "tool_result" and e.call_id == "c2")
    assert c2_result.response == {"error": INTERRUPTED_ERROR}
    next_request = resumed.provider.requests[0]
    assert next_request.step == 1
    answers = next_request.messages[-1].to_wire()["parts"]
    assert [a["functionResponse"]["id"] for a in answers] == ["c1", "c2"]
    assert answers[0]["functionResponse"]["response"] == {"output": "did c1"}
    assert answers[1]["functionResponse"]["response"] == {"error": INTERRUPTED_ERROR}
    assert ("tool", {"step": 1, "tool": "effect", "ok": False}) in resumed.events


def test_an_interrupted_idempotent_call_is_run_again_with_the_same_idempotency_key(tmp_path: Path) -> None:
    original = make_run(tmp_path)
    original.loop.run()
    cut = next(i for i, e in enumerate(original.journal.entries) if e.kind == "tool_started" and e.call_id == "c1")

    resumed = make_run(tmp_path, entries=original.journal.entries[: cut + 1])
    resumed.loop.run()

    assert resumed.tools.effects[key(0, "c1")] == 1
    assert resumed.provider.digests()[1] == original.provider.digests()[1]


def test_a_refused_journal_write_stops_the_loop_before_the_tool_runs(tmp_path: Path) -> None:
    # Given a worker whose lease is lost right after it recorded the model response
    run = make_run(tmp_path)
    run.journal.refuse_at = 1

    with pytest.raises(LeaseLost, match="refused"):
        run.loop.run()

    # Then it never ran a tool: the `tool_started` write fails closed first
    assert run.tools.effects == Counter()
    assert [e.kind for e in run.journal.entries] == ["model"]


def test_a_stop_at_a_step_boundary_leaves_a_journal_the_next_worker_resumes(tmp_path: Path) -> None:
    stopped = make_run(tmp_path, stop_after_steps=1)
    with pytest.raises(Stopped) as info:
        stopped.loop.run()
    assert info.value.reason == "shutdown"

    resumed = make_run(tmp_path, entries=stopped.journal.entries)
    result = resumed.loop.run()

    assert result.output == "All done."
    total = stopped.tools.effects + resumed.tools.effects
    assert total == Counter({key(0, "c1"): 1, key(0, "c2"): 1, key(1, "c3"): 1})
    assert set(resumed.provider.digests()) == {1, 2}


def test_request_digests_equal_the_digest_of_the_whole_request_and_forget_dead_messages() -> None:
    # Given requests sharing messages, one of them with unknown keys and nulls inside
    odd = Content.model_validate(
        {"role": "user", "parts": [{"text": "héllo", "xExtra": {"b": None, "a": [1]}}, {"functionCall": {"name": "t"}}]}
    )
    messages = [*SEED.initial_messages, odd]
    digests = RequestDigests()

    def request(step: int, extra: list[Content]) -> ModelRequest:
        return ModelRequest(
            fork_id=FORK_ID,
            step=step,
            model=None,
            system_instruction={"parts": [{"text": "be brief"}]},
            tools=[{"name": "grep", "parameters": {"type": "object"}}],
            messages=[*messages, *extra],
            generation={"temperature": 0.5},
            directive="not part of the digest",
        )

    # Then each digest is the one of the whole request's dump, whichever messages were encoded before
    for step, extra in enumerate([[], [model("more")], [model("more"), user("and more")]]):
        req = request(step, extra)
        assert digests.digest(req) == request_digest(req.model_dump(mode="json", exclude={"directive"}))
    del req, extra, odd
    messages.pop()
    assert len(digests._encoded) == len(messages)  # the dead messages' encodings went with them


def test_request_digests_encode_shared_tools_once_and_never_confuse_two_tool_lists() -> None:
    # Given requests built as a child loop builds them (one declarations object for every step)
    digests = RequestDigests()
    tools = [{"name": "grep", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    system = {"parts": [{"text": "be brief"}]}

    def request(step: int, declarations: list[dict[str, Any]]) -> ModelRequest:
        return ModelRequest.model_construct(
            fork_id=FORK_ID,
            step=step,
            model="m",
            system_instruction=system,
            tools=declarations,
            messages=list(SEED.initial_messages),
            generation={},
            directive="d",
        )

    def whole(req: ModelRequest) -> str:
        return request_digest(req.model_dump(mode="json", exclude={"directive"}))

    # When the same objects come back at later steps, and then a different tool list with equal names
    first = [digests.digest(request(step, tools)) for step in range(3)]
    other_tools = [{"name": "grep", "parameters": {"type": "object"}}]
    other = digests.digest(request(0, other_tools))

    # Then every digest is the whole request's, the shared objects were encoded once, and the lists differ
    assert first == [whole(request(step, tools)) for step in range(3)]
    assert other == whole(request(0, other_tools)) != first[0]
    assert sum(1 for value, _ in digests._static.values() if value is tools) == 1
    assert sum(1 for value, _ in digests._static.values() if value is system) == 1


@pytest.mark.parametrize("system", [None, "be brief", {"parts": [{"text": "be brief"}]}])
def test_request_digests_match_the_whole_request_for_any_system_instruction_and_non_finite_numbers(
    system: str | dict[str, Any] | None,
) -> None:
    # Given declarations with values JSON has no literal for (a parent's json.dumps writes Infinity/NaN)
    tools = [{"name": "t", "parameters": {"type": "number", "maximum": float("inf"), "default": float("nan")}}]
    built = ModelRequest.model_construct(
        fork_id=FORK_ID,
        step=0,
        model=None,
        system_instruction=system,
        tools=tools,
        messages=list(SEED.initial_messages),
        generation={},
        directive="",
    )
    validated = ModelRequest.model_validate(built.model_dump())

    # Then the digest is the whole request's dump's, for a constructed and a validated request alike
    for req in (built, validated):
        assert RequestDigests().digest(req) == request_digest(req.model_dump(mode="json", exclude={"directive"}))


def test_request_digests_cover_the_output_schema_encoded_once_per_loop() -> None:
    # Given requests built as a child loop builds them, with the launch's output schema
    digests = RequestDigests()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": float("inf")}}}

    def request(step: int, output_schema: dict[str, Any] | None) -> ModelRequest:
        return ModelRequest.model_construct(
            fork_id=FORK_ID,
            step=step,
            model="m",
            system_instruction="be brief",
            tools=[],
            messages=list(SEED.initial_messages),
            generation={},
            directive="d",
            output_schema=output_schema,
        )

    def whole(req: ModelRequest) -> str:
        return request_digest(req.model_dump(mode="json", exclude={"directive"}))

    # Then the digest is the whole request's, with the schema in it, and the schema was encoded once
    with_schema = [digests.digest(request(step, schema)) for step in range(3)]
    assert with_schema == [whole(request(step, schema)) for step in range(3)]
    assert digests.digest(request(0, None)) == whole(request(0, None)) != with_schema[0]
    assert sum(1 for value, _ in digests._static.values() if value is schema) == 1


def primed_for(run: Run, seed: ForkSeed) -> PrimedCall:
    """The first call as a worker announces it in the claim, for `seed` and the run's record."""
    loop = run.loop
    return first_model_call(loop.record, seed, RequestDigests(), loop.declarations)


def first_digests(run: Run) -> tuple[str | None, str]:
    """(the journaled request digest of the first model call, the digest of the request the model got)."""
    journaled = next(e.request_digest for e in run.journal.entries if e.kind == "model")
    return journaled, run.provider.digests()[0]


def test_a_primed_first_call_journals_the_digest_of_the_request_it_stands_for(tmp_path: Path) -> None:
    # Given the loop of a first run, primed with its first call as the claim announced it
    run = make_run(tmp_path)
    primed = primed_for(run, SEED)
    run.loop.primed = primed

    run.loop.run()

    # Then the first call's journaled digest is the primed one, and it is the digest of what the model got
    journaled, sent = first_digests(run)
    assert journaled == primed.digest == sent
    assert ("model_call", {"step": 1, "request_digest": sent}) in run.events


@pytest.mark.parametrize("differs", ["messages", "step", "declarations"])
def test_a_primed_call_for_another_request_is_not_used(tmp_path: Path, differs: str) -> None:
    # Given a primed call that does not stand for the loop's first request
    run = make_run(tmp_path)
    primed = primed_for(run, SEED)
    other = ForkSeed(initial_messages=[user("Please fix the lexer."), model("On it.")], task_prompt="Begin.")
    if differs == "messages":
        primed = primed_for(run, other)
    elif differs == "step":
        primed = PrimedCall(primed.step + 1, primed.declarations, primed.messages, primed.digest)
    else:
        primed = PrimedCall(primed.step, [{"name": "effect"}], primed.messages, primed.digest)
    run.loop.primed = PrimedCall(primed.step, primed.declarations, primed.messages, "0" * 64)

    run.loop.run()

    # Then every journaled digest is the digest of the request the model got, never the primed one
    journaled, sent = first_digests(run)
    assert journaled == sent != "0" * 64
    assert all(e.request_digest != "0" * 64 for e in run.journal.entries)

"""Benchmark: the share of each model request that is a byte prefix of an earlier request (prompt-cache parity).

Run: `python bench/cache.py [--siblings 10] [--continuations 3] [--providers openai,gemini]`. Starts a
private redis-server, one local fake server per provider (tests/fakeapi.py, answering in the OpenAI
Chat Completions and Gemini `generateContent` wire formats and keeping every request body as sent),
and one real worker process (`forkq worker`, threads pool) routing `gpt-*` to the first and `gemini-*`
to the second. Per provider, on the example parent (`workers/examples/parent.json`, 44 messages):

(a) N sibling `all` forks launched at once. Each lists its directory; reads two files in parallel
    (OpenAI: after reasoning; Gemini: with a thought signature); then answers.
(b) one fork that does the same, then M continuations sent to it through `ForkClient.send` (the
    worker runs each as the fork's next exchange, its message appended to the journal): the first
    reads a file again and answers, the others answer in text.

A request's prompt is its system instruction, tool declarations and history in the order the model
reads them, each as the exact bytes of the wire body (the JSON's key order is the SDK's; a provider
builds the prompt with the system instruction and declarations first). Its share is the longest byte
prefix it has in common with another request, over its own length. The baseline is the ideal: a
request that reuses every byte sent before, so that the rest is only its new messages (a later
request: its previous request's prompt without the closing bracket; a sibling: everything before
its own directive). `rewrites` counts requests whose shared prefix ends before that point. The same
siblings run again on a second worker with `FORKQ_PROMPT_CACHE_KEY=false`: no request then carries
the key, and the shares must not change.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):  # `python bench/cache.py` puts bench/ on sys.path; the fake servers are tests'
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from fakeapi import FakeAPI, Received, Reply  # noqa: E402

from bench.procs import fleet  # noqa: E402
from broker_config.settings import Settings  # noqa: E402
from workers.client import ForkClient, ForkHandle  # noqa: E402
from workers.demo.redis_server import RedisServer  # noqa: E402
from workers.history.selection import FORK_BEGIN_PROMPT  # noqa: E402

EXAMPLE_PARENT = ROOT / "workers" / "examples" / "parent.json"
MODELS = {"openai": "gpt-4.1-mini", "gemini": "gemini-2.5-flash"}
HISTORY = {"openai": "messages", "gemini": "contents"}
PROMPT_PARTS = {"openai": ("tools", "messages"), "gemini": ("systemInstruction", "tools", "contents")}
SIG = "CiIBc2lnLW9uZQ=="  # a Gemini thought signature (base64 bytes)
# distinct first words: siblings' prompts then differ from their first byte on
PROMPTS = (
    "Write the missing link-expiry tests in tests/test_expiry.py.",
    "Audit app/ratelimit.py for races between INCR and EXPIRE.",
    "Review the redirect cache for links that outlive their expiry.",
    "Find every caller of resolve() and list the ones that ignore None.",
    "Check the SQLite migrations for columns without a default.",
    "Benchmark POST /api/links with 100 concurrent clients.",
    "Document the configuration variables in README.md.",
    "Summarise the open TODO comments by module.",
    "Trace how X-Forwarded-For reaches the limiter key.",
    "Propose a schema for click analytics without changing code.",
    "Inspect the Dockerfile for a non-root user and a healthcheck.",
    "Grep the tests for sleeps longer than one second.",
)
CONTINUATIONS = (
    "Now read app.py again and say what main() returns.",
    "Good. What would you test first, and why?",
    "Thanks. Give the answer as three bullet points.",
)
TARGET_SIBLING = 0.95
TARGET_LATER = 0.90
WAIT_S = 60.0


# ── the fake models: answer from what they were sent ─────────────────────────────────────────


def openai_reply(received: Received) -> Reply:
    """List after the task prompt; read two files at once after the listing; read one file when a message asks;
    answer after the reads or any other message."""
    messages = received.json["messages"]
    last = messages[-1]
    if last["role"] == "user":
        if last["content"] == FORK_BEGIN_PROMPT:
            return Reply(body=completion({"tool_calls": [call("c-ls", "list_directory", {"path": "."})]}, received))
        if "read" in last["content"]:
            return Reply(body=completion({"tool_calls": [call("c-rd-3", "read_file", {"path": "app.py"})]}, received))
    assistant = next(m for m in reversed(messages) if m["role"] == "assistant")
    if last["role"] == "tool" and assistant["tool_calls"][0]["function"]["name"] == "list_directory":
        reads = [call("c-rd-1", "read_file", {"path": "notes.txt"}), call("c-rd-2", "read_file", {"path": "app.py"})]
        message = {"content": "Reading both.", "reasoning_content": "Two files matter.", "tool_calls": reads}
        return Reply(body=completion(message, received))
    return Reply(body=completion({"content": f"Done: answered after {len(messages)} messages."}, received))


def call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def completion(message: dict[str, Any], received: Received) -> dict[str, Any]:
    calls = bool(message.get("tool_calls"))
    choice = {"index": 0, "message": {"role": "assistant", "content": None, **message}, "logprobs": None}
    tokens = len(received.raw) // 4
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1741569952,
        "model": MODELS["openai"],
        "choices": [{**choice, "finish_reason": "tool_calls" if calls else "stop"}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": 20, "total_tokens": tokens + 20},
    }


def gemini_reply(received: Received) -> Reply:
    """The same conversation in `generateContent` form, the first call carrying a thought signature."""
    contents = received.json["contents"]
    last = contents[-1]["parts"]
    if last == [{"text": FORK_BEGIN_PROMPT}]:
        ls = {"functionCall": {"id": "c-ls", "name": "list_directory", "args": {"path": "."}}, "thoughtSignature": SIG}
        return Reply(body=generated([ls], received))
    if len(last) == 1 and "read" in last[0].get("text", ""):
        read = {"functionCall": {"id": "c-rd-3", "name": "read_file", "args": {"path": "app.py"}}}
        return Reply(body=generated([read], received))
    answered = [p["functionResponse"]["name"] for p in last if "functionResponse" in p]
    if answered == ["list_directory"]:
        reads = [
            {"functionCall": {"id": f"c-rd-{i}", "name": "read_file", "args": {"path": p}}}
            for i, p in enumerate(("notes.txt", "app.py"))
        ]
        return Reply(body=generated([{"text": "Two files matter.", "thought": True}, *reads], received))
    return Reply(body=generated([{"text": f"Done: answered after {len(contents)} contents."}], received))


def generated(parts: list[dict[str, Any]], received: Received) -> dict[str, Any]:
    tokens = len(received.raw) // 4
    return {
        "candidates": [{"content": {"parts": parts, "role": "model"}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": tokens, "candidatesTokenCount": 20, "totalTokenCount": tokens + 20},
        "modelVersion": MODELS["gemini"],
    }


# ── the prompt as the model reads it, from the exact bytes sent ─────────────────────────────


def raw_span(text: str, key: str) -> str:
    """The exact text of the top-level `"key": <value>` of a JSON object given as text."""
    decoder, at = json.JSONDecoder(), text.index("{") + 1
    while True:
        at += len(text[at:]) - len(text[at:].lstrip(" \n\r\t,"))
        name, at = decoder.raw_decode(text, at)
        at = text.index(":", at) + 1
        at += len(text[at:]) - len(text[at:].lstrip())
        _, end = decoder.raw_decode(text, at)
        if name == key:
            return text[at:end]
        at = end


def prompt_bytes(kind: str, received: Received) -> bytes:
    """System instruction (OpenAI: the first message), declarations and history, each exactly as sent."""
    text = received.raw.decode("utf-8")
    return "".join(raw_span(text, key) for key in PROMPT_PARTS[kind] if key in received.json).encode("utf-8")


def shared(a: bytes, b: bytes) -> int:
    """The length of the longest common byte prefix (binary search over C-speed slice compares)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


# ── the runs ─────────────────────────────────────────────────────────────────────────────────


@dataclass
class Requests:
    """What one provider's server received, per fork (by the prompt its directive carries), in arrival order."""

    kind: str
    forks: dict[str, list[Received]] = field(default_factory=dict)
    continued: int = 0  # of the continued fork's requests, how many its continuations made


def worker_env(redis_url: str, apis: dict[str, FakeAPI], logdir: Path, *, key: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}
    pythonpath = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env | {
        "PYTHONPATH": pythonpath,
        "FORKQ_REDIS_URL": redis_url,
        "FORKQ_PROVIDER_ROUTES": json.dumps({"gpt-*": "openai", "gemini-*": "gemini"}),
        "FORKQ_OPENAI_BASE_URL": f"{apis['openai'].url}/v1",
        "FORKQ_OPENAI_API_KEY": "sk-bench",
        "FORKQ_GEMINI_BASE_URL": f"{apis['gemini'].url}/",
        "FORKQ_GEMINI_API_KEY": "bench-key",
        "FORKQ_PROMPT_CACHE_KEY": "true" if key else "false",
        "FORKQ_HEARTBEAT_FILE": str(logdir / "heartbeat"),
    }


@contextmanager
def fake_servers() -> Iterator[dict[str, FakeAPI]]:
    with FakeAPI(openai_reply) as openai_api, FakeAPI(gemini_reply) as gemini_api:
        yield {"openai": openai_api, "gemini": gemini_api}


def parent_for(kind: str, cwd: Path) -> dict[str, Any]:
    parent: dict[str, Any] = json.loads(EXAMPLE_PARENT.read_text(encoding="utf-8"))
    return {**parent, "model": MODELS[kind], "cwd": str(cwd)}


def run_config(plan: argparse.Namespace, tmp: Path, *, key: bool) -> dict[str, Requests]:
    """Launch the siblings (and, with the key on, the continued fork) per provider on a fresh worker."""
    logdir = tmp / ("key-on" if key else "key-off")
    logdir.mkdir()
    (logdir / "notes.txt").write_text("The release codename is PERIWINKLE-7731.\n", encoding="utf-8")
    (logdir / "app.py").write_text("def main():\n    return 42\n", encoding="utf-8")
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        apis = stack.enter_context(fake_servers())
        env = worker_env(server.url, apis, logdir, key=key)
        group = stack.enter_context(fleet(logdir))
        worker = group.start("worker", [sys.executable, "-m", "workers.cli", "worker", "--loglevel", "WARNING"], env)
        settings = Settings(redis_url=server.url)
        client = stack.enter_context(ForkClient(settings))
        siblings = PROMPTS[: plan.siblings]
        extra = (PROMPTS[plan.siblings],) if key else ()
        handles = {
            (kind, prompt): client.launch(parent_for(kind, logdir), fork_params(prompt))
            for kind in plan.providers
            for prompt in (*siblings, *extra)
        }
        continued: dict[str, int] = {}
        for (kind, prompt), handle in handles.items():
            result = handle.wait(timeout=WAIT_S)
            if result.status.value != "succeeded":
                raise RuntimeError(f"{kind} fork {prompt!r}: {result.status.value} {result.error}\n{worker.tail()}")
        for kind in plan.providers if key else ():
            continued[kind] = continue_fork(client, handles[kind, extra[0]], plan.continuations, worker.tail)
        runs = {kind: split_by_fork(kind, apis[kind], (*siblings, *extra)) for kind in plan.providers}
        for kind, first in continued.items():
            runs[kind].continued = len(runs[kind].forks[extra[0]]) - first
    return runs


def fork_params(prompt: str) -> dict[str, str]:
    return {"description": prompt[:40], "prompt": prompt, "subagent_type": "fork", "fork_turns": "all"}


def prompt_in(prompt: str, received: Received) -> bool:
    return json.dumps(prompt)[1:-1].encode() in received.raw


def split_by_fork(kind: str, api: FakeAPI, prompts: Sequence[str]) -> Requests:
    return Requests(kind, {prompt: [r for r in api.received if prompt_in(prompt, r)] for prompt in prompts})


def continue_fork(client: ForkClient, handle: ForkHandle, turns: int, log: Callable[[], str]) -> int:
    """Send the ended fork `turns` messages, one exchange after the other; its requests before the first."""
    before = handle.wait(timeout=WAIT_S).usage.model_calls
    for text in CONTINUATIONS[:turns]:
        client.send(handle.fork_id, text)
        result = handle.wait(timeout=WAIT_S)
        if result.status.value != "succeeded":
            raise RuntimeError(f"continuation {text!r}: {result.status.value} {result.error}\n{log()}")
    return before


# ── the figures ──────────────────────────────────────────────────────────────────────────────


@dataclass
class Figure:
    """Shares of a set of requests, the ideal shares (every byte sent before reused), and a target on the minimum."""

    name: str
    shares: list[float] = field(default_factory=list)
    ideals: list[float] = field(default_factory=list)
    rewrites: int = 0
    target: float | None = None

    def add(self, common: int, bound: int, size: int) -> None:
        """One request of `size` bytes sharing `common` with the earlier one, which it could share up to `bound`."""
        self.shares.append(common / size)
        self.ideals.append(bound / size)
        self.rewrites += common < bound

    def verdict(self) -> str:
        if self.target is None or not self.shares:
            return ""
        return f"≥{self.target:.0%} " + ("OK" if min(self.shares) >= self.target else "MISS")


def sibling_figure(run: Requests, siblings: Sequence[str]) -> Figure:
    """Each sibling's first request against the first sibling's, bounded by where its own directive starts."""
    figure = Figure("sibling's first request vs sibling 1's first", target=TARGET_SIBLING)
    base = prompt_bytes(run.kind, run.forks[siblings[0]][0])
    for prompt in siblings[1:]:
        data = prompt_bytes(run.kind, run.forks[prompt][0])
        figure.add(shared(data, base), data.rfind(json.dumps(prompt)[1:-1].encode()), len(data))
    return figure


def later_figure(run: Requests, name: str, pairs: Sequence[tuple[Received, Received]]) -> Figure:
    """Each request against the one before it in its fork, bounded by that one's prompt without its closing `]`."""
    figure = Figure(name, target=TARGET_LATER)
    for before, after in pairs:
        previous, data = prompt_bytes(run.kind, before), prompt_bytes(run.kind, after)
        figure.add(shared(data, previous), len(previous) - 1, len(data))
    return figure


def pairs_of(requests: Sequence[Received]) -> list[tuple[Received, Received]]:
    return list(itertools.pairwise(requests))


def cacheable_share(run: Requests) -> tuple[int, float]:
    """Requests, and the share of all their prompt bytes that are a prefix of some earlier request's."""
    ordered = sorted((r for requests in run.forks.values() for r in requests), key=lambda r: r.at)
    prompts = [prompt_bytes(run.kind, r) for r in ordered]
    reused = sum(max((shared(p, q) for q in prompts[:i]), default=0) for i, p in enumerate(prompts))
    return len(prompts), reused / sum(map(len, prompts))


def keyed(run: Requests, session: str) -> tuple[int, int]:
    """(requests carrying the parent session as prompt_cache_key, requests)."""
    requests = [r for rs in run.forks.values() for r in rs]
    return sum(r.json.get("prompt_cache_key") == session for r in requests), len(requests)


def figures(run: Requests, siblings: Sequence[str]) -> list[Figure]:
    """The sibling, later-request and (where run) continuation figures of one provider's run."""
    later = [pair for prompt in siblings for pair in pairs_of(run.forks[prompt])]
    found = [sibling_figure(run, siblings), later_figure(run, "later request vs its previous (siblings)", later)]
    if run.continued:
        [continued] = [requests for prompt, requests in run.forks.items() if prompt not in siblings]
        own = pairs_of(continued[: len(continued) - run.continued])
        found.append(later_figure(run, "later request vs its previous (continued fork)", own))
        turns = pairs_of(continued)[-run.continued :]
        found.append(later_figure(run, "continuation request vs its previous", turns))
    return found


# ── the report ───────────────────────────────────────────────────────────────────────────────


def print_report(plan: argparse.Namespace, runs: dict[str, dict[str, Requests]], seconds: float) -> None:
    parent = json.loads(EXAMPLE_PARENT.read_text(encoding="utf-8"))
    siblings = PROMPTS[: plan.siblings]
    print(
        f"\nprompt-cache parity: {plan.siblings} sibling `all` forks of workers/examples/parent.json "
        f"({len(parent['history'])} messages, {len(json.dumps(parent)) / 1000:.0f} KB)\n"
        f"and one fork with {plan.continuations} continuations, per provider, on one forkq worker process per run;\n"
        "the share of each request's prompt (system, tools, history, as sent) that is a byte prefix of the earlier one"
    )
    print("continuations: sent through ForkClient.send and run by the worker (the first with a tool round)")
    print("baseline: the ideal, a request reusing every byte sent before (its rest only new messages or its directive)")
    head = (
        f"{'provider':8}  {'run':7}  {'figure':47}  {'n':>3}  {'min':>7}  {'median':>7}  {'ideal':>7}  rewrites  target"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for name, by_kind in runs.items():
        for kind, run in by_kind.items():
            for figure in figures(run, siblings):
                cells = (min(figure.shares), statistics.median(figure.shares), min(figure.ideals))
                print(
                    f"{kind:8}  {name:7}  {figure.name:47}  {len(figure.shares):>3}  "
                    + "  ".join(f"{c:>7.2%}" for c in cells)
                    + f"  {figure.rewrites:>8}  {figure.verdict()}"
                )
            count, share = cacheable_share(run)
            print(
                f"{kind:8}  {name:7}  {'all prompt bytes a prefix of an earlier request':47}  {count:>3}  {share:>7.2%}"
            )
            if kind == "openai":
                carried, total = keyed(run, parent["session_id"])
                label = "requests with prompt_cache_key = parent session"
                print(f"{kind:8}  {name:7}  {label:47}  {total:>3}  {carried:>7}")
    print(f"\ntotal {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--siblings", type=int, default=10, help="sibling forks per provider (2 to 11)")
    parser.add_argument("--continuations", type=int, default=3, help=f"continuations (1 to {len(CONTINUATIONS)})")
    parser.add_argument("--providers", default="openai,gemini", help="comma-separated: openai, gemini")
    plan = parser.parse_args()
    plan.providers = [p for p in plan.providers.split(",") if p]
    if not 2 <= plan.siblings < len(PROMPTS) or not 1 <= plan.continuations <= len(CONTINUATIONS):
        parser.error(f"--siblings must be 2 to {len(PROMPTS) - 1}, --continuations 1 to {len(CONTINUATIONS)}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="forkq-bench-cache-") as tmp:
        runs = {"key on": run_config(plan, Path(tmp), key=True), "key off": run_config(plan, Path(tmp), key=False)}
    print_report(plan, runs, time.monotonic() - started)


if __name__ == "__main__":
    main()

"""Benchmark: worker CPU per model call of the OpenAI-compatible adapter, against the floor of a raw POST.

Run: `python bench/provider_cpu.py [--calls 300] [--kb 40] [--profile]`. Starts `bench/openai_stub.py`
(no latency, room for every request) in a subprocess, builds one fork-like request of about `--kb` KB of
messages (a system instruction, tool declarations, turns of tool calls and their outputs) and measures
this process's CPU (`time.process_time`, every thread) per call of:

- `adapter`: `OpenAICompatProvider.generate` (request conversion, the HTTP call, the parsed response);
- `sdk create()`: `client.chat.completions.create(**params)` of the same params, parsed to a ChatCompletion
  (what the adapter did before it sent its own JSON body);
- `raw httpx`: an `httpx.Client.post` of the same JSON body (already encoded), its answer `json.loads`-ed:
  the floor of any adapter in this process.

`--profile` prints the top of a cProfile of the adapter's calls.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import openai_stub
from workers.demo.redis_server import _free_tcp_port
from workers.history.messages import load_contents
from workers.providers import ModelRequest
from workers.providers.openai_compat import OpenAICompatProvider
from workers.providers.retry import RetryPolicy

MODEL = "stub-model"
TOOLS = [
    {
        "functionDeclarations": [
            {
                "name": name,
                "description": f"{name}: does what its name says, within the workspace.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "a path in the workspace"}},
                    "required": ["path"],
                },
            }
            for name in ("read_file", "write_file", "list_directory", "search", "run_command", "edit_file")
        ]
    }
]


def history(kb: int) -> list[dict[str, Any]]:
    """A conversation of about `kb` KB: a task, then turns of a tool call and its (long) output."""
    out: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "Fix the failing test in the repository."}]}]
    turn, size = 0, 0
    line = "def handler(event, context):  # a line of the file that the model asked to read\n"
    while size < kb * 1024:
        output = line * 25
        out.append(
            {"role": "model", "parts": [{"functionCall": {"name": "read_file", "args": {"path": f"m{turn}.py"}}}]}
        )
        out.append(
            {"role": "user", "parts": [{"functionResponse": {"name": "read_file", "response": {"output": output}}}]}
        )
        turn, size = turn + 1, size + len(output) + 60
    return out


def fork_request(kb: int) -> ModelRequest:
    """One step's request of a fork with `kb` KB of history."""
    return ModelRequest(
        fork_id="f-bench",
        step=7,
        model=MODEL,
        system_instruction="You are a coding agent. " * 40,
        tools=TOOLS,
        messages=load_contents(history(kb)),
        generation={"temperature": 0.2, "max_output_tokens": 2048},
        cache_key="session-bench",
    )


def per_call_ms(call: Callable[[], object], calls: int) -> float:
    """This process's CPU milliseconds per call (after a few warm-up calls)."""
    for _ in range(5):
        call()
    began = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - began) * 1000 / calls


def start_stub(port: int) -> subprocess.Popen[bytes]:
    """bench/openai_stub.py on `port`: no latency, room for every request, a tool call in every answer."""
    argv = openai_stub.command(port, k=1000, latency_s=0, calls=1_000_000)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        openai_stub.wait_answering(port, lambda: None if proc.poll() is None else f"exit {proc.returncode}", 20)
    except RuntimeError as exc:
        proc.kill()
        raise SystemExit(f"bench/openai_stub.py: {exc}") from exc
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="timed calls per way (default 300)")
    parser.add_argument("--kb", type=int, default=40, help="KB of messages in the request (default 40)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the adapter's calls")
    args = parser.parse_args()
    port = _free_tcp_port()
    stub = start_stub(port)
    base = f"http://127.0.0.1:{port}/v1"
    adapter = OpenAICompatProvider(api_key="sk-bench", base_url=base, timeout_s=30.0, retry=RetryPolicy())
    sdk = openai.OpenAI(api_key="sk-bench", base_url=base, timeout=30.0, max_retries=0)
    raw = httpx.Client(timeout=30.0)
    try:
        request = fork_request(args.kb)
        params = adapter.params(request)
        body = json.dumps(params).encode()
        headers = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json"}

        def post() -> object:
            return json.loads(raw.post(f"{base}/chat/completions", content=body, headers=headers).content)

        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(lambda: [adapter.generate(request) for _ in range(args.calls)])
            pstats.Stats(profile).sort_stats("cumulative").print_stats(35)
            return
        rows = [
            ("adapter", per_call_ms(lambda: adapter.generate(request), args.calls)),
            ("sdk create()", per_call_ms(lambda: sdk.chat.completions.create(**params), args.calls)),
            ("raw httpx", per_call_ms(post, args.calls)),
        ]
        print(f"one request: {len(body) / 1024:.1f} KB of JSON, {len(params['messages'])} messages; {args.calls} calls")
        print(f"{'way':<14} {'CPU ms/call':>12} {'x raw':>7}")
        floor = rows[-1][1]
        for name, ms in rows:
            print(f"{name:<14} {ms:>12.2f} {ms / floor:>7.2f}")
    finally:
        adapter.close()
        sdk.close()
        raw.close()
        stub.terminate()
        stub.wait()


if __name__ == "__main__":
    main()

// The SSE parser on its own: chunk boundaries anywhere, CRLF and CR line ends, comments, multi-line data.
import assert from "node:assert/strict";
import { test } from "node:test";
import { SseParser } from "../dist/index.js";

const STREAM =
  'id: 1-0\r\nevent: queued\r\ndata: {"kind":"fork"}\r\n\r\n' +
  ": keep-alive\r\n\r\n" +
  "id: 2-0\nevent: step\ndata: first line\ndata:second line\n\n" +
  'id: 3-0\revent: finished\rdata: {"status":"succeeded","note":"é✓"}\r\r';

const EXPECTED = [
  { id: "1-0", event: "queued", data: '{"kind":"fork"}' },
  { id: "2-0", event: "step", data: "first line\nsecond line" },
  { id: "3-0", event: "finished", data: '{"status":"succeeded","note":"é✓"}' },
];

function parseInPieces(text, cuts) {
  const parser = new SseParser();
  const messages = [];
  let start = 0;
  for (const cut of [...cuts, text.length]) {
    messages.push(...parser.push(text.slice(start, cut)));
    start = cut;
  }
  return messages;
}

test("a stream parsed whole gives each message once, comments skipped", () => {
  assert.deepEqual(parseInPieces(STREAM, []), EXPECTED);
});

test("a stream cut at any one place, even inside a CRLF, gives the same messages", () => {
  for (let cut = 1; cut < STREAM.length; cut++) {
    assert.deepEqual(
      parseInPieces(STREAM, [cut]),
      EXPECTED,
      `cut at ${cut}: ${JSON.stringify(STREAM.slice(cut - 2, cut + 2))}`,
    );
  }
});

test("a stream fed one character at a time gives the same messages", () => {
  const cuts = Array.from({ length: STREAM.length - 1 }, (_, i) => i + 1);
  assert.deepEqual(parseInPieces(STREAM, cuts), EXPECTED);
});

test("a message without its blank line is not given, and one without data is dropped", () => {
  const parser = new SseParser();
  assert.deepEqual(parser.push("id: 9-0\nevent: ping\n\nid: 10-0\ndata: x\n"), []);
  assert.deepEqual(parser.push("\n"), [{ id: "10-0", event: "message", data: "x" }]);
});

test("a message that never ends is refused past its bound", () => {
  const parser = new SseParser();
  const line = `data: ${"x".repeat(1024 * 1024)}\n`;
  assert.throws(() => {
    for (let i = 0; i < 20; i++) parser.push(line);
  }, /over \d+ characters/);
});

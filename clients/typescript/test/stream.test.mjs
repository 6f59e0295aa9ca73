// Event streams that break off and resume with Last-Event-ID, and parked forks approved or denied.
import assert from "node:assert/strict";
import { createServer, request } from "node:http";
import { test } from "node:test";
import { AGENT, API_URL, FINAL_TEXT, allEvents, client, parent, waitStatus } from "./live.mjs";

test("a stream the client stops mid-way resumes after its last event: no duplicate, no gap", async () => {
  const api = client();
  const { fork_id: forkId } = await api.launch({ parent: parent(), agent: AGENT });

  const first = [];
  for await (const event of api.events(forkId)) {
    first.push(event);
    if (first.length === 2) break; // closes the connection
  }
  const rest = await allEvents(api, forkId, { lastEventId: first.at(-1).id });
  const whole = await allEvents(api, forkId);

  assert.equal(rest.at(-1).type, "finished");
  assert.deepEqual([...first, ...rest], whole);
  assert.deepEqual(await allEvents(api, forkId, { lastEventId: whole.at(-1).id }), []);
});

test("a connection dropped mid-message is resumed by the iterator itself: no duplicate, no gap", async (t) => {
  // Given a proxy that cuts the first connection a few bytes into the second event
  const proxy = await cuttingProxy(new URL(API_URL));
  t.after(() => proxy.close());
  const direct = client();
  const { fork_id: forkId } = await direct.launch({ parent: parent(), agent: AGENT });

  // When the events are read through it
  const events = await allEvents(client({ baseUrl: proxy.url }), forkId, { reconnectDelayMs: 10 });

  // Then they are the fork's events, each once, over two connections, the second with Last-Event-ID
  assert.deepEqual(events, await allEvents(direct, forkId));
  assert.equal(proxy.requests.length, 2);
  assert.equal(proxy.requests[0]["last-event-id"], undefined);
  assert.equal(proxy.requests[1]["last-event-id"], events[0].id);
});

test("a parked fork is approved, then another denied, and each goes on to its answer", async () => {
  const api = client();
  const launch = () => api.launch({ parent: parent(), agent: AGENT, options: { approval_policy: "park" } });
  const [approved, denied] = [(await launch()).fork_id, (await launch()).fork_id];

  for (const forkId of [approved, denied]) {
    const state = await waitStatus(api, forkId, "awaiting_approval");
    assert.deepEqual(
      state.pending_approval.map((call) => [call.call_id, call.name]),
      [["w1", "write_file"]],
    );
    const outcome = await api.result(forkId, { wait: 30 });
    assert.equal(outcome.ended, false);
    assert.equal(outcome.state.status, "awaiting_approval");
  }
  await assert.rejects(api.approve(approved, "nope"), { status: 409, message: /no pending call 'nope'/ });
  const yes = await api.approve(approved, "w1");
  const no = await api.deny(denied, "w1", "not on main");

  assert.deepEqual(yes, { fork_id: approved, call_id: "w1", decision: "approve", outcome: "queued", status: "queued" });
  assert.equal(no.decision, "deny");
  for (const forkId of [approved, denied]) {
    const events = await allEvents(api, forkId);
    assert.ok(events.some((event) => event.type === "awaiting_approval"));
    assert.equal(events.at(-1).data.status, "succeeded");
    assert.equal((await api.result(forkId)).result.output, FINAL_TEXT);
  }
  const steps = (await api.transcript(denied)).steps.filter((step) => step.kind === "approval");
  assert.deepEqual(
    steps.map((step) => [step.decision, step.reason]),
    [["deny", "not on main"]],
  );
});

/** An HTTP proxy to `target` that sends the first response's first event and 5 bytes of the next, then drops it. */
async function cuttingProxy(target) {
  const requests = [];
  const server = createServer((incoming, outgoing) => {
    const first = requests.length === 0;
    requests.push(incoming.headers);
    const headers = { ...incoming.headers, host: target.host };
    const upstream = request(new URL(incoming.url, target), { method: incoming.method, headers }, (answer) => {
      outgoing.writeHead(answer.statusCode, answer.headers);
      if (!first) return void answer.pipe(outgoing);
      let seen = Buffer.alloc(0);
      let cut = false;
      answer.on("data", (chunk) => {
        if (cut) return; // a chunk already read when the upstream was destroyed: the cut is made once
        seen = Buffer.concat([seen, chunk]);
        const end = seen.indexOf("\n\n");
        if (end < 0 || seen.length < end + 2 + 5) return;
        cut = true;
        answer.destroy();
        // mid-message, once the bytes are out: the client must drop the partial event and resume
        outgoing.write(seen.subarray(0, end + 2 + 5), () => outgoing.socket.destroy());
      });
    });
    incoming.pipe(upstream);
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const close = () => {
    server.closeAllConnections();
    return new Promise((resolve) => server.close(resolve));
  };
  return { url: `http://127.0.0.1:${server.address().port}`, requests, close };
}

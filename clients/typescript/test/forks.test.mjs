// The client against a live `forkq serve` and worker: launch, events, result, state, a session's forks,
// errors, cancel, messages, notification, transcript, the listings, and the generated types' freshness.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { ForkqApiError } from "../dist/index.js";
import { generate } from "../scripts/schema.mjs";
import { AGENT, API_URL, FINAL_TEXT, TOKEN, allEvents, client, parent, waitStatus } from "./live.mjs";

test("a launched fork streams its events to finished, then gives its result, state and session listing", async () => {
  const api = client();
  const snapshot = parent();

  const launched = await api.launch({ parent: snapshot, agent: AGENT });
  assert.equal(launched.status, "queued");
  const events = await allEvents(api, launched.fork_id);

  const types = events.map((event) => event.type);
  assert.equal(types[0], "queued");
  assert.equal(types.at(-1), "finished");
  assert.ok(types.includes("started") && types.includes("model_call"), types.join(","));
  assert.equal(new Set(events.map((event) => event.id)).size, events.length);
  assert.equal(events.at(-1).data.status, "succeeded");
  const outcome = await api.result(launched.fork_id, { wait: 10 });
  assert.equal(outcome.ended, true);
  assert.equal(outcome.result.output, FINAL_TEXT);
  assert.equal(outcome.result.usage.model_calls, 2);
  const state = await api.get(launched.fork_id);
  assert.equal(state.status, "succeeded");
  assert.equal(state.description, AGENT.description);
  const listed = await api.list(snapshot.session_id);
  assert.deepEqual(
    listed.forks.map((fork) => [fork.fork_id, fork.status]),
    [[launched.fork_id, "succeeded"]],
  );
});

test("an invalid launch is a ForkqApiError with the status, the API's message and the field", async () => {
  const error = await client()
    .launch({ parent: parent(), agent: { ...AGENT, fork_turns: "0" } })
    .then(
      () => assert.fail("the launch was not refused"),
      (error) => error,
    );

  assert.ok(error instanceof ForkqApiError, String(error));
  assert.equal(error.status, 422);
  assert.equal(error.field, "fork_turns");
  assert.match(error.message, /fork_turns/);
});

test("a session budget pauses its fork before a model call, and raising it resumes the fork to its end", async () => {
  const api = client();
  const snapshot = parent();
  await assert.rejects(api.setBudget(snapshot.session_id, -1), { status: 422, field: "tokens" });
  const none = await api.setBudget(snapshot.session_id, 0);
  assert.deepEqual([none.tokens, none.used, none.left, none.resumed], [0, 0, 0, []]);

  const launched = await api.launch({ parent: snapshot, agent: AGENT, maxTokens: 1_000_000 });
  const paused = await waitStatus(api, launched.fork_id, "paused");

  assert.equal(paused.waiting_for.reason, "budget_reached");
  assert.match(paused.waiting_for.detail, /budget of session/);
  const budget = await api.forkBudget(launched.fork_id);
  assert.deepEqual([budget.max_tokens, budget.used, budget.session.tokens], [1_000_000, 0, 0]);
  const raised = await api.setBudget(snapshot.session_id, 1_000_000);
  assert.deepEqual(raised.resumed, [launched.fork_id]);
  const outcome = await api.result(launched.fork_id, { wait: 20 });
  assert.equal(outcome.ended, true);
  assert.equal(outcome.result.output, FINAL_TEXT);
  const read = await api.budget(snapshot.session_id);
  assert.equal(read.used, (await api.forkBudget(launched.fork_id)).used);
  assert.ok(read.used > 0 && read.left === 1_000_000 - read.used, JSON.stringify(read));
});

test("a wrong token is a 401 ForkqApiError, an unknown fork a 404, no server a status 0", async () => {
  await assert.rejects(client({ token: "not-a-token" }).get("f-anything"), { name: "ForkqApiError", status: 401 });
  await assert.rejects(client().get("f-never-launched"), { status: 404, message: /f-never-launched/ });
  await assert.rejects(client().get("../healthz"), { status: 0, field: "fork_id" });
  const nowhere = client({ baseUrl: "http://127.0.0.1:9", timeoutMs: 2_000 });
  await assert.rejects(nowhere.agents(), { status: 0, message: /is forkq serve running/ });
});

test("a request that outlives its timeout, or its caller's signal, is given up", async () => {
  const forkId = (await client().launch({ parent: parent(), agent: AGENT, options: { approval_policy: "park" } }))
    .fork_id;
  const slow = client({ timeoutMs: 1 });
  await assert.rejects(slow.agents(), { status: 0, message: /no answer within 1 ms/ });
  const controller = new AbortController();
  setTimeout(() => controller.abort(new Error("the caller gave up")), 100);
  // a parked fork's result comes at once: wait on the events of a fork that is parked instead
  const stream = allEvents(client(), forkId, { signal: controller.signal });
  await assert.rejects(stream, /the caller gave up/);
  await client().cancel(forkId);
});

test("a cancelled fork says so, twice, and its stream ends with finished cancelled", async () => {
  const api = client();
  const { fork_id: forkId } = await api.launch({
    parent: parent(),
    agent: AGENT,
    options: { approval_policy: "park" },
  });

  assert.deepEqual(await api.cancel(forkId), { fork_id: forkId, status: "cancelled" });
  assert.deepEqual(await api.cancel(forkId), { fork_id: forkId, status: "cancelled" });

  const events = await allEvents(api, forkId);
  assert.deepEqual(events.at(-1).data.status, "cancelled");
  assert.deepEqual(await api.send(forkId, "too late").catch((error) => error.status), 409);
});

test("a message continues a succeeded fork; its notification and transcript tell what it did", async () => {
  const api = client();
  const { fork_id: forkId } = await api.launch({ parent: parent(), agent: AGENT });
  await assert.rejects(api.notification(forkId), { status: 409 });
  assert.equal((await api.result(forkId, { wait: 20 })).result.status, "succeeded");

  const notification = await api.notification(forkId);
  const transcript = await api.transcript(forkId, { maxChars: 20 });
  const sent = await api.send(forkId, "And then?");

  assert.match(notification.notification, /^<task-notification>/);
  assert.equal(transcript.seed.fork_turns, "3");
  assert.deepEqual(transcript.steps.map((step) => step.kind).slice(0, 3), ["model", "tool_result", "model"]);
  assert.deepEqual(sent, { fork_id: forkId, outcome: "continued", waiting: 1 });
  await assert.rejects(api.send(forkId, " "), { status: 422, field: "message" });
});

test("the agents, the providers and the server's health are listed", async () => {
  const api = client();
  const agents = (await api.agents()).items.map((agent) => agent.name);
  const providers = (await api.providers()).items.map((provider) => provider.name);

  assert.ok(agents.includes("general-purpose"), agents.join(","));
  assert.deepEqual(providers, ["spawn", "fork"]);
  assert.deepEqual(await api.health(), { ok: true, redis_reachable: true, redis_fit: true });
});

test("src/schema.ts is what the server's /openapi.json generates (else: make ts-schema)", async () => {
  const response = await fetch(`${API_URL}/openapi.json`, { headers: { Authorization: `Bearer ${TOKEN}` } });
  assert.equal(response.status, 200);
  const committed = readFileSync(new URL("../src/schema.ts", import.meta.url), "utf8");

  assert.equal(generate(await response.json()), committed, "src/schema.ts is stale: run `make ts-schema`");
});

// A whole session cancelled through the client against a live `forkq serve` and worker: its parked forks end
// cancelled, a launch into it is a 409 naming the fix, another session is left alone.
import assert from "node:assert/strict";
import { test } from "node:test";
import { AGENT, client, parent, waitStatus } from "./live.mjs";

const PARK = { approval_policy: "park" };

test("a session cancel ends its forks, refuses launches into it with 409, and leaves another session alone", async () => {
  const api = client();
  const session = parent();
  const other = parent();
  const first = (await api.launch({ parent: session, agent: AGENT, options: PARK })).fork_id;
  const second = (await api.launch({ parent: session, agent: AGENT, options: PARK })).fork_id;
  const elsewhere = (await api.launch({ parent: other, agent: AGENT, options: PARK })).fork_id;
  for (const forkId of [first, second, elsewhere]) await waitStatus(api, forkId, "awaiting_approval");

  const outcome = await api.cancelSession(session.session_id);
  const again = await api.cancelSession(session.session_id);

  assert.equal(outcome.session, session.session_id);
  assert.deepEqual([outcome.cancelled, outcome.already_ended], [2, 0]);
  assert.deepEqual([...outcome.forks].sort(), [first, second].sort());
  assert.ok(outcome.refused_until_ms > Date.now(), String(outcome.refused_until_ms));
  assert.deepEqual([again.cancelled, again.forks, again.already_ended], [0, [], 2]);
  const result = await api.result(first);
  assert.equal(result.ended && result.result.status, "cancelled");
  await assert.rejects(api.launch({ parent: session, agent: AGENT }), {
    name: "ForkqApiError",
    status: 409,
    field: "session_id",
    message: /was cancelled.*new session id/s,
  });
  assert.equal((await api.get(elsewhere)).status, "awaiting_approval");
  await api.cancel(elsewhere);
});

test("a session id that cannot be one is refused before any request is sent", async () => {
  await assert.rejects(client().cancelSession(""), { name: "ForkqApiError", status: 0, field: "session_id" });
  await assert.rejects(client().cancelSession(".."), { status: 0, field: "session_id" });
});

// What the live tests share: a client of the server under test and the parent snapshot to launch from.
// tests/e2e/test_typescript_client.py starts `forkq serve` and a worker whose scripted model answers every fork
// alike: first a write_file call `w1` (parked, or denied, since the parent's approval mode is `default`),
// then the final text "all done"; it passes the server and the snapshot in these variables.
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { ForkqClient } from "../dist/index.js";

function required(name) {
  const value = process.env[name];
  if (!value) {
    throw new Error(`${name} is not set: the live tests run through tests/e2e/test_typescript_client.py, which sets it`);
  }
  return value;
}

export const API_URL = required("FORKQ_TEST_API_URL");
export const TOKEN = required("FORKQ_TEST_API_TOKEN");
export const FINAL_TEXT = "all done";

/** A client of the server under test. */
export function client(options = {}) {
  return new ForkqClient({ baseUrl: API_URL, token: TOKEN, timeoutMs: 20_000, ...options });
}

/** The example parent snapshot, in a session of its own, working in the test's directory. */
export function parent() {
  const snapshot = JSON.parse(readFileSync(required("FORKQ_TEST_PARENT"), "utf8"));
  return { ...snapshot, session_id: `ts-${randomUUID()}`, cwd: required("FORKQ_TEST_CWD"), approval_mode: "default" };
}

/** The Agent tool call's arguments of a fork that inherits the parent's last three turns. */
export const AGENT = {
  description: "audit the limiter",
  prompt: "Audit the rate limiter.",
  subagent_type: "fork",
  fork_turns: "3",
};

/** Every event of a fork, from its first to `finished`. */
export async function allEvents(api, forkId, options = {}) {
  const events = [];
  for await (const event of api.events(forkId, options)) events.push(event);
  return events;
}

/** Poll the fork's state until it has `status`. */
export async function waitStatus(api, forkId, status, timeoutMs = 20_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const state = await api.get(forkId);
    if (state.status === status) return state;
    if (Date.now() > deadline)
      throw new Error(`fork ${forkId} is ${state.status}, not ${status}, after ${timeoutMs} ms`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

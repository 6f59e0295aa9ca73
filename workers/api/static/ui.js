// forkq's web view (docs/api.md, "Web view"). It reads and acts on forks through the /v1 endpoints only,
// with the token a person typed, kept in this tab's sessionStorage. Everything the server returns goes on the
// page through textContent, never as markup: a fork's text is written by models and tools.
"use strict";

(() => {
  const TOKEN_KEY = "forkq.token";
  const MAX_TOKEN_CHARS = 4096; // the server reads no longer token
  const LIST_POLL_MS = 2000; // a session has no event stream of its own: its list is polled
  const LIST_LIMIT = 200;
  const TRANSCRIPT_CHARS = 2000; // of each tool result
  const MAX_EVENT_CHARS = 1 << 20; // a stream that sends more without ending an event is broken
  const RETRY_MS = [500, 1000, 2000, 5000, 10000];
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;

  // the signed-in token (null: signed out; "": a server that needs none), the session shown, the fork followed
  const view = { token: null, session: "", pollTimer: 0, track: null };

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // ── calls to the API ──────────────────────────────────────────────────────────────────────

  function headers(token, extra) {
    const values = Object.assign({ Accept: "application/json" }, extra || {});
    if (token) values.Authorization = "Bearer " + token;
    return values;
  }

  async function errorOf(response) {
    const body = await response.json().catch(() => null);
    const message = body && body.error && body.error.message ? body.error.message : "HTTP " + response.status;
    return new ApiError(response.status, message);
  }

  async function request(token, path, init) {
    try {
      return await fetch(path, Object.assign({}, init, { headers: headers(token, init && init.headers) }));
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError(0, "the server did not answer (" + err.message + "); check that forkq serve is running");
    }
  }

  // GET `path` (or POST `body` as JSON) with the signed-in token; its JSON, or an ApiError with the server's message
  async function api(path, options) {
    const init = { method: "GET", headers: {} };
    if (options && "body" in options) {
      init.method = "POST";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(options.body);
    }
    const response = await request(view.token, path, init);
    if (!response.ok) {
      const error = await errorOf(response);
      if (response.status === 401) signOut("The server refused the token: " + error.message);
      throw error;
    }
    return response.json();
  }

  // ── sign in and out ────────────────────────────────────────────────────────────────────────

  async function signIn(event) {
    event.preventDefault();
    const token = $("token").value.trim();
    if (!token) return loginError("Enter a token: one of the server's FORKQ_API_TOKENS.");
    if (token.length > MAX_TOKEN_CHARS) return loginError("This token is longer than 4096 characters: no server token is.");
    if (!/^[\x21-\x7e]+$/.test(token)) return loginError("A token holds visible ASCII characters only, without spaces.");
    $("sign-in").disabled = true;
    try {
      const response = await request(token, "v1/providers");
      if (response.ok) {
        sessionStorage.setItem(TOKEN_KEY, token);
        $("token").value = "";
        enter(token);
      } else {
        const error = await errorOf(response);
        const refused = response.status === 401 ? "The server refused this token: " : "The server answered " + response.status + ": ";
        loginError(refused + error.message);
      }
    } catch (err) {
      loginError(err.message);
    } finally {
      $("sign-in").disabled = false;
    }
  }

  function loginError(message) {
    $("login-error").textContent = message;
  }

  function enter(token) {
    view.token = token;
    $("login").hidden = true;
    $("main").hidden = false;
    $("sign-out").hidden = !token;
    if ($("session").value.trim()) showSession();
    else $("session").focus();
  }

  function signOut(message) {
    sessionStorage.removeItem(TOKEN_KEY);
    view.token = null;
    view.session = "";
    clearTimeout(view.pollTimer);
    closeFork();
    $("forks").replaceChildren();
    $("cancel-session").hidden = true;
    $("session-message").textContent = "";
    $("main").hidden = true;
    $("sign-out").hidden = true;
    $("login").hidden = false;
    loginError(message || "");
    $("token").focus();
  }

  // ── a session's forks ──────────────────────────────────────────────────────────────────────

  function showSession(event) {
    if (event) event.preventDefault();
    const session = $("session").value.trim();
    if (!session) return mainError("Enter a session id: the session_id of the parent the forks were launched from.");
    if (session !== view.session) {
      closeFork();
      $("forks").replaceChildren();
    }
    view.session = session;
    $("cancel-session").hidden = false;
    $("session-message").textContent = "";
    const url = new URL(location.href);
    url.searchParams.set("session", session);
    history.replaceState(null, "", url);
    pollForks();
  }

  async function pollForks() {
    clearTimeout(view.pollTimer);
    const session = view.session;
    let again = true;
    try {
      const body = await api("v1/sessions/" + enc(session) + "/forks?limit=" + LIST_LIMIT);
      if (session !== view.session) return;
      mainError("");
      renderForks(body.forks);
    } catch (err) {
      if (session !== view.session) return;
      mainError(err.message);
      again = err.status !== 401 && err.status !== 422; // a refused token or session id does not mend by waiting
    }
    if (again && view.token !== null) view.pollTimer = setTimeout(pollForks, LIST_POLL_MS);
  }

  function mainError(message) {
    $("main-error").textContent = message;
  }

  function renderForks(forks) {
    const list = $("forks");
    $("forks-empty").textContent = forks.length ? "" : "No forks of this session (or none left in Redis).";
    const rows = new Map([...list.children].map((row) => [row.dataset.forkId, row]));
    forks.forEach((fork, index) => {
      const row = rows.get(fork.fork_id) || forkRow(fork.fork_id);
      fillForkRow(row, fork);
      if (list.children[index] !== row) list.insertBefore(row, list.children[index] || null);
      rows.delete(fork.fork_id);
    });
    rows.forEach((row) => row.remove());
    const track = view.track;
    const shown = track && forks.find((fork) => fork.fork_id === track.forkId);
    if (shown && shown.status !== track.status) {
      scheduleRefresh(track);
      if (!track.following && !TERMINAL.has(shown.status)) follow(track); // a continued fork: events again
    }
  }

  function forkRow(forkId) {
    const row = document.createElement("li");
    row.dataset.forkId = forkId;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "fork-row";
    for (const name of ["status", "description", "mono", "time"]) button.append(span(name));
    button.addEventListener("click", () => selectFork(forkId));
    row.append(button);
    return row;
  }

  function fillForkRow(row, fork) {
    const [status, description, id, time] = row.firstChild.children;
    setStatus(status, fork.status);
    description.textContent = fork.name ? fork.name + ": " + fork.description : fork.description || "(no description)";
    id.textContent = fork.fork_id + " · " + fork.kind;
    time.textContent = fork.updated_ms ? new Date(fork.updated_ms).toLocaleTimeString() : "";
    row.firstChild.setAttribute("aria-current", String(!!view.track && view.track.forkId === fork.fork_id));
  }

  // ── one fork: its state, usage, pending calls, transcript, live ────────────────────────────

  function selectFork(forkId) {
    closeFork();
    const track = { forkId, status: null, lastEventId: null, seq: -1, pendingKey: null, following: false };
    track.controller = new AbortController();
    view.track = track;
    for (const row of $("forks").children) {
      row.firstChild.setAttribute("aria-current", String(row.dataset.forkId === forkId));
    }
    for (const id of ["steps", "pending-calls", "usage"]) $(id).replaceChildren();
    for (const id of ["fork-title", "fork-status", "fork-kind", "fork-attempt", "fork-error", "fork-message", "fork-waiting", "output"]) {
      $(id).textContent = "";
    }
    $("pending").hidden = true;
    $("output-panel").hidden = true;
    $("fork-id").textContent = forkId;
    $("fork").hidden = false;
    follow(track);
    scheduleRefresh(track);
  }

  function closeFork() {
    if (view.track) view.track.controller.abort();
    view.track = null;
    $("fork").hidden = true;
  }

  // Follows the fork's events (GET /v1/forks/{id}/events) with fetch, not EventSource, which cannot send the
  // token; resumes after a lost connection with Last-Event-ID. Each event refreshes the fork's view.
  async function follow(track) {
    track.following = true;
    let attempt = 0;
    try {
      while (!track.controller.signal.aborted) {
        const extra = { Accept: "text/event-stream" };
        if (track.lastEventId) extra["Last-Event-ID"] = track.lastEventId;
        try {
          const response = await request(view.token, "v1/forks/" + enc(track.forkId) + "/events", {
            headers: extra,
            signal: track.controller.signal,
          });
          if (!response.ok) {
            const error = await errorOf(response);
            if (response.status === 401) return signOut("The server refused the token: " + error.message);
            streamNote(track, "not followed: " + error.message);
            if (response.status === 404 || response.status === 422) return;
          } else {
            attempt = 0;
            streamNote(track, "live");
            if (await readEvents(track, response.body)) return streamNote(track, "ended");
          }
        } catch (err) {
          if (track.controller.signal.aborted) return;
        }
        streamNote(track, "reconnecting…");
        await sleep(RETRY_MS[Math.min(attempt++, RETRY_MS.length - 1)]);
      }
    } finally {
      track.following = false;
    }
  }

  // reads SSE messages until the stream ends; true once the fork's `finished` event came
  async function readEvents(track, body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done || track.controller.signal.aborted) return false;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = parseEvent(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
        if (!event) continue; // a keep-alive comment
        if (event.id) track.lastEventId = event.id;
        streamNote(track, "live · last event: " + event.type);
        scheduleRefresh(track);
        if (event.type === "finished") {
          reader.cancel().catch(() => {});
          return true;
        }
      }
      if (buffer.length > MAX_EVENT_CHARS) throw new Error("an event stream message over 1 MiB");
    }
  }

  function parseEvent(block) {
    const event = { id: null, type: "message", data: "" };
    let fields = 0;
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "id") event.id = value;
      else if (field === "event") event.type = value;
      else if (field === "data") event.data += value;
      fields += 1;
    }
    return fields ? event : null;
  }

  function streamNote(track, text) {
    if (view.track === track) $("fork-stream").textContent = text;
  }

  // one refresh at a time per fork; events that come during one ask for one more after it
  async function scheduleRefresh(track) {
    if (track.refreshing) {
      track.dirty = true;
      return;
    }
    track.refreshing = true;
    try {
      do {
        track.dirty = false;
        await refresh(track);
      } while (track.dirty && view.track === track);
    } finally {
      track.refreshing = false;
    }
  }

  async function refresh(track) {
    const base = "v1/forks/" + enc(track.forkId);
    try {
      const [state, transcript, budget] = await Promise.all([
        api(base), api(base + "/transcript?max_chars=" + TRANSCRIPT_CHARS), api(base + "/budget"),
      ]);
      const result = TERMINAL.has(state.status) ? await api(base + "/result") : null;
      const changes = result ? await api(base + "/changes").catch(() => null) : null;
      if (view.track !== track) return;
      renderState(track, state);
      renderSteps(track, transcript.steps);
      renderUsage(transcript.steps, result);
      renderBudget(budget);
      renderOutput(result);
      renderChanges(changes);
    } catch (err) {
      if (view.track === track) forkMessage(err.message, true);
    }
  }

  function forkMessage(text, isError) {
    $("fork-message").textContent = text;
    $("fork-message").className = isError ? "error" : "";
  }

  function renderState(track, state) {
    track.status = state.status;
    $("fork-title").textContent = state.description || state.fork_id;
    setStatus($("fork-status"), state.status);
    $("fork-kind").textContent = state.kind;
    $("fork-tenant").textContent = state.tenant || "default";
    $("fork-attempt").textContent = String(state.attempt);
    $("fork-error").textContent = state.error || "—";
    $("cancel").hidden = TERMINAL.has(state.status);
    const row = [...$("forks").children].find((item) => item.dataset.forkId === state.fork_id);
    if (row) setStatus(row.firstChild.children[0], state.status);
    // a fork cancelled while parked keeps the list of the calls it waited on: only a fork waiting on them shows them
    const wait = state.waiting_for || null;
    renderWaiting(state.fork_id, wait);
    renderPending(track, wait && wait.kind === "approval" ? state.pending_approval || [] : []);
  }

  // what a fork waits for (its state's `waiting_for`), in the page's words: never under "Error"
  function renderWaiting(forkId, wait) {
    const shown = $("fork-waiting");
    shown.hidden = wait === null;
    if (wait === null) return shown.replaceChildren();
    if (wait.kind === "approval") {
      const calls = wait.calls.map((call) => call.name + " (" + call.call_id + ")").join(", ");
      return (shown.textContent = "Waiting for your approval of " + calls + ": approve or deny below.");
    }
    if (wait.kind === "model") {
      return (shown.textContent = "Waiting for model " + wait.model + ": its " + wait.limit + " limit (FORKQ_MODEL_LIMITS).");
    }
    if (wait.detail) return (shown.textContent = "Paused: " + wait.reason + ": " + wait.detail);
    shown.textContent = "Paused: " + wait.reason + ". Once that is fixed, resume it (forkq resume " + forkId + ").";
  }

  function renderPending(track, calls) {
    const key = calls.map((call) => call.call_id).join("\n");
    if (key === track.pendingKey) return; // rebuilt only when the calls change: a reason being typed stays
    track.pendingKey = key;
    $("pending").hidden = calls.length === 0;
    $("pending-calls").replaceChildren(...calls.map((call) => pendingCall(track, call)));
  }

  function pendingCall(track, call) {
    const item = document.createElement("li");
    item.dataset.callId = call.call_id;
    const title = document.createElement("p");
    title.append(span("name", call.name), " ", span("mono", call.call_id), " ", span("hint", "step " + (call.step + 1)));
    const approve = button("Approve", "approve");
    const reason = document.createElement("input");
    reason.maxLength = 10000; // the server's bound on a reason
    reason.placeholder = "reason (optional, the model reads it)";
    reason.setAttribute("aria-label", "Reason for denying " + call.call_id);
    const deny = button("Deny", "danger");
    const buttons = [approve, deny];
    approve.addEventListener("click", () => decide(track, call.call_id, { decision: "approve" }, buttons));
    deny.addEventListener("click", () => {
      const body = { decision: "deny" };
      if (reason.value.trim()) body.reason = reason.value.trim();
      decide(track, call.call_id, body, buttons);
    });
    const actions = document.createElement("div");
    actions.className = "actions";
    actions.append(approve, reason, deny);
    item.append(title, pre(JSON.stringify(call.args, null, 2)), actions);
    return item;
  }

  async function decide(track, callId, body, buttons) {
    buttons.forEach((b) => (b.disabled = true));
    try {
      const answer = await api("v1/forks/" + enc(track.forkId) + "/approvals/" + enc(callId), { body });
      const next = answer.outcome === "queued" ? "the fork goes on." : "other calls still wait.";
      if (view.track === track) forkMessage((body.decision === "approve" ? "Approved " : "Denied ") + callId + ": " + next);
    } catch (err) {
      if (view.track === track) forkMessage(err.message, true);
      buttons.forEach((b) => (b.disabled = false));
    }
    scheduleRefresh(track);
  }

  async function cancelFork() {
    const track = view.track;
    if (!track || !window.confirm("Cancel fork " + track.forkId + "? A cancelled fork does not go on.")) return;
    $("cancel").disabled = true;
    try {
      const answer = await api("v1/forks/" + enc(track.forkId) + "/cancel", { body: undefined });
      if (view.track === track) forkMessage("Cancel sent: the fork is " + answer.status + ".");
    } catch (err) {
      if (view.track === track) forkMessage(err.message, true);
    } finally {
      $("cancel").disabled = false;
    }
    scheduleRefresh(track);
  }

  // every fork of the session and its nested subagents; launches into it are refused for a while after
  async function cancelSession() {
    const session = view.session;
    const question = "Cancel every fork of session " + session + ", nested subagents too? Launches into it are " +
      "then refused for a while.";
    if (!session || !window.confirm(question)) return;
    $("cancel-session").disabled = true;
    try {
      const answer = await api("v1/sessions/" + enc(session) + "/cancel", { body: undefined });
      if (session === view.session) {
        $("session-message").textContent = "Session cancelled: " + answer.cancelled + " forks cancelled, " +
          answer.already_ended + " had already ended.";
        pollForks();
      }
    } catch (err) {
      if (session === view.session) $("session-message").textContent = err.message;
    } finally {
      $("cancel-session").disabled = false;
    }
  }

  // the journal only grows: steps already shown stay, the new ones are appended
  function renderSteps(track, steps) {
    const list = $("steps");
    for (const step of steps) {
      if (step.seq <= track.seq) continue;
      list.append(stepItem(step));
      track.seq = step.seq;
    }
  }

  function stepItem(step) {
    const item = document.createElement("li");
    item.className = "step " + step.kind;
    item.dataset.kind = step.kind;
    const head = document.createElement("p");
    head.className = "step-head";
    head.textContent = "Step " + (step.step + 1) + " · " + stepTitle(step);
    item.append(head);
    if (step.kind === "model") {
      if (step.text) item.append(pre(step.text, "text"));
      for (const call of step.calls || []) {
        item.append(pre("→ " + call.name + " (" + call.call_id + ") " + JSON.stringify(call.args, null, 2), "call"));
      }
    } else if (step.kind === "tool_result") {
      item.append(pre(step.error != null ? step.error : step.output, step.error != null ? "error" : "output"));
      if (step.truncated) item.append(span("hint", "cut: the first " + TRANSCRIPT_CHARS + " of " + step.chars + " characters"));
      if (step.changed && step.changed.length) item.append(span("hint changed", "changed: " + step.changed.join(", ")));
    } else if (step.kind === "approval" && step.reason) {
      item.append(pre(step.reason, "reason"));
    } else if (step.kind === "feedback" || step.kind === "message") {
      item.append(pre(step.text, "text"));
    }
    return item;
  }

  function stepTitle(step) {
    if (step.kind === "model") {
      return "model: " + step.input_tokens + " tokens in, " + step.output_tokens + " out" +
        (step.finish_reason ? " (" + step.finish_reason + ")" : "");
    }
    if (step.kind === "tool_result") return (step.error != null ? "error of " : "result of ") + step.name + " (" + step.call_id + ")";
    if (step.kind === "approval") {
      // the audit: who decided (an API token's id, or `local`), of which tenant, and when
      const who = step.decided_by ? " by " + step.decided_by + (step.decided_tenant ? " (" + step.decided_tenant + ")" : "") : "";
      const at = step.decided_ms ? " at " + new Date(step.decided_ms).toISOString() : "";
      return (step.decision === "approve" ? "approved " : "denied ") + step.name + " (" + step.call_id + ")" + who + at;
    }
    if (step.kind === "message") return "message delivered to the fork";
    return "feedback: the answer did not match the output schema";
  }

  // live, the sums of the transcript's steps; once ended, the result's own usage
  function renderUsage(steps, result) {
    const models = steps.filter((step) => step.kind === "model");
    const sum = (name) => models.reduce((total, step) => total + (step[name] || 0), 0);
    const usage = result ? result.usage : {
      input_tokens: sum("input_tokens"),
      output_tokens: sum("output_tokens"),
      model_calls: models.length,
      tool_uses: steps.filter((step) => step.kind === "tool_result").length,
    };
    const rows = [];
    for (const [name, label] of [
      ["input_tokens", "Input tokens"], ["cached_input_tokens", "of them cached"], ["output_tokens", "Output tokens"],
      ["total_tokens", "Total tokens"], ["model_calls", "Model calls"], ["tool_uses", "Tool calls"],
      ["duration_ms", "Duration (ms)"],
    ]) {
      if (usage[name] === undefined) continue;
      const term = document.createElement("dt");
      term.textContent = label;
      const value = document.createElement("dd");
      value.textContent = String(usage[name]);
      value.dataset.usage = name;
      rows.push(term, value);
    }
    $("usage").replaceChildren(...rows);
  }

  // the fork's own max_tokens and its session's budget (GET /v1/forks/{id}/budget): limit, used, left
  function renderBudget(budget) {
    const line = (limit, used, left) =>
      limit === null ? "no limit; used " + used + " tokens" : "used " + used + " of " + limit + " tokens, " + left + " left";
    const rows = [];
    for (const [name, label, text] of [
      ["max_tokens", "Fork (max_tokens)", line(budget.max_tokens, budget.used, budget.left)],
      ["session", "Session " + budget.session.session, line(budget.session.tokens, budget.session.used, budget.session.left)],
    ]) {
      const term = document.createElement("dt");
      term.textContent = label;
      const value = document.createElement("dd");
      value.textContent = text;
      value.dataset.budget = name;
      rows.push(term, value);
    }
    $("budget").replaceChildren(...rows);
  }

  function renderOutput(result) {
    $("output-panel").hidden = !result;
    if (result) $("output").textContent = result.error ? "Error: " + result.error : result.output || "";
  }

  // a snapshot fork's changes to the parent's files, once it ended: the files, then the patch (as text)
  function renderChanges(changes) {
    const files = changes && Array.isArray(changes.files) ? changes.files : [];
    $("changes-panel").hidden = !changes;
    const list = $("changed-files");
    list.replaceChildren();
    for (const file of files) {
      const item = document.createElement("li");
      const counts = file.binary ? "binary" : "+" + file.added + " −" + file.removed;
      item.append(span("status", file.status), " ", span("mono", file.path), " ", span("hint", counts));
      list.append(item);
    }
    $("changes-empty").hidden = files.length > 0;
    $("diff").textContent = changes && typeof changes.patch === "string" ? changes.patch : "";
    $("diff").hidden = !files.length;
  }

  // ── small helpers ──────────────────────────────────────────────────────────────────────────

  function span(className, text) {
    const element = document.createElement("span");
    element.className = className;
    if (text !== undefined) element.textContent = text;
    return element;
  }

  function pre(text, className) {
    const element = document.createElement("pre");
    if (className) element.className = className;
    element.textContent = text;
    return element;
  }

  function button(text, className) {
    const element = document.createElement("button");
    element.type = "button";
    element.className = className;
    element.textContent = text;
    return element;
  }

  function setStatus(element, status) {
    element.textContent = status;
    element.dataset.status = status;
  }

  function sleep(ms) {
    return new Promise((resolve) => setTimeout(resolve, ms));
  }

  async function start() {
    $("login-form").addEventListener("submit", signIn);
    $("session-form").addEventListener("submit", showSession);
    $("sign-out").addEventListener("click", () => signOut(""));
    $("cancel").addEventListener("click", cancelFork);
    $("cancel-session").addEventListener("click", cancelSession);
    const session = new URLSearchParams(location.search).get("session");
    if (session) $("session").value = session.slice(0, 256);
    const stored = sessionStorage.getItem(TOKEN_KEY);
    if (stored) return enter(stored);
    // a server started with --insecure-no-auth needs no token: no sign-in then
    const open = await request("", "v1/providers").then((r) => r.ok, () => false);
    if (open) return enter("");
    signOut("");
  }

  start();
})();

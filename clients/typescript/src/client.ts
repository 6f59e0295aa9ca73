import { ForkqApiError, boundedText, describe, errorOf } from "./errors.js";
import type {
  Cancelled,
  ChangesBody,
  Decided,
  ForkBudget,
  ForkState,
  Health,
  LaunchRequest,
  Launched,
  Listing,
  MessageSent,
  Notification,
  ResultBody,
  SessionBudget,
  SessionCancel,
  SessionForks,
  Transcript,
  WorkspaceOffered,
} from "./schema.js";
import { readEvents, type ForkEvent } from "./events.js";
import { blobOf, mapBounded, workspaceFiles } from "./workspace.js";

/** How to reach `forkq serve`. */
export interface ClientOptions {
  /** The server's base URL, such as `http://127.0.0.1:8700`. */
  baseUrl: string;
  /** A token of the server's FORKQ_API_TOKENS, sent as `Authorization: Bearer <token>`. */
  token?: string;
  /** Milliseconds a request may take (a long poll's own wait comes on top); default 30,000. */
  timeoutMs?: number;
  /** The fetch to use (default: the global one). */
  fetch?: typeof fetch;
}

/** Options of a single request. */
export interface CallOptions {
  /** Aborts the request; the promise then rejects with the signal's reason. */
  signal?: AbortSignal;
  /** Overrides the client's `timeoutMs` for this request. */
  timeoutMs?: number;
}

/** Options of `events`. */
export interface EventsOptions {
  /** Start after this event id (a `ForkEvent.id` seen before), as a resumed stream does. */
  lastEventId?: string;
  /** Stops the stream: the iterator then throws the signal's reason. */
  signal?: AbortSignal;
  /** A connection that brings no byte for this long is dropped and resumed (default 60,000; the server sends a
   * keep-alive every 15 s). */
  idleTimeoutMs?: number;
  /** Reconnections in a row that bring no event before the iterator gives up (default 5). */
  maxReconnects?: number;
  /** Milliseconds before the first reconnection, doubled for each further one in a row (default 250). */
  reconnectDelayMs?: number;
}

/** Options of `uploadWorkspace`. */
export interface UploadOptions extends CallOptions {
  /** Blobs uploaded at once (default 8). */
  concurrency?: number;
}

/** What `uploadWorkspace` did: the manifest's digest (the launch option `workspace_manifest`), and the files it
 * sent (0 when the server had them all). */
export interface UploadedWorkspace {
  manifest: string;
  uploaded: number;
}

/** A launch: the request's body, and, with `workspaceDir`, a folder uploaded first as its workspace. */
export type LaunchInput = LaunchRequest & {
  /** A folder (the parent's cwd) to upload as the fork's snapshot workspace before the launch (Node.js). */
  workspaceDir?: string;
  /** The fork's tokens at most (the launch option `max_tokens`: input plus output, cached input as the provider
   * bills it); at it the fork pauses (`budget_reached`) before its next model call (docs/capacity.md). */
  maxTokens?: number;
};

/** What `result` answered: the result of an ended fork, or the state of one that has not ended (yet). */
export type ResultOutcome = { ended: true; result: ResultBody } | { ended: false; state: ForkState };

const FORK_ID = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$/;
const MAX_SEGMENT = 200;
const MAX_WAIT_S = 60;

interface ApiRequest {
  what: string;
  method: "GET" | "POST" | "PUT";
  path: string;
  body?: unknown;
  /** Bytes sent as they are (application/octet-stream), instead of `body` as JSON. */
  raw?: Uint8Array<ArrayBuffer>;
  headers?: Record<string, string>;
  waitMs?: number;
  /** Read the answer as text (not JSON). */
  text?: boolean;
}

const DEFAULT_UPLOADS = 8;

/** A client of forkq's HTTP API (docs/api.md): every method is one request, `events` a resumable stream. */
export class ForkqClient {
  private readonly baseUrl: string;
  private readonly token: string | undefined;
  private readonly timeoutMs: number;
  private readonly fetchImpl: typeof fetch;

  constructor(options: ClientOptions) {
    let url: URL;
    try {
      url = new URL(options.baseUrl);
    } catch (cause) {
      throw new ForkqApiError(
        0,
        `baseUrl ${JSON.stringify(options.baseUrl)} is not a URL; pass one such as http://127.0.0.1:8700`,
        "baseUrl",
        { cause },
      );
    }
    this.baseUrl = url.href.replace(/\/+$/, "");
    this.token = options.token;
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.fetchImpl = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /** Launch a fork (`POST /v1/forks`); with `idempotencyKey`, at most once per key. With `workspaceDir`, the folder
   * is uploaded first (`uploadWorkspace`) and the fork works on that snapshot (`options.workspace_manifest`). */
  async launch(input: LaunchInput, options: CallOptions & { idempotencyKey?: string } = {}): Promise<Launched> {
    const { workspaceDir, maxTokens, ...request } = input;
    if (maxTokens !== undefined) request.options = { ...request.options, max_tokens: maxTokens };
    if (workspaceDir !== undefined) {
      const { manifest } = await this.uploadWorkspace(workspaceDir, options);
      request.options = { ...request.options, workspace: "snapshot", workspace_manifest: manifest };
    }
    const headers: Record<string, string> = options.idempotencyKey ? { "Idempotency-Key": options.idempotencyKey } : {};
    const req = { what: "launch", method: "POST", path: "/v1/forks", body: request, headers } as const;
    return (await this.call<Launched>(req, options)).body;
  }

  /** Upload a folder as a workspace (Node.js): its manifest, then only the files the server lacks, then the
   * manifest again, which the server then stores. A second upload of the same tree sends no file. */
  async uploadWorkspace(dir: string, options: UploadOptions = {}): Promise<UploadedWorkspace> {
    const files = await workspaceFiles(dir);
    const body = { entries: files.map(({ path, mode, size, digest }) => ({ path, mode, size, digest })) };
    const offer = { what: `workspace of ${dir}`, method: "POST", path: "/v1/workspaces", body } as const;
    const first = (await this.call<WorkspaceOffered>(offer, options)).body;
    if (first.missing.length === 0) return { manifest: first.manifest, uploaded: 0 };
    const byDigest = new Map(files.map((file) => [file.digest, file]));
    const missing = first.missing.map((digest) => byDigest.get(digest)).filter((file) => file !== undefined);
    await mapBounded(missing, options.concurrency ?? DEFAULT_UPLOADS, async (file) => {
      const raw = await blobOf(file);
      const path = `/v1/workspaces/blobs/${file.digest}`;
      await this.call<void>({ what: `upload of ${file.path}`, method: "PUT", path, raw }, options);
    });
    const stored = (await this.call<WorkspaceOffered>(offer, options)).body;
    if (stored.missing.length > 0) {
      throw new ForkqApiError(
        0,
        `workspace of ${dir}: the server still lacks ${stored.missing.length} files after the upload; upload again`,
        "workspaceDir",
      );
    }
    return { manifest: stored.manifest, uploaded: missing.length };
  }

  /** The fork's changes to its workspace: the changed files and the git patch (`stat`: the files only). */
  async changes(forkId: string, options: CallOptions & { stat?: boolean } = {}): Promise<ChangesBody> {
    const path = `${forkPath(forkId)}/changes${options.stat ? "?stat=1" : ""}`;
    return (await this.call<ChangesBody>({ what: `changes of fork ${forkId}`, method: "GET", path }, options)).body;
  }

  /** The fork's changes as a git patch (`git apply` takes it), as text. */
  async patch(forkId: string, options: CallOptions = {}): Promise<string> {
    const req = {
      what: `patch of fork ${forkId}`,
      method: "GET",
      path: `${forkPath(forkId)}/changes`,
      headers: { Accept: "text/x-diff" },
      text: true,
    } as const;
    return (await this.call<string>(req, options)).body;
  }

  /** The fork's state (`GET /v1/forks/{id}`). */
  async get(forkId: string, options: CallOptions = {}): Promise<ForkState> {
    return (
      await this.call<ForkState>({ what: `state of fork ${forkId}`, method: "GET", path: forkPath(forkId) }, options)
    ).body;
  }

  /** The result once the fork has ended, else, after waiting up to `wait` seconds (0-60), its state. */
  async result(forkId: string, options: CallOptions & { wait?: number } = {}): Promise<ResultOutcome> {
    const wait = options.wait ?? 0;
    if (!(wait >= 0 && wait <= MAX_WAIT_S)) {
      throw new ForkqApiError(
        0,
        `wait ${wait} is not between 0 and ${MAX_WAIT_S} seconds; ask again to wait longer`,
        "wait",
      );
    }
    const path = `${forkPath(forkId)}/result?wait=${wait}`;
    const answer = await this.call<ResultBody | ForkState>(
      { what: `result of fork ${forkId}`, method: "GET", path, waitMs: wait * 1000 },
      options,
    );
    return answer.status === 200
      ? { ended: true, result: answer.body as ResultBody }
      : { ended: false, state: answer.body as ForkState };
  }

  /** The `<task-notification>` for the parent's model; a 409 ForkqApiError before the fork has ended. */
  async notification(forkId: string, options: CallOptions = {}): Promise<Notification> {
    const req = {
      what: `notification of fork ${forkId}`,
      method: "GET",
      path: `${forkPath(forkId)}/notification`,
    } as const;
    return (await this.call<Notification>(req, options)).body;
  }

  /** What the fork did, step by step; tool results cut to `maxChars` (default 4,096). */
  async transcript(forkId: string, options: CallOptions & { maxChars?: number } = {}): Promise<Transcript> {
    const query = options.maxChars === undefined ? "" : `?max_chars=${encodeURIComponent(options.maxChars)}`;
    const req = {
      what: `transcript of fork ${forkId}`,
      method: "GET",
      path: `${forkPath(forkId)}/transcript${query}`,
    } as const;
    return (await this.call<Transcript>(req, options)).body;
  }

  /** The fork's events, from its first (or after `lastEventId`) to `finished`; a dropped connection is resumed
   * from the last event received, so each event comes once. */
  events(forkId: string, options: EventsOptions = {}): AsyncGenerator<ForkEvent, void, undefined> {
    const url = `${this.baseUrl}${forkPath(forkId)}/events`;
    return readEvents(forkId, url, options, {
      fetch: this.fetchImpl,
      headers: this.authHeaders(),
      state: (signal) => this.get(forkId, signal ? { signal } : {}),
    });
  }

  /** Cancel the fork; its status afterwards (`cancelled`, or the status it had ended with). */
  async cancel(forkId: string, options: CallOptions = {}): Promise<Cancelled> {
    return (
      await this.call<Cancelled>(
        { what: `cancel of fork ${forkId}`, method: "POST", path: `${forkPath(forkId)}/cancel` },
        options,
      )
    ).body;
  }

  /** Approve a call a parked fork waits on. */
  async approve(forkId: string, callId: string, options: CallOptions = {}): Promise<Decided> {
    return this.decide(forkId, callId, { decision: "approve" }, options);
  }

  /** Deny a call a parked fork waits on; the model reads `reason`. */
  async deny(forkId: string, callId: string, reason?: string, options: CallOptions = {}): Promise<Decided> {
    return this.decide(
      forkId,
      callId,
      reason === undefined ? { decision: "deny" } : { decision: "deny", reason },
      options,
    );
  }

  /** Give the fork a message: a succeeded fork is continued, a running or parked one reads it next. */
  async send(forkId: string, text: string, options: CallOptions = {}): Promise<MessageSent> {
    const req = {
      what: `message to fork ${forkId}`,
      method: "POST",
      path: `${forkPath(forkId)}/messages`,
      body: { text },
    } as const;
    return (await this.call<MessageSent>(req, options)).body;
  }

  /** The forks of a parent session still in Redis, newest first (`limit`: 1-1000, default 100). */
  async list(sessionId: string, options: CallOptions & { limit?: number } = {}): Promise<SessionForks> {
    const query = options.limit === undefined ? "" : `?limit=${encodeURIComponent(options.limit)}`;
    const path = `/v1/sessions/${segment(sessionId, "session_id")}/forks${query}`;
    return (await this.call<SessionForks>({ what: `forks of session ${sessionId}`, method: "GET", path }, options))
      .body;
  }

  /** Cancel every fork of a parent session that has not ended, nested subagents included: the forks it cancelled and
   * how many had already ended. Launches into the session are then refused (a 409 ForkqApiError, field
   * `session_id`) until `refused_until_ms`. */
  async cancelSession(sessionId: string, options: CallOptions = {}): Promise<SessionCancel> {
    const path = `/v1/sessions/${segment(sessionId, "session_id")}/cancel`;
    return (await this.call<SessionCancel>({ what: `cancel of session ${sessionId}`, method: "POST", path }, options))
      .body;
  }

  /** A parent session's token budget: its limit (`tokens`, null: none), what its forks used, and what is left. */
  async budget(sessionId: string, options: CallOptions = {}): Promise<SessionBudget> {
    const path = `/v1/sessions/${segment(sessionId, "session_id")}/budget`;
    return (await this.call<SessionBudget>({ what: `budget of session ${sessionId}`, method: "GET", path }, options))
      .body;
  }

  /** Set a parent session's token budget; raised above what its forks used, the forks it paused resume
   * (`resumed` lists them). */
  async setBudget(sessionId: string, tokens: number, options: CallOptions = {}): Promise<SessionBudget> {
    const req = {
      what: `budget of session ${sessionId}`,
      method: "PUT",
      path: `/v1/sessions/${segment(sessionId, "session_id")}/budget`,
      body: { tokens },
    } as const;
    return (await this.call<SessionBudget>(req, options)).body;
  }

  /** A fork's budgets: its own `max_tokens` with used and left, and its session's budget. */
  async forkBudget(forkId: string, options: CallOptions = {}): Promise<ForkBudget> {
    const req = { what: `budget of fork ${forkId}`, method: "GET", path: `${forkPath(forkId)}/budget` } as const;
    return (await this.call<ForkBudget>(req, options)).body;
  }

  /** The subagent definitions a launch's `subagent_type` can name. */
  async agents(options: CallOptions = {}): Promise<Listing> {
    return (await this.call<Listing>({ what: "agents", method: "GET", path: "/v1/agents" }, options)).body;
  }

  /** The subagent providers and the capabilities of each seed mode. */
  async providers(options: CallOptions = {}): Promise<Listing> {
    return (await this.call<Listing>({ what: "providers", method: "GET", path: "/v1/providers" }, options)).body;
  }

  /** Whether the server's Redis answers and is fit (`GET /healthz`: 200 or 503, both answered here). */
  async health(options: CallOptions = {}): Promise<Health> {
    return (await this.call<Health>({ what: "health", method: "GET", path: "/healthz" }, options, [503])).body;
  }

  private async decide(
    forkId: string,
    callId: string,
    body: { decision: string; reason?: string },
    options: CallOptions,
  ): Promise<Decided> {
    const path = `${forkPath(forkId)}/approvals/${segment(callId, "call_id")}`;
    return (
      await this.call<Decided>(
        { what: `${body.decision} of call ${callId} of fork ${forkId}`, method: "POST", path, body },
        options,
      )
    ).body;
  }

  private authHeaders(): Record<string, string> {
    return this.token === undefined ? {} : { Authorization: `Bearer ${this.token}` };
  }

  private async call<T>(
    req: ApiRequest,
    options: CallOptions,
    accept: number[] = [],
  ): Promise<{ status: number; body: T }> {
    const timeoutMs = (options.timeoutMs ?? this.timeoutMs) + (req.waitMs ?? 0);
    const timeout = AbortSignal.timeout(timeoutMs);
    const { signal, release } = either(options.signal, timeout);
    const headers: Record<string, string> = { Accept: "application/json", ...this.authHeaders(), ...req.headers };
    if (req.body !== undefined) headers["Content-Type"] = "application/json";
    if (req.raw !== undefined) headers["Content-Type"] = "application/octet-stream";
    const payload = req.raw ?? (req.body === undefined ? undefined : JSON.stringify(req.body));
    try {
      const response = await this.fetchImpl(`${this.baseUrl}${req.path}`, {
        method: req.method,
        headers,
        signal,
        ...(payload === undefined ? {} : { body: payload }),
      });
      if (!response.ok && !accept.includes(response.status)) {
        throw errorOf(response.status, req.what, await boundedText(response));
      }
      if (response.status === 204) return { status: 204, body: undefined as T };
      return { status: response.status, body: (req.text ? await response.text() : await response.json()) as T };
    } catch (error) {
      if (error instanceof ForkqApiError) throw error;
      if (options.signal?.aborted) throw options.signal.reason;
      if (timeout.aborted) {
        throw new ForkqApiError(
          0,
          `${req.what}: no answer within ${timeoutMs} ms; raise timeoutMs, or check the server`,
          null,
          { cause: error },
        );
      }
      throw new ForkqApiError(0, `${req.what}: ${describe(error)}; is forkq serve running at ${this.baseUrl}?`, null, {
        cause: error,
      });
    } finally {
      release();
    }
  }
}

/** A signal aborted when either is (AbortSignal.any, which Node.js 18 lacks), and how to stop listening to them. */
function either(first: AbortSignal | undefined, second: AbortSignal): { signal: AbortSignal; release: () => void } {
  if (first === undefined) return { signal: second, release: () => undefined };
  const controller = new AbortController();
  const sources = [first, second];
  const abort = (): void => controller.abort(sources.find((source) => source.aborted)?.reason);
  for (const source of sources) source.addEventListener("abort", abort, { once: true });
  if (first.aborted || second.aborted) abort();
  // a caller's long-lived signal (a shutdown signal, say) must not keep a listener per request
  const release = (): void => sources.forEach((source) => source.removeEventListener("abort", abort));
  return { signal: controller.signal, release };
}

/** The path of a fork, its id checked first (an id such as `..` would make the URL name another resource). */
function forkPath(forkId: string): string {
  if (!FORK_ID.test(forkId)) {
    throw new ForkqApiError(
      0,
      `${JSON.stringify(forkId.slice(0, 200))} is not a fork id: 1-128 letters, digits, '_', '.' or '-', ` +
        "starting with a letter or digit; pass the id launch returned",
      "fork_id",
    );
  }
  return `/v1/forks/${forkId}`;
}

function segment(value: string, field: string): string {
  if (value.length === 0 || value.length > MAX_SEGMENT || value === "." || value === "..") {
    throw new ForkqApiError(
      0,
      `${field} ${JSON.stringify(value.slice(0, 50))} must be 1-${MAX_SEGMENT} characters and not '.' or '..'`,
      field,
    );
  }
  return encodeURIComponent(value);
}

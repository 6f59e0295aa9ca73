import { ForkqApiError, boundedText, describe, errorOf } from "./errors.js";
import type { EventsOptions } from "./client.js";
import type { ForkEvent, ForkState } from "./schema.js";
import { SseParser, type SseMessage } from "./sse.js";

/**
 * One event of a fork (docs/api.md: events): its stream id (pass it as `lastEventId` to resume after it), its
 * type, and its data, typed by its type: narrow on `type` (`if (event.type === "step") event.data.tool_calls`).
 * A newer server may send a type this client does not know, with its own data: give a `switch` a default.
 */
export type { ForkEvent };

/** What `readEvents` needs of the client. */
export interface EventSource {
  fetch: typeof fetch;
  headers: Record<string, string>;
  state: (signal?: AbortSignal) => Promise<ForkState>;
}

const ENDED = new Set(["succeeded", "failed", "cancelled"]);
const RETRY_STATUSES = new Set([502, 503, 504]); // a proxy between servers, or Redis down for a moment

/** The events of a fork to its `finished` event, reconnecting with `Last-Event-ID` after a dropped connection. */
export async function* readEvents(
  forkId: string,
  url: string,
  options: EventsOptions,
  source: EventSource,
): AsyncGenerator<ForkEvent, void, undefined> {
  let lastId = options.lastEventId;
  const maxReconnects = options.maxReconnects ?? 5;
  const delayMs = options.reconnectDelayMs ?? 250;
  for (let failures = 0; ; ) {
    let received = false;
    let problem: unknown = null;
    try {
      for await (const message of connect(url, lastId, options, source)) {
        const event = toEvent(forkId, message);
        lastId = event.id;
        received = true;
        failures = 0;
        yield event;
        if (event.type === "finished") return;
      }
      // a stream that ends with no event ends because the fork has ended (or, rarely, because Redis failed)
      if (!received && ENDED.has((await source.state(options.signal)).status)) return;
    } catch (error) {
      if (options.signal?.aborted) throw options.signal.reason;
      if (!transient(error)) throw error;
      problem = error;
    }
    if (received) continue; // progress: resume at once
    failures += 1;
    if (failures > maxReconnects) {
      const why = problem === null ? "the stream ended with no event" : (problem as Error).message;
      const resume = lastId === undefined ? "" : `; resume later with lastEventId ${lastId}`;
      throw new ForkqApiError(
        0,
        `events of fork ${forkId}: ${failures} connections in a row brought no event (last: ${why})${resume}`,
        null,
        { cause: problem },
      );
    }
    await sleep(delayMs * 2 ** (failures - 1), options.signal);
  }
}

function transient(error: unknown): boolean {
  return error instanceof ForkqApiError && (error.status === 0 || RETRY_STATUSES.has(error.status));
}

function toEvent(forkId: string, message: SseMessage): ForkEvent {
  let data: unknown;
  try {
    data = JSON.parse(message.data);
  } catch (cause) {
    throw new ForkqApiError(200, `event ${message.id} of fork ${forkId}: its data is not JSON`, null, { cause });
  }
  if (data === null || typeof data !== "object" || Array.isArray(data)) {
    throw new ForkqApiError(200, `event ${message.id} of fork ${forkId}: its data is not a JSON object`);
  }
  // the server sends each event as its type's model (the OpenAPI document's ForkEvent)
  return { id: message.id, type: message.event, data } as ForkEvent;
}

/** One connection's messages; any failure is a ForkqApiError (status 0: no answer, or the connection dropped). */
async function* connect(
  url: string,
  lastId: string | undefined,
  options: EventsOptions,
  source: EventSource,
): AsyncGenerator<SseMessage, void, undefined> {
  const idleMs = options.idleTimeoutMs ?? 60_000;
  const controller = new AbortController();
  const stop = (): void => controller.abort(options.signal?.reason);
  options.signal?.addEventListener("abort", stop, { once: true });
  let idle = false;
  let timer: ReturnType<typeof setTimeout> | undefined;
  const touch = (): void => {
    clearTimeout(timer);
    timer = setTimeout(() => {
      idle = true;
      controller.abort();
    }, idleMs);
  };
  const headers: Record<string, string> = { Accept: "text/event-stream", ...source.headers };
  if (lastId !== undefined) headers["Last-Event-ID"] = lastId;
  try {
    touch();
    const response = await source.fetch(url, { headers, signal: controller.signal });
    if (!response.ok) throw errorOf(response.status, `events of ${url}`, await boundedText(response));
    if (!response.body) throw new ForkqApiError(0, `events of ${url}: the response has no body`);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const parser = new SseParser();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      touch();
      yield* parser.push(decoder.decode(value, { stream: true }));
    }
  } catch (error) {
    if (error instanceof ForkqApiError || options.signal?.aborted) throw error;
    const why = idle ? `no byte for ${idleMs} ms` : describe(error);
    throw new ForkqApiError(0, `events of ${url}: ${why}`, null, { cause: error });
  } finally {
    clearTimeout(timer);
    options.signal?.removeEventListener("abort", stop);
    controller.abort(); // a consumer that stops early closes the connection
  }
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

export { ForkqClient } from "./client.js";
export type { CallOptions, ClientOptions, EventsOptions, ResultOutcome } from "./client.js";
export { ForkqApiError } from "./errors.js";
export type { ForkEvent } from "./events.js";
export { SseParser } from "./sse.js";
export type { SseMessage } from "./sse.js";
export type * from "./schema.js";

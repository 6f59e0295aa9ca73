export { ForkqClient } from "./client.js";
export type { CallOptions, ClientOptions, EventsOptions, ResultOutcome } from "./client.js";
export { ForkqApiError } from "./errors.js";
export { SseParser } from "./sse.js";
export type { SseMessage } from "./sse.js";
export type * from "./schema.js";

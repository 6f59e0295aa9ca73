export { ForkqClient } from "./client.js";
export type {
  CallOptions,
  ClientOptions,
  EventsOptions,
  LaunchInput,
  ResultOutcome,
  UploadOptions,
  UploadedWorkspace,
} from "./client.js";
export { IgnoreRules } from "./workspace.js";
export type { WorkspaceEntry } from "./workspace.js";
export { ForkqApiError } from "./errors.js";
export { SseParser } from "./sse.js";
export type { SseMessage } from "./sse.js";
export type * from "./schema.js";

/** The one error the client throws for a refused request, a bad answer, or no answer at all. */
export class ForkqApiError extends Error {
  /** The HTTP status, or 0 when no response came (network failure, timeout). */
  readonly status: number;
  /** The field at fault (`fork_turns`, `history[3]`, `Last-Event-ID`, ...), or null. */
  readonly field: string | null;

  constructor(status: number, message: string, field: string | null = null, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "ForkqApiError";
    this.status = status;
    this.field = field;
  }
}

const MAX_ERROR_BODY = 64 * 1024; // an error body is a few hundred bytes; a proxy's page is cut here
const MAX_QUOTED = 300; // a proxy's HTML error page says little past its first lines

/** The error of a non-2xx response, from the API's error shape `{"error": {status, message, field}}` when it has it. */
export function errorOf(status: number, what: string, text: string): ForkqApiError {
  try {
    const body: unknown = JSON.parse(text);
    const detail = (body as { error?: { message?: unknown; field?: unknown } } | null)?.error;
    if (detail && typeof detail.message === "string") {
      const field = typeof detail.field === "string" ? detail.field : null;
      return new ForkqApiError(status, detail.message, field);
    }
  } catch {
    // not JSON: a proxy or load balancer answered, not forkq; the text is quoted below
  }
  const quoted = text.length > MAX_QUOTED ? `${text.slice(0, MAX_QUOTED)}...` : text;
  return new ForkqApiError(
    status,
    `${what}: HTTP ${status} without forkq's error shape (${JSON.stringify(quoted)}); is the base URL forkq serve's?`,
  );
}

/** A response's text, at most `limit` characters of it. */
export async function boundedText(response: Response, limit = MAX_ERROR_BODY): Promise<string> {
  if (!response.body) return "";
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let text = "";
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return text + decoder.decode();
      text += decoder.decode(value, { stream: true });
      if (text.length >= limit) return text.slice(0, limit);
    }
  } finally {
    reader.cancel().catch(() => undefined); // the rest is not read; free the connection
  }
}

/** A network failure in words: undici puts the reason (ECONNREFUSED, ...) in `cause`. */
export function describe(error: unknown): string {
  if (!(error instanceof Error)) return String(error);
  const cause = error.cause instanceof Error ? `: ${error.cause.message}` : "";
  return `${error.message}${cause}`;
}

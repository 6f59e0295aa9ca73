/** One Server-Sent Events message: its `id` (the last one seen, as the spec says), `event` type and `data`. */
export interface SseMessage {
  id: string;
  event: string;
  data: string;
}

/** The largest message the parser holds (16 MiB of data): a stream that never ends a message is refused. */
export const MAX_MESSAGE_CHARS = 16 * 1024 * 1024;

/**
 * An incremental SSE parser (the WHATWG event-stream rules): feed it text in chunks split anywhere, even
 * inside a CRLF, and it returns each message once its blank line has come. Comments (`: keep-alive`) and
 * `retry` are skipped; several `data` lines are joined with newlines.
 */
export class SseParser {
  private pending = "";
  private lastId = "";
  private event = "";
  private data: string[] = [];
  private size = 0;
  private sawCr = false;

  /** Parse `chunk` after whatever came before; the messages it completes. */
  push(chunk: string): SseMessage[] {
    let text = chunk;
    if (this.sawCr && text.startsWith("\n")) text = text.slice(1); // the LF of a CRLF split across chunks
    this.sawCr = false;
    const messages: SseMessage[] = [];
    let start = 0;
    for (let i = 0; i < text.length; i++) {
      const char = text[i];
      if (char !== "\n" && char !== "\r") continue;
      this.line(this.pending + text.slice(start, i), messages);
      this.pending = "";
      if (char === "\r") {
        if (i + 1 === text.length) this.sawCr = true;
        else if (text[i + 1] === "\n") i++;
      }
      start = i + 1;
    }
    this.pending += text.slice(start);
    this.grow(text.length - start);
    return messages;
  }

  private grow(chars: number): void {
    this.size += chars;
    if (this.size > MAX_MESSAGE_CHARS) {
      throw new RangeError(`an event-stream message is over ${MAX_MESSAGE_CHARS} characters: not forkq's stream`);
    }
  }

  private line(line: string, messages: SseMessage[]): void {
    if (line === "") {
      if (this.data.length > 0)
        messages.push({ id: this.lastId, event: this.event || "message", data: this.data.join("\n") });
      this.event = "";
      this.data = [];
      this.size = 0;
      return;
    }
    if (line.startsWith(":")) return; // a comment: the server's keep-alive
    const colon = line.indexOf(":");
    const name = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (name === "data") {
      this.data.push(value);
      this.grow(value.length);
    } else if (name === "event") {
      this.event = value;
    } else if (name === "id" && !value.includes("\0")) {
      this.lastId = value;
    }
  }
}

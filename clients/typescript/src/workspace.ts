// A folder as a forkq workspace (docs/api.md: workspaces): which files, their modes, sizes and SHA-256 digests.
//
// In a git work tree, the files git lists as tracked, or untracked and not ignored
// (`git ls-files -z --cached --others --exclude-standard`); elsewhere every regular file, minus what
// `.forkqignore` excludes (a subset of gitignore's syntax: `#` comments, `!` negation, a trailing `/` for
// folders, a `/` anchoring to the root, `*`, `?`, `**`, `[...]`). Symlinks stay links (their blob is the
// target, never followed); executable bits are kept. Node.js only: its modules are loaded when a folder is read.
import { ForkqApiError } from "./errors.js";

/** One file of a workspace, as `POST /v1/workspaces` takes it. */
export interface WorkspaceEntry {
  /** Relative to the folder, `/`-separated. */
  path: string;
  /** 0o100644 (33188) a file, 0o100755 (33261) an executable, 0o120000 (40960) a symlink. */
  mode: number;
  size: number;
  /** SHA-256 of the bytes (a symlink's: its target), lowercase hex. */
  digest: string;
}

/** A file of the folder: its entry, and where its bytes are. */
export interface LocalFile extends WorkspaceEntry {
  source: string;
}

export const FILE = 0o100644;
export const EXECUTABLE = 0o100755;
export const SYMLINK = 0o120000;
const FILES_AT_ONCE = 16;
const GIT_MAX_OUTPUT = 256 * 1024 * 1024;

interface Rule {
  regex: RegExp;
  negate: boolean;
  foldersOnly: boolean;
  anchored: boolean;
}

/** A gitignore glob as a regular expression over a `/`-separated path. */
function patternRegex(pattern: string): RegExp {
  let out = "";
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i] as string;
    if (pattern.startsWith("**/", i)) {
      out += "(?:.*/)?";
      i += 2;
    } else if (pattern.startsWith("**", i)) {
      out += ".*";
      i += 1;
    } else if (c === "*") {
      out += "[^/]*";
    } else if (c === "?") {
      out += "[^/]";
    } else if (c === "[" && pattern.indexOf("]", i + 1) > i + 1) {
      const end = pattern.indexOf("]", i + 1);
      const body = pattern.slice(i + 1, end).replaceAll("\\", "\\\\");
      out += `[${body.startsWith("!") ? `^${body.slice(1)}` : body}]`;
      i = end;
    } else {
      out += c.replace(/[.*+?^${}()|[\]\\/]/g, "\\$&");
    }
  }
  return new RegExp(`^${out}$`, "u");
}

/** `.forkqignore` patterns (a subset of gitignore's): the last rule that matches a path decides. */
export class IgnoreRules {
  private readonly rules: Rule[] = [];

  constructor(text: string) {
    for (const raw of text.split(/\r?\n/)) {
      let line = raw.trimEnd();
      if (!line || line.startsWith("#")) continue;
      const negate = line.startsWith("!");
      if (negate) line = line.slice(1);
      const foldersOnly = line.endsWith("/");
      line = line.replace(/\/+$/, "");
      const anchored = line.includes("/");
      this.rules.push({ regex: patternRegex(line.replace(/^\/+/, "")), negate, foldersOnly, anchored });
    }
  }

  /** Whether `path` (relative, `/`-separated) is left out. */
  ignored(path: string, isFolder: boolean): boolean {
    let verdict = false;
    for (const rule of this.rules) {
      if (rule.foldersOnly && !isFolder) continue;
      const target = rule.anchored ? path : (path.split("/").at(-1) ?? path);
      if (rule.regex.test(target)) verdict = !rule.negate;
    }
    return verdict;
  }
}

function git(dir: string, args: string[]): Promise<Uint8Array | null> {
  return import("node:child_process").then(
    ({ execFile }) =>
      new Promise((resolve) => {
        execFile("git", args, { cwd: dir, encoding: "buffer", maxBuffer: GIT_MAX_OUTPUT }, (error, stdout) =>
          resolve(error ? null : stdout),
        );
      }),
  );
}

async function gitFiles(dir: string): Promise<string[] | null> {
  const inside = await git(dir, ["rev-parse", "--is-inside-work-tree"]);
  if (inside === null || new TextDecoder().decode(inside).trim() !== "true") return null; // not git, or no git
  const listed = await git(dir, ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]);
  if (listed === null) {
    throw new ForkqApiError(0, `git ls-files failed in ${dir}; check that git can read the work tree`, "workspaceDir");
  }
  const names = new TextDecoder().decode(listed).split("\0").filter(Boolean);
  return [...new Set(names)].sort();
}

async function walkedFiles(dir: string): Promise<string[]> {
  const fs = await import("node:fs/promises");
  const ignoreText = await fs.readFile(`${dir}/.forkqignore`, "utf8").catch(() => "");
  const rules = new IgnoreRules(ignoreText);
  const found: string[] = [];
  const visit = async (prefix: string): Promise<void> => {
    for (const entry of await fs.readdir(prefix ? `${dir}/${prefix}` : dir, { withFileTypes: true })) {
      const rel = prefix ? `${prefix}/${entry.name}` : entry.name;
      if (entry.isDirectory()) {
        // a symlinked folder is a link, listed below, never followed
        if (entry.name !== ".git" && !rules.ignored(rel, true)) await visit(rel);
      } else if ((entry.isFile() || entry.isSymbolicLink()) && !rules.ignored(rel, false)) {
        found.push(rel);
      }
    }
  };
  await visit("");
  return found.sort();
}

async function localFile(dir: string, path: string): Promise<LocalFile | null> {
  const fs = await import("node:fs/promises");
  const { createHash } = await import("node:crypto");
  const source = `${dir}/${path}`;
  const info = await fs.lstat(source).catch(() => null);
  if (info === null) return null; // deleted, though still in git's index
  if (info.isSymbolicLink()) {
    const target = await fs.readlink(source, { encoding: "buffer" });
    const digest = createHash("sha256").update(target).digest("hex");
    return { path, mode: SYMLINK, size: target.length, digest, source };
  }
  if (!info.isFile()) return null; // a submodule, a socket: not a file of the tree
  const data = await fs.readFile(source);
  const mode = info.mode & 0o111 ? EXECUTABLE : FILE;
  return { path, mode, size: data.length, digest: createHash("sha256").update(data).digest("hex"), source };
}

/** `items` mapped by `fn`, at most `limit` at once, in order. */
export async function mapBounded<T, R>(items: T[], limit: number, fn: (item: T) => Promise<R>): Promise<R[]> {
  const results = new Array<R>(items.length);
  let next = 0;
  const worker = async (): Promise<void> => {
    while (next < items.length) {
      const index = next++;
      results[index] = await fn(items[index] as T);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return results;
}

/** The files of `dir` a workspace holds, hashed. */
export async function workspaceFiles(dir: string): Promise<LocalFile[]> {
  const root = dir.replace(/\/+$/, "") || "/";
  const fs = await import("node:fs/promises");
  const info = await fs.lstat(root).catch(() => null);
  if (info === null || !info.isDirectory()) {
    const message = `workspaceDir ${JSON.stringify(dir)} is not a folder; pass the parent's cwd`;
    throw new ForkqApiError(0, message, "workspaceDir");
  }
  const names = (await gitFiles(root)) ?? (await walkedFiles(root));
  const files = await mapBounded(names, FILES_AT_ONCE, (name) => localFile(root, name));
  return files.filter((file): file is LocalFile => file !== null);
}

/** The bytes of `file` to upload, checked against the digest they had when the folder was read. */
export async function blobOf(file: LocalFile): Promise<Uint8Array<ArrayBuffer>> {
  const fs = await import("node:fs/promises");
  const { createHash } = await import("node:crypto");
  const data =
    file.mode === SYMLINK ? await fs.readlink(file.source, { encoding: "buffer" }) : await fs.readFile(file.source);
  if (createHash("sha256").update(data).digest("hex") !== file.digest) {
    throw new ForkqApiError(0, `${file.source} changed while it was uploaded; upload the folder again`, "workspaceDir");
  }
  return data;
}

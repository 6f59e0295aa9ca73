// The few Node.js APIs `uploadWorkspace` uses (src/workspace.ts loads them with `import()` when it runs, so the
// rest of the client needs no Node.js): declared here rather than adding @types/node, the client having no
// dependency but typescript. Only what is called is declared; this file is not part of the package's types.
declare module "node:fs/promises" {
  interface Stats {
    mode: number;
    size: number;
    isFile(): boolean;
    isDirectory(): boolean;
    isSymbolicLink(): boolean;
  }
  interface Dirent {
    name: string;
    isFile(): boolean;
    isDirectory(): boolean;
    isSymbolicLink(): boolean;
  }
  export function lstat(path: string): Promise<Stats>;
  export function readFile(path: string): Promise<Uint8Array<ArrayBuffer>>;
  export function readFile(path: string, encoding: "utf8"): Promise<string>;
  export function readlink(path: string, options: { encoding: "buffer" }): Promise<Uint8Array<ArrayBuffer>>;
  export function readdir(path: string, options: { withFileTypes: true }): Promise<Dirent[]>;
}

declare module "node:crypto" {
  interface Hash {
    update(data: Uint8Array): Hash;
    digest(encoding: "hex"): string;
  }
  export function createHash(algorithm: "sha256"): Hash;
}

declare module "node:child_process" {
  export function execFile(
    file: string,
    args: string[],
    options: { cwd: string; encoding: "buffer"; maxBuffer: number },
    callback: (error: Error | null, stdout: Uint8Array, stderr: Uint8Array) => void,
  ): unknown;
}

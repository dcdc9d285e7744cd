"""API keys for the HTTP gateway, as vLLM (`--api-key`) and llama-server (`--api-key`) take them:
`Authorization: Bearer <key>` on every endpoint but /health and the web page's own files (api/web.py),
which hold nothing but the page that asks for the key.

Keys come from the environment variable SPECLANES_API_KEY (one key) and from the file named by
`gateway.api_key_file` (one key per line; blank lines and lines starting with # are skipped).
With neither, the gateway is open, and it then binds loopback only by default.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from pipeline.api.web import PAGE_PATHS

KEY_VARIABLE = "SPECLANES_API_KEY"
OPEN_PATHS = frozenset({"/health", *PAGE_PATHS})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def load_keys(key_file: str, environ: Mapping[str, str]) -> tuple[bytes, ...]:
    keys = [environ[KEY_VARIABLE].strip()] if environ.get(KEY_VARIABLE, "").strip() else []
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise OSError(f"cannot read gateway.api_key_file {key_file}: {exc.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"gateway.api_key_file {key_file} holds no key")
    return tuple(key.encode() for key in keys)


def authorized(header: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Compares against every key in constant time, so timing tells nothing about any of them."""
    scheme, _, given = (header or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not given:
        return False
    # A list, not a generator: every key is compared, with no short cut.
    return any([hmac.compare_digest(given.strip(), key) for key in keys])


class RequireKey:
    """ASGI middleware: a request without a valid key gets OpenAI's 401 and reaches nothing."""

    def __init__(self, app: App, keys: tuple[bytes, ...]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers", [])).get(b"authorization")
        if authorized(header, self.keys):
            await self.app(scope, receive, send)
            return
        error = {"message": "a valid API key is needed: Authorization: Bearer <key>", "type":
                 "invalid_request_error", "param": None, "code": "invalid_api_key"}  # fmt: skip
        body = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

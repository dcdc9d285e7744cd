"""The gateway's HTTP server span: one per API call, the parent of the pipeline's traces.

An ASGI middleware (outermost but CORS, so a preflight makes none) opens a SERVER span for each
`POST /v1/...` and `/tokenize`-style call under the client's W3C `traceparent`, with the HTTP
semantic conventions' attributes, and ends it when the last byte of the answer has gone (a stream
included). The endpoint reads the span's context (`span_carrier`) for its Submits, so the
orchestrator's root span of the request, and of every choice when `n` > 1, is its child: one trace
per HTTP request. A refused request (4xx) or a failed one (5xx) leaves the span with status ERROR
and `error.type`: the OpenAI error code the client got (`refused`). The HTTP conventions leave a
4xx server span's status unset; here the span is also the GenAI operation's, which failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pipeline.observability.telemetry import Telemetry, carrier

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
SPAN_KEY = "speclanes.http_span"  # where the span waits in the ASGI scope for the endpoint
TRACED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # not probes, scrapes or the page


class HttpServerSpans:
    def __init__(self, app: App, telemetry: Telemetry) -> None:
        self.app, self.telemetry = app, telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith(TRACED_PATHS):
            await self.app(scope, receive, send)
            return
        span = self.telemetry.start(
            f"POST {scope['path']}", parent_of(scope), attributes(scope), kind=SpanKind.SERVER
        )
        scope[SPAN_KEY] = span

        async def answered(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 400 and "error.type" not in getattr(span, "attributes", {}):
                    refused(span, str(status), f"HTTP {status}")
            await send(message)

        try:
            await self.app(scope, receive, answered)
        except BaseException as exc:
            refused(span, type(exc).__qualname__, str(exc))
            raise
        finally:
            span.end()


def parent_of(scope: Scope) -> dict[str, str]:
    """The client's W3C trace context, from its headers (latin-1, as ASGI gives them)."""
    wanted = {b"traceparent", b"tracestate"}
    return {name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in wanted}


def attributes(scope: Scope) -> dict[str, str | int]:
    headers = dict(scope["headers"])
    out: dict[str, str | int] = {
        "http.request.method": "POST", "url.path": scope["path"], "http.route": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
        "network.protocol.version": scope.get("http_version", "1.1"),
    }  # fmt: skip
    if server := scope.get("server"):
        out["server.address"], out["server.port"] = str(server[0]), int(server[1] or 0)
    if client := scope.get("client"):
        out["client.address"] = str(client[0])
    if agent := headers.get(b"user-agent"):
        out["user_agent.original"] = agent.decode("latin-1")
    return out


def span_of(scope: Scope) -> Span | None:
    span = scope.get(SPAN_KEY)
    return span if isinstance(span, Span) else None


def span_carrier(scope: Scope, fallback: dict[str, str]) -> dict[str, str]:
    """The W3C context the request's Submits carry: its HTTP span's, else the client's own."""
    span = span_of(scope)
    return carrier(span) if span is not None else fallback


def refused(span: Span, error_type: str, message: str) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message))


def answered_with(scope: Scope, response_id: str) -> None:
    """The id the client receives (`chatcmpl-...`): the GenAI conventions' `gen_ai.response.id`."""
    if (span := span_of(scope)) is not None:
        span.set_attribute("gen_ai.response.id", response_id)

"""The OpenAI-compatible HTTP gateway's application (its process is lanes/gateway.py, served by
hypercorn's trio worker). It holds no model and no request state of its own: each HTTP request
becomes one pipeline request through the orchestrator's client socket (`AsyncClient`), so
exactness, batching and fault handling are the pipeline's.

This module is HTTP: routes, readiness, errors. Each surface's wire format is its own module
(api/chat.py, api/completions.py, api/responses.py) over a shared core (api/core.py); one pipeline request's
lifetime is api/generation.py's, `n` > 1 api/fanout.py's.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import hypercorn
import hypercorn.trio
import msgspec
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline import __version__
from pipeline.api import chat, completions, responses
from pipeline.api import tokenize as token_api
from pipeline.api.body import read_body
from pipeline.api.choices import choice_count, choice_submits
from pipeline.api.core import Prepared, check_model
from pipeline.api.errors import ApiError, pipeline_error
from pipeline.api.fanout import ChoicesStream, Fanout, open_choices
from pipeline.api.generation import Generation, collect, streamed
from pipeline.api.health import Health, judge, unreachable
from pipeline.api.http_spans import HttpServerSpans, answered_with, refused, span_carrier, span_of
from pipeline.api.keys import RequireKey, load_keys
from pipeline.api.web import page_routes
from pipeline.model.default import model_path
from pipeline.model.errors import ModelFileError
from pipeline.observability.request_ids import RESPONSE_PREFIXES
from pipeline.observability.telemetry import RESPONSE_PREFIX, Telemetry, with_baggage
from pipeline.protocol.client import AsyncClient, PipelineError
from pipeline.protocol.config import Config
from pipeline.protocol.messages import SpeculativeState, Submit, Submitted

log = logging.getLogger(__name__)

READY_CHECK_SECONDS = 2.0  # how long a readiness check may take before the answer is 503
READY_TRUST_SECONDS = 1.0  # a successful check is reused this long
VERSION_STATUS_SECONDS = 1.0  # /version waits this long for the verify lane's runtime, then says null
TRACE_HEADERS = ("traceparent", "tracestate")
# A surface's `prepare` (api/chat.py, ...): a body, the model served and gateway.default_max_tokens in,
# the request ready for the pipeline out.
Prepare = Callable[[bytes, str, int], Prepared]


class Gateway:
    def __init__(
        self, config: Config, totals: SpeculativeState | None = None, telemetry: Telemetry | None = None
    ) -> None:
        self.config, self.totals = config, totals  # the gateway lane's heartbeat totals, if any
        self.telemetry = telemetry  # its HTTP server spans (api/http_spans.py), if any
        self.model = config.model_id()  # gateway.model, else the GGUF's file name without .gguf
        self.client = AsyncClient(
            config.addresses.client,
            config.timeouts.send + 5.0,
            config.tls,
            config.admission.max_message_bytes,
        )
        self.generations: set[Generation] = set()
        self.ready_until, self.trusted = -math.inf, Health()  # a serving verdict, reused briefly
        self.created = int(time.time())

    # --- bookkeeping, reported in the heartbeats ---------------------------------------

    def opened(self, generation: Generation) -> None:
        self.generations.add(generation)
        self._report()

    def closed(self, generation: Generation) -> None:
        self.generations.discard(generation)
        if self.totals is not None:
            self.totals.runs += 1
        self._report()

    def _report(self) -> None:
        if self.totals is not None:
            self.totals.active_requests = len(self.generations)

    # --- readiness ---------------------------------------------------------------------

    async def check(self, fresh: bool = False) -> Health:
        """The pipeline's health (api/health.py); one that serves is trusted for READY_TRUST_SECONDS
        by requests (a drain's notice reaches them as the orchestrator's own refusal), never by
        /health (`fresh`), whose probes must see a drain begin."""
        if not fresh and trio.current_time() < self.ready_until:
            return self.trusted
        try:
            report = await self.client.status(timeout=READY_CHECK_SECONDS)
        except PipelineError as exc:
            return unreachable(exc.message)
        health = judge(report.lanes, report.closing, report.storage)
        if health.not_serving is None:
            self.ready_until, self.trusted = trio.current_time() + READY_TRUST_SECONDS, health
        return health

    async def not_ready(self) -> str | None:
        """Why the pipeline cannot take a request now, or None when it can (degraded or not)."""
        return (await self.check()).not_serving

    async def require_ready(self) -> None:
        health = await self.check()
        if health.draining or health.storage_full:  # 503 with Retry-After, as the orchestrator's refusal
            raise pipeline_error("draining" if health.draining else "storage_full", health.not_serving or "")
        if health.not_serving is not None:
            raise ApiError(503, health.not_serving, type="server_error", code="pipeline_unavailable")

    # --- endpoints ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        health = await self.check(fresh=True)
        body = health.body()
        return JSONResponse(body | {"model": self.model}, 200 if body["status"] == "ok" else 503)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "speclanes"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: Request) -> Response:
        check_model(request.path_params["model"], self.model)
        return JSONResponse(self._model_card())

    # --- beside the completions: metrics, the tokenizer, the version ---------------------

    async def metrics(self, request: Request) -> Response:
        """The whole pipeline's metrics, as the orchestrator counts them, in the Prometheus format."""
        try:
            report = await self.client.metrics(timeout=READY_CHECK_SECONDS)
        except PipelineError as exc:
            raise pipeline_error(exc.kind, exc.message) from None
        return Response(report.text, headers={"Content-Type": report.content_type})

    async def tokenize(self, request: Request) -> Response:
        req = token_api.decode_tokenize(await read_body(request, self.config.gateway.max_body_bytes))
        check_model(req.model, self.model)
        param = "messages" if req.messages is not None else "prompt" if req.prompt is not None else "content"
        reply = await self._tokenizer_call(token_api.to_tokenize(req), param)
        return JSONResponse(token_api.tokenize_response(reply, req.with_pieces))

    async def detokenize(self, request: Request) -> Response:
        req = token_api.decode_detokenize(await read_body(request, self.config.gateway.max_body_bytes))
        check_model(req.model, self.model)
        reply = await self._tokenizer_call(token_api.to_detokenize(req), "tokens")
        return JSONResponse(token_api.detokenize_response(reply.text))

    async def _tokenizer_call(self, message: Any, param: str) -> Any:
        try:
            return await self.client.tokenizer_call(message)
        except PipelineError as exc:
            raise pipeline_error(exc.kind, exc.message, param) from None

    async def version(self, request: Request) -> Response:
        """The package's version, the model served and the runtime computing it (the verify lane's,
        once it has reported; null before)."""
        try:
            report = await self.client.status(timeout=VERSION_STATUS_SECONDS)
            verify = report.lane("verify")
            runtime = verify.runtime if verify is not None else {}
        except PipelineError:
            runtime = {}
        return JSONResponse(
            {
                "version": __version__, "model": self.model, "model_path": served_model_path(self.config),
                "draft_model_path": self.config.model.draft_path or None,
                "backend": runtime.get("backend"), "kernel_path": runtime.get("kernel_path"),
                "configured_backend": self.config.model.backend,
            }
        )  # fmt: skip

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, completions.prepare, "text")

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat.prepare, "chat")

    async def create_response(self, request: Request) -> Response:
        return await self.generate(request, responses.prepare, "responses")

    async def generate(self, request: Request, prepare: Prepare, surface: str) -> Response:
        """Any surface's request: checked and made a Submit by its module (api/chat.py, ...), run in
        the pipeline, answered by its formatter as a stream or one response (api/generation.py)."""
        body = await read_body(request, self.config.gateway.max_body_bytes)
        prepared = prepare(body, self.model, self.config.gateway.default_max_tokens)
        n = choice_count(prepared.n, self.config.gateway.max_choices)
        # Under the HTTP span (api/http_spans.py), else the caller's W3C trace context: the pipeline's
        # trace joins it. Its baggage names the response id's prefix, for the root span's gen_ai.response.id.
        trace = {name: value for name in TRACE_HEADERS if (value := request.headers.get(name))}
        prefix = RESPONSE_PREFIXES[surface]
        trace = with_baggage(span_carrier(request.scope, trace), RESPONSE_PREFIX, prefix)
        # Owned by this process: if it dies, the orchestrator cancels what it was streaming.
        submit = msgspec.structs.replace(prepared.submit, trace=trace, owner=f"gateway:{os.getpid()}")
        await self.require_ready()
        if n > 1:
            return await self.generate_choices(request, prepared, submit, n)
        submitted = await self.submit(prepared, submit)
        generation = Generation(self, submitted.request_id)
        fmt = prepared.formatter(submitted.request_id, int(time.time()), submitted.prompt_tokens)
        answered_with(request.scope, prefix + submitted.request_id)
        if prepared.stream:
            return streamed(generation, fmt, prepared.include_usage)
        return JSONResponse(await collect(request, generation, fmt))

    async def submit(self, prepared: Prepared, submit: Submit) -> Submitted:
        try:
            return await self.client.request(submit)
        except PipelineError as exc:
            # The orchestrator's refusals that concern one field start with its name.
            fields = {"logit_bias": "logit_bias", "response_format": prepared.format_param}
            param = next((p for f, p in fields.items() if exc.message.startswith(f)), prepared.prompt_param)
            raise pipeline_error(exc.kind, exc.message, param) from None

    async def generate_choices(
        self, request: Request, prepared: Prepared, submit: Submit, n: int
    ) -> Response:
        """`n` > 1: n pipeline requests (api/choices.py), submitted at once, merged (api/fanout.py)."""
        base = uuid.uuid4().hex

        async def start(choice: Submit) -> tuple[Generation, int]:
            submitted = await self.submit(prepared, choice)
            return Generation(self, submitted.request_id), submitted.prompt_tokens

        opened = await open_choices(choice_submits(submit, n, base), start)
        fmt = prepared.formatter(base, int(time.time()), opened[0][1])
        answered_with(request.scope, fmt.id)
        fanout = Fanout([generation for generation, _ in opened], fmt)
        if prepared.stream:
            return ChoicesStream(fanout, prepared.include_usage)
        return JSONResponse(await fanout.collect(request))

    # --- the application ---------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model_card, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.create_response, methods=["POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            *page_routes(),  # the web page at / (api/web.py)
        ]
        handlers: dict[Any, Any] = {ApiError: api_error, HTTPException: http_error, Exception: internal_error}
        keys = load_keys(self.config.gateway.api_key_file, os.environ)
        stack = middleware(self.config, keys, self.telemetry)
        return Starlette(routes=routes, exception_handlers=handlers, middleware=stack)


def middleware(
    config: Config, keys: tuple[bytes, ...], telemetry: Telemetry | None = None
) -> list[Middleware]:
    """CORS outside the key check: a browser's preflight (OPTIONS, which carries no key) is answered
    for an allowed origin, and every answer to one, a 401 included, carries its allow header; the
    request itself still needs the key. No origins configured: no CORS. The HTTP spans between them:
    a refused key is a refused request."""
    keyed = [Middleware(RequireKey, keys=keys)]
    if telemetry is not None:
        keyed.insert(0, Middleware(HttpServerSpans, telemetry=telemetry))
    if not (origins := config.gateway.cors_origins):
        return keyed
    cors = Middleware(
        CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"], allow_headers=["*"],
        expose_headers=["Retry-After"],
    )  # fmt: skip
    return [cors, *keyed]


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if (span := span_of(request.scope)) is not None:  # the code the client reads, as the span's error.type
        refused(span, exc.code or exc.type, exc.message)
    return JSONResponse(exc.body(), exc.status, exc.headers)


async def http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and wrong methods, in the same error format as everything else."""
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(ApiError(exc.status_code, message, code=kind).body(), exc.status_code, exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("request failed", exc_info=exc)
    if (span := span_of(request.scope)) is not None:
        refused(span, type(exc).__qualname__, repr(exc))
    error = ApiError(500, f"internal error: {exc!r}", type="server_error", code="internal")
    return JSONResponse(error.body(), 500)


def served_model_path(config: Config) -> str | None:
    """The target GGUF's path: model.path, or the default model's where it is installed."""
    try:
        return str(model_path(config.model.path))
    except ModelFileError:  # a gateway on a host without the model (the lanes are elsewhere)
        return None


def hypercorn_config(config: Config) -> hypercorn.Config:
    settings = hypercorn.Config()
    host = config.gateway.host
    settings.bind = [f"[{host}]:{config.gateway.port}" if ":" in host else f"{host}:{config.gateway.port}"]
    settings.accesslog = logging.getLogger("hypercorn.access")
    settings.errorlog = logging.getLogger("hypercorn.error")
    return settings


def exception_leaves(group: BaseExceptionGroup) -> list[BaseException]:
    return [
        leaf
        for exc in group.exceptions
        for leaf in (exception_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]

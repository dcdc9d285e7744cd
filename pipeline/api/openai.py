"""The OpenAI wire format as pure functions: request bodies in, a pipeline `Submit` out;
the pipeline's chunks and final object in, OpenAI chunks, responses and errors out.

Kept apart from the HTTP server (lanes/gateway.py) so every mapping is testable without
sockets. Request bodies are decoded by msgspec into typed structs, so a wrong type names
its field (`param`) in the 400 it earns. Unknown fields are ignored, as OpenAI-compatible
servers do; known OpenAI features this server lacks (tools, best_of...) are refused by name
unless they ask for nothing; `n` is api/choices.py's. The sampling controls (OpenAI's
logit_bias, presence and frequency penalties; vLLM's top_k, min_p, repetition_penalty) are
served, exactly under speculation (`decoding.controls`), and so are log-probabilities
(`api.logprobs_format`) and `response_format` (`decoding.grammar`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from pipeline.api.chat_messages import ChatMessage, chat_messages
from pipeline.api.errors import ApiError, decode_json
from pipeline.api.extension import SpeclanesOptions, decided_field
from pipeline.api.logprobs_format import LogprobsFormatter, requested
from pipeline.decoding.grammar.format import ResponseFormatError, canonical_response_format
from pipeline.decoding.logprobs import TokenLogprobs
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import MAX_TOKENS_LIMIT, SamplingParams
from pipeline.decoding.speculation import Speculation, SpeculationError
from pipeline.observability.request_ids import RESPONSE_PREFIXES
from pipeline.protocol.client import submit_message
from pipeline.protocol.messages import Submit

# A request that names no max_tokens (and gateway.default_max_tokens is 0) runs to its end of sequence
# or to the context's end, as vLLM's do: SamplingParams' largest value, which the context always cuts.
NO_MAX_TOKENS = MAX_TOKENS_LIMIT
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request that names no temperature samples
MAX_TEMPERATURE = 2.0  # OpenAI refuses more


# The orchestrator's ErrorReply kinds (and the client's "unavailable") as HTTP errors.
PIPELINE_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "bad_request": (400, "invalid_request_error", None),
    "prompt_too_long": (400, "invalid_request_error", "context_length_exceeded"),
    "unavailable": (503, "server_error", "pipeline_unavailable"),
    "draining": (503, "server_error", "server_shutting_down"),  # SIGTERM: in-flight requests finish
    "server_shutdown": (503, "server_error", "server_shutdown"),  # the drain window ended first
    "storage_full": (503, "server_error", "storage_full"),  # the run directory's disk is full
    "unknown_request": (500, "server_error", "unknown_request"),
    "overloaded": (429, "server_error", "server_overloaded"),  # admission.max_running + max_queued reached
    "too_large": (413, "invalid_request_error", "request_too_large"),
}
# A refused request may be sent again this many seconds later (the Retry-After header of a 429): a
# queued request's turn comes as soon as any running one ends.
RETRY_AFTER_SECONDS = 1


def pipeline_error(kind: str, message: str, param: str | None = None) -> ApiError:
    """An orchestrator error reply (or a request that failed in the pipeline) as an ApiError;
    kinds not listed (internal, verification_failed, ...) are 500 server errors."""
    status, type_, code = PIPELINE_ERRORS.get(kind, (500, "server_error", kind))
    retry = status == 429 or kind in ("draining", "storage_full")  # later, or another instance
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if retry else None
    return ApiError(
        status, message, type=type_, code=code, param=param if status == 400 else None, headers=headers
    )


def body_too_large(limit: int, size: int | None) -> ApiError:
    """413 for a body over gateway.max_body_bytes; `size` None: it was cut off while being read.
    The connection closes: the rest of the body is never read."""
    told = f"of {size} bytes " if size is not None else ""
    return ApiError(
        413, f"the request body {told}is over this server's limit of {limit} bytes (gateway.max_body_bytes)",
        code="request_too_large", headers={"Connection": "close"},
    )  # fmt: skip


# --- requests -------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SpeculationOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The extension field `speculation`: which drafter, how many draft tokens per step."""

    drafter: str | None = None
    k: int | Literal["auto"] | None = None
    max_iterations: int | None = None


class _Request(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's spelling; -1 or 0 disables it)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # extension (as vLLM): keep generating past end-of-sequence
    speculation: SpeculationOptions | None = None  # extension
    speclanes: SpeclanesOptions | None = None  # extension (api/extension.py): the web page asks for it
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None  # extension (vLLM)
    repetition_penalty: float | None = None  # extension (vLLM)
    logprobs: bool | int | None = None  # chat: true or false; completions: how many alternatives
    top_logprobs: int | None = None  # chat: how many alternatives (with logprobs: true)
    # Structured output (`decoding.grammar`): chat in OpenAI's API, completions too as vLLM has it.
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int | list[int]]  # text, [text], token ids or [token ids] (one prompt)
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    # OpenAI's legacy spelling of tools: refused by name like them, never silently ignored.
    functions: list[Any] | None = None
    function_call: Any = None


def decode_request(body: bytes, chat: bool) -> CompletionRequest | ChatRequest:
    """Malformed JSON, a wrong type or a missing field: a 400 naming the field."""
    return decode_json(body, ChatRequest if chat else CompletionRequest)


def _neutral(req: CompletionRequest | ChatRequest) -> None:
    """Refuse, by name, what this server cannot do, unless the request asks for nothing."""
    asks: dict[str, bool] = {}
    if isinstance(req, CompletionRequest):
        asks |= {"best_of": req.best_of not in (None, 1), "echo": bool(req.echo), "suffix": bool(req.suffix)}
    else:
        asks |= {"tools": bool(req.tools), "functions": bool(req.functions),
                 "function_call": req.function_call not in (None, "none")}  # fmt: skip
    for name, asked in asks.items():
        if asked:
            raise ApiError(
                400, f"{name} is not supported by this server", param=name, code="unsupported_parameter"
            )
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")


def check_model(requested: str | None, model_id: str) -> None:
    """The one model this pipeline serves; a request that names none gets it too."""
    if requested is not None and requested != model_id:
        raise ApiError(
            404,
            f"the model `{requested}` does not exist; this server serves `{model_id}`",
            param="model",
            code="model_not_found",
        )


def sampling_params(req: CompletionRequest | ChatRequest, default_max_tokens: int = 0) -> SamplingParams:
    """`default_max_tokens` (gateway.default_max_tokens) caps a request that names no limit; 0: none."""
    chat_limit = req.max_completion_tokens if isinstance(req, ChatRequest) else None
    max_tokens = chat_limit if chat_limit is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens or NO_MAX_TOKENS
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=bool(req.ignore_eos),
            logprobs=requested(isinstance(req, ChatRequest), req.logprobs, req.top_logprobs),
            response_format=_response_format(req.response_format),
            **_controls(req),
        )
    except ValueError as exc:  # SamplingParams names the setting first ("top_p must be ...")
        name = str(exc).split()[0]
        chat_name = "max_completion_tokens" if chat_limit is not None else "max_tokens"
        param = {"stop": "stop", "max_tokens": chat_name}
        raise ApiError(400, str(exc), param=param.get(name, name)) from None


def _controls(req: CompletionRequest | ChatRequest) -> dict[str, Any]:
    """The sampling controls a request names (SamplingParams checks their ranges); logit_bias keys
    are token ids written as strings, as OpenAI's are."""
    named = {
        "min_p": req.min_p, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty,
    }  # fmt: skip
    controls: dict[str, Any] = {name: value for name, value in named.items() if value is not None}
    if req.logit_bias:
        try:
            controls["logit_bias"] = {int(token): bias for token, bias in req.logit_bias.items()}
        except ValueError:
            raise ApiError(400, "logit_bias keys must be token ids, as strings", param="logit_bias") from None
    return controls


def _response_format(value: dict[str, Any] | None) -> str | None:
    """OpenAI's `response_format` (json_object, json_schema) or this server's grammar extension, as the
    canonical text `SamplingParams` carries; its shape is checked here, the schema by the orchestrator
    (the grammar library compiles it there)."""
    try:
        return canonical_response_format(value)
    except ResponseFormatError as exc:
        raise ApiError(400, str(exc), param="response_format") from None


def _speculation(options: SpeculationOptions | None) -> dict[str, Any]:
    """The request's overrides, checked by `Speculation` itself; the pipeline applies its defaults."""
    if options is None:
        return {}
    k = None if options.k == "auto" else options.k
    try:
        Speculation().overridden(drafter=options.drafter, k=k, max_iterations=options.max_iterations)
    except SpeculationError as exc:
        raise ApiError(400, f"speculation.{exc}", param=f"speculation.{exc.field}") from None
    return {"drafter": options.drafter, "k": k, "max_iterations": options.max_iterations}


def to_submit(req: CompletionRequest | ChatRequest, model_id: str, default_max_tokens: int = 0) -> Submit:
    """Every check a request gets before it reaches the pipeline, then the pipeline's Submit."""
    check_model(req.model, model_id)
    _neutral(req)
    params, speculation = sampling_params(req, default_max_tokens), _speculation(req.speculation)
    if isinstance(req, ChatRequest):
        return submit_message(messages=chat_messages(req.messages), params=params, **speculation)
    prompt = _one_prompt(req.prompt)
    if isinstance(prompt, list):
        return submit_message(prompt_token_ids=prompt, params=params, **speculation)
    return submit_message(prompt, params=params, **speculation)


def _one_prompt(prompt: str | list[str | int | list[int]]) -> str | list[int]:
    """A completion's one prompt: text, or token ids (a flat list of ids). A list of prompts (of
    strings, or of id lists) must hold exactly one: this server answers one prompt per request."""
    if isinstance(prompt, str):
        return prompt
    kinds = {type(item) for item in prompt}
    if kinds == {int}:
        return [int(item) for item in prompt]  # type: ignore[arg-type]
    if kinds not in ({str}, {list}):
        message = "prompt must be a string, a list of token ids, or a list of one of those"
        raise ApiError(400, message, param="prompt")
    if len(prompt) != 1:
        message = "give one prompt per request (a list must hold exactly one prompt)"
        raise ApiError(400, message, param="prompt")
    only = prompt[0]
    if isinstance(only, list) and not only:
        raise ApiError(400, "the prompt's token ids must not be empty", param="prompt")
    return only  # type: ignore[return-value]


# --- responses ------------------------------------------------------------------------

FINISH_REASONS = {"stop": "stop", "length": "length", "max_iterations_exceeded": "length"}
ENDED = {
    "server_shutdown": "the server shut down before this request finished",
    "storage_full": "the server's disk is full: this request could not be recorded, so it ended here",
}


def failure(done: Result) -> ApiError | None:
    """A final result that is not a completion (failed or cancelled in the pipeline)."""
    if done.error is not None:
        return pipeline_error(done.error.kind, done.error.message)
    if done.finish_reason in ENDED:  # the pipeline ended it: a drain window closed, the disk filled
        return pipeline_error(done.finish_reason, ENDED[done.finish_reason])
    if done.finish_reason not in FINISH_REASONS:
        return ApiError(
            500, f"the request ended as {done.finish_reason}", type="server_error", code="aborted"
        )
    return None


def usage(done: Result, prompt_tokens: int) -> dict[str, int]:
    completion = len(done.tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def speculation_stats(done: Result) -> dict[str, Any]:
    """The extension field on the final chunk and response: the pipeline's stats for this
    request (drafter, steps, acceptance...), its request id (the audit trail's key), and the
    pipeline's own finish reason (max_iterations_exceeded shows as "length" above)."""
    return {
        "request_id": done.request_id,
        "finish_reason": done.finish_reason,
        **msgspec.to_builtins(done.stats),
    }


class Formatter:
    """Chunks and responses for one request, in the chat or the text-completion shape."""

    def __init__(
        self, chat: bool, request_id: str, model: str, created: int, prompt_tokens: int,
        logprobs: bool = False, decided: bool = False,
    ) -> None:  # fmt: skip
        self.chat, self.model, self.created, self.prompt_tokens = chat, model, created, prompt_tokens
        self.decided = decided  # text chunks carry how their tokens were decided (api/extension.py)
        self.id = RESPONSE_PREFIXES["chat" if chat else "text"] + request_id  # what `audit show` takes
        self.logprobs = LogprobsFormatter(chat) if logprobs else None  # a stream's, across its chunks

    def for_choice(self) -> Formatter:
        """This response's formatter for one of its choices (`n` > 1): completions logprobs count
        `text_offset` through each choice's own text."""
        other = copy.copy(self)
        other.logprobs = None if self.logprobs is None else LogprobsFormatter(self.chat)
        return other

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(
        self, text: str | None, finish_reason: str | None, role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def opening(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return self._chunk("", None, role=True) if self.chat else None

    def text(self, text: str, logprobs: Sequence[TokenLogprobs] = (), decided: str = "") -> dict[str, Any]:
        """A chunk of text, with the entries of the tokens the pipeline's chunk carried (their text
        may come in a later chunk: text that might start a stop string is held back), and their
        letters where the request asked (`decided`)."""
        entries = None if self.logprobs is None else self.logprobs.format(logprobs)
        chunk = self._chunk(text, None, logprobs=entries)
        return chunk | decided_field(decided) if self.decided else chunk

    def closing(self, done: Result) -> dict[str, Any]:
        """The chunk carrying finish_reason, with the speculation stats (an extension). No usage: as
        OpenAI's, a stream carries it only in the include_usage chunk, so a client counts it once."""
        chunk = self._chunk(None, FINISH_REASONS[done.finish_reason])
        return chunk | {"speculation": speculation_stats(done)}

    def usage_chunk(self, done: Result) -> dict[str, Any]:
        """stream_options.include_usage: one more chunk, with no choices, the only one with usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": usage(done, self.prompt_tokens)}

    def response(self, done: Result) -> dict[str, Any]:
        reason = FINISH_REASONS[done.finish_reason]
        logprobs = None if self.logprobs is None else LogprobsFormatter(self.chat).format(done.logprobs or [])
        if self.chat:
            message = {"role": "assistant", "content": done.text}
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": done.text, "logprobs": logprobs, "finish_reason": reason}
            body = self._envelope("text_completion", [choice])
        return body | {"usage": usage(done, self.prompt_tokens), "speculation": speculation_stats(done)}


_json = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"


def event(data: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return b"data: " + _json.encode(data) + b"\n\n"

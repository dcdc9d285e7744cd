"""The HTTP API's shared core: what every surface (api/chat.py, api/completions.py, api/responses.py)
does the same way, so that each of those modules holds only what is its own.

A request's path: its surface decodes the body into a typed struct (a wrong type names its field in
the 400) and builds the prompt; this module turns the sampling fields every surface shares into the
pipeline's `Submit` (`sampling_params`, `speculation`, `make_submit`); the gateway (api/server.py,
api/generation.py) runs it; the surface's formatter, on the `Formatter` base here, turns the
pipeline's chunks and final `Result` into the events and the response its clients parse.

Unknown fields are ignored, as OpenAI-compatible servers do; known OpenAI features this server lacks
are refused by name unless they ask for nothing (`refuse_unsupported`). The sampling controls
(OpenAI's logit_bias, presence and frequency penalties; vLLM's top_k, min_p, repetition_penalty) are
served, exactly under speculation (`decoding.controls`), and so are log-probabilities
(`api.logprobs_format`) and structured output (`decoding.grammar`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from pipeline.api.errors import ApiError, pipeline_error
from pipeline.api.extension import SpeclanesOptions, decided_field
from pipeline.api.logprobs_format import LogprobsFormatter
from pipeline.decoding.grammar.format import ResponseFormatError, canonical_response_format
from pipeline.decoding.logprobs import TokenLogprobs
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import MAX_TOKENS_LIMIT, SamplingParams
from pipeline.decoding.speculation import Speculation, SpeculationError
from pipeline.protocol.client import submit_message
from pipeline.protocol.messages import Submit

# A request that names no max_tokens (and gateway.default_max_tokens is 0) runs to its end of sequence
# or to the context's end, as vLLM's do: SamplingParams' largest value, which the context always cuts.
NO_MAX_TOKENS = MAX_TOKENS_LIMIT
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request that names no temperature samples
MAX_TEMPERATURE = 2.0  # OpenAI refuses more


# --- requests -------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SpeculationOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The extension field `speculation`: which drafter, how many draft tokens per step."""

    drafter: str | None = None
    k: int | Literal["auto"] | None = None
    max_iterations: int | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """The fields every surface takes with the same meaning; each surface's request adds its own."""

    model: str | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's spelling; -1 or 0 disables it)
    seed: int | None = None
    stream: bool | None = None
    ignore_eos: bool | None = None  # extension (as vLLM): keep generating past end-of-sequence
    speculation: SpeculationOptions | None = None  # extension
    speclanes: SpeclanesOptions | None = None  # extension (api/extension.py): the web page asks for it
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None  # extension (vLLM)
    repetition_penalty: float | None = None  # extension (vLLM)


def check_model(requested: str | None, model_id: str) -> None:
    """The one model this pipeline serves; a request that names none gets it too."""
    if requested is not None and requested != model_id:
        raise ApiError(
            404,
            f"the model `{requested}` does not exist; this server serves `{model_id}`",
            param="model",
            code="model_not_found",
        )


def refuse_unsupported(asks: Mapping[str, bool]) -> None:
    """Refuse, by name, a feature this server cannot do that the request asks for (`asks[name]`)."""
    for name, asked in asks.items():
        if asked:
            raise ApiError(
                400, f"{name} is not supported by this server", param=name, code="unsupported_parameter"
            )


def sampling_params(
    req: SamplingFields, *, max_tokens: int | None, max_tokens_name: str, default_max_tokens: int = 0,
    stop: str | list[str] | None = None, logprobs: int | None = None, response_format: str | None = None,
) -> SamplingParams:  # fmt: skip
    """The pipeline's settings for a request. `max_tokens` is the surface's limit field (named
    `max_tokens_name` in a 400); `default_max_tokens` (gateway.default_max_tokens) caps a request that
    names none (0: no cap)."""
    if max_tokens is None:
        max_tokens = default_max_tokens or NO_MAX_TOKENS
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    try:
        return SamplingParams(
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=stops,
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            response_format=response_format,
            **_controls(req),
        )
    except ValueError as exc:  # SamplingParams names the setting first ("top_p must be ...")
        name = str(exc).split()[0]
        raise ApiError(400, str(exc), param=max_tokens_name if name == "max_tokens" else name) from None


def _controls(req: SamplingFields) -> dict[str, Any]:
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


def response_format(value: Mapping[str, Any] | None, param: str = "response_format") -> str | None:
    """A structured-output format (json_object, json_schema, or this server's grammar extension) as the
    canonical text `SamplingParams` carries; its shape is checked here, the schema by the orchestrator
    (the grammar library compiles it there)."""
    try:
        return canonical_response_format(value)
    except ResponseFormatError as exc:
        raise ApiError(400, str(exc).replace("response_format", param, 1), param=param) from None


def speculation(options: SpeculationOptions | None) -> dict[str, Any]:
    """The request's overrides, checked by `Speculation` itself; the pipeline applies its defaults."""
    if options is None:
        return {}
    k = None if options.k == "auto" else options.k
    try:
        Speculation().overridden(drafter=options.drafter, k=k, max_iterations=options.max_iterations)
    except SpeculationError as exc:
        raise ApiError(400, f"speculation.{exc}", param=f"speculation.{exc.field}") from None
    return {"drafter": options.drafter, "k": k, "max_iterations": options.max_iterations}


def make_submit(req: SamplingFields, params: SamplingParams, **prompt: Any) -> Submit:
    """The pipeline's Submit: the prompt as the surface built it (`prompt`, `messages` or
    `prompt_token_ids`), its settings and the request's speculation overrides."""
    return submit_message(**prompt, params=params, **speculation(req.speculation))


@dataclass(frozen=True)
class Prepared:
    """A request checked and ready for the pipeline, as each surface's `prepare` makes it: the Submit,
    what the HTTP exchange asks for, and how its results become that surface's events."""

    submit: Submit
    formatter: Callable[[str, int, int], Formatter]  # (request id, created, prompt tokens) -> formatter
    prompt_param: str  # the field a refusal of the prompt names ("messages", "prompt", "input")
    format_param: str = "response_format"  # the field a refusal of the output's grammar names
    n: int | None = None  # the choices asked for (None: one)
    stream: bool = False
    include_usage: bool = False


# --- results --------------------------------------------------------------------------

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
    """Chunks and responses for one request; each chunk-streaming surface (chat, completions) says
    what its chunk and its response hold (`_chunk`, `response`)."""

    object_chunk = ""  # the `object` of a streamed chunk
    chat_logprobs = False  # which of the two logprobs shapes (api/logprobs_format.py)

    def __init__(
        self, response_id: str, model: str, created: int, prompt_tokens: int, logprobs: bool = False,
        decided: bool = False,
    ) -> None:  # fmt: skip
        self.id, self.model, self.created, self.prompt_tokens = response_id, model, created, prompt_tokens
        self.logprobs = LogprobsFormatter(self.chat_logprobs) if logprobs else None  # across a stream
        self.decided = decided  # text chunks carry how their tokens were decided (api/extension.py)

    def for_choice(self) -> Formatter:
        """This response's formatter for one of its choices (`n` > 1): each choice's stream keeps its
        own state (completions logprobs count `text_offset` through each choice's own text)."""
        other = copy.copy(self)
        other.logprobs = None if self.logprobs is None else LogprobsFormatter(self.chat_logprobs)
        return other

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
        }  # fmt: skip

    def _chunk(
        self, text: str | None, finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, items: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.logprobs.format(items)

    def opening(self) -> dict[str, Any] | None:
        """The chunk a stream opens with, if its surface has one."""
        return None

    def text(
        self, text: str, logprobs: Sequence[TokenLogprobs] = (), decided: str = ""
    ) -> dict[str, Any] | None:
        """A chunk of text, with the entries of the tokens the pipeline's chunk carried (their text
        may come in a later chunk: text that might start a stop string is held back), and their
        letters where the request asked (`decided`); None when there is nothing to send."""
        if not (text or logprobs or (self.decided and decided)):
            return None
        chunk = self._chunk(text, None, logprobs=self._logprobs(logprobs))
        return chunk | decided_field(decided) if self.decided else chunk

    def finish_reason(self, done: Result) -> str:
        return FINISH_REASONS[done.finish_reason]

    def closing(self, done: Result) -> dict[str, Any]:
        """The chunk carrying finish_reason, with the speculation stats (an extension). No usage: as
        OpenAI's, a stream carries it only in the include_usage chunk, so a client counts it once."""
        return self._chunk(None, self.finish_reason(done)) | {"speculation": speculation_stats(done)}

    def usage_chunk(self, done: Result) -> dict[str, Any]:
        """stream_options.include_usage: one more chunk, with no choices, the only one with usage."""
        return self._envelope(self.object_chunk, []) | {"usage": usage(done, self.prompt_tokens)}

    def response(self, done: Result) -> dict[str, Any]:
        raise NotImplementedError

    def _whole_logprobs(self, done: Result) -> dict[str, Any] | None:
        """A whole response's entries, from a fresh formatter (offsets count from its start)."""
        if self.logprobs is None:
            return None
        return LogprobsFormatter(self.chat_logprobs).format(done.logprobs or [])

    def _finished(self, body: dict[str, Any], done: Result) -> dict[str, Any]:
        return body | {"usage": usage(done, self.prompt_tokens), "speculation": speculation_stats(done)}

    # --- as Server-Sent Events: what api/generation.py streams -----------------------

    def stream_opening(self) -> list[bytes]:
        return [] if (opening := self.opening()) is None else [event(opening)]

    def stream_text(self, text: str, logprobs: Sequence[TokenLogprobs], decided: str) -> list[bytes]:
        return [] if (chunk := self.text(text, logprobs, decided)) is None else [event(chunk)]

    def stream_closing(self, done: Result, include_usage: bool) -> list[bytes]:
        closing = [event(self.closing(done))]
        return [*closing, event(self.usage_chunk(done))] if include_usage else closing

    def stream_error(self, error: ApiError) -> list[bytes]:
        return [event(error.body())]

    stream_end = b"data: [DONE]\n\n"  # the last event of every stream, an error's too


_json = msgspec.json.Encoder()
DONE_EVENT = Formatter.stream_end


def event(data: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return b"data: " + _json.encode(data) + b"\n\n"

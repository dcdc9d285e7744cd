"""`POST /v1/completions`: OpenAI's text completions. What is its own: one prompt (text or token
ids), the completions spelling of logprobs, and the `text_completion` chunk and response; the rest
is the shared core's (api/core.py)."""

from __future__ import annotations

from typing import Any

from pipeline.api import core
from pipeline.api.errors import ApiError, decode_json
from pipeline.api.extension import asks_decided
from pipeline.api.logprobs_format import requested
from pipeline.decoding.result import Result
from pipeline.observability.request_ids import RESPONSE_PREFIXES
from pipeline.protocol.messages import Submit


class CompletionRequest(core.SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]  # text, [text], token ids or [token ids] (one prompt)
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream_options: core.StreamOptions | None = None
    logprobs: bool | int | None = None  # how many alternatives per token
    top_logprobs: int | None = None  # chat's spelling: refused here by name
    response_format: dict[str, Any] | None = None  # structured output, as vLLM has it on completions
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


def decode(body: bytes) -> CompletionRequest:
    """Malformed JSON, a wrong type or a missing field: a 400 naming the field."""
    return decode_json(body, CompletionRequest)


def prepare(body: bytes, model_id: str, default_max_tokens: int = 0) -> core.Prepared:
    """A body as the gateway runs it (api/generation.py)."""
    req = decode(body)
    submit = to_submit(req, model_id, default_max_tokens)

    decided = asks_decided(req.speclanes, req.stream)

    def formatter(request_id: str, created: int, prompt_tokens: int) -> TextFormatter:
        logprobs = submit.params.logprobs is not None
        return TextFormatter(request_id, model_id, created, prompt_tokens, logprobs=logprobs, decided=decided)

    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return core.Prepared(
        submit, formatter, "prompt", n=req.n, stream=bool(req.stream), include_usage=include_usage
    )


def to_submit(req: CompletionRequest, model_id: str, default_max_tokens: int = 0) -> Submit:
    """Every check a request gets before it reaches the pipeline, then the pipeline's Submit."""
    core.check_model(req.model, model_id)
    core.refuse_unsupported(
        {"best_of": req.best_of not in (None, 1), "echo": bool(req.echo), "suffix": bool(req.suffix)}
    )
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    params = core.sampling_params(
        req, max_tokens=req.max_tokens, max_tokens_name="max_tokens", default_max_tokens=default_max_tokens,
        stop=req.stop, logprobs=requested(False, req.logprobs, req.top_logprobs),
        response_format=core.response_format(req.response_format),
    )  # fmt: skip
    prompt = _one_prompt(req.prompt)
    if isinstance(prompt, list):
        return core.make_submit(req, params, prompt_token_ids=prompt)
    return core.make_submit(req, params, prompt=prompt)


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


class TextFormatter(core.Formatter):
    """`text_completion` chunks and responses."""

    object_chunk = "text_completion"

    def __init__(
        self, request_id: str, model: str, created: int, prompt_tokens: int, logprobs: bool = False,
        decided: bool = False,
    ) -> None:  # fmt: skip
        prefixed = RESPONSE_PREFIXES["text"] + request_id  # what `audit show` takes
        super().__init__(prefixed, model, created, prompt_tokens, logprobs, decided)

    def _chunk(
        self, text: str | None, finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])

    def response(self, done: Result) -> dict[str, Any]:
        choice = {
            "index": 0, "text": done.text, "logprobs": self._whole_logprobs(done),
            "finish_reason": self.finish_reason(done),
        }  # fmt: skip
        return self._finished(self._envelope("text_completion", [choice]), done)

"""`POST /v1/chat/completions`: OpenAI's chat completions. What is its own: the messages
(api/chat_messages.py), the chat spelling of logprobs and of the token limit, and the
`chat.completion` chunk and response; the rest is the shared core's (api/core.py)."""

from __future__ import annotations

from typing import Any

from pipeline.api import core
from pipeline.api.chat_messages import ChatMessage, chat_messages
from pipeline.api.errors import ApiError, decode_json
from pipeline.api.extension import asks_decided
from pipeline.api.logprobs_format import requested
from pipeline.decoding.result import Result
from pipeline.observability.request_ids import RESPONSE_PREFIXES
from pipeline.protocol.messages import Submit


class ChatRequest(core.SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    stop: str | list[str] | None = None
    n: int | None = None
    stream_options: core.StreamOptions | None = None
    logprobs: bool | int | None = None  # true or false
    top_logprobs: int | None = None  # how many alternatives (with logprobs: true)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    # OpenAI's legacy spelling of tools: refused by name like them, never silently ignored.
    functions: list[Any] | None = None
    function_call: Any = None


def decode(body: bytes) -> ChatRequest:
    """Malformed JSON, a wrong type or a missing field: a 400 naming the field."""
    return decode_json(body, ChatRequest)


def prepare(body: bytes, model_id: str, default_max_tokens: int = 0) -> core.Prepared:
    """A body as the gateway runs it (api/generation.py)."""
    req = decode(body)
    submit = to_submit(req, model_id, default_max_tokens)

    decided = asks_decided(req.speclanes, req.stream)

    def formatter(request_id: str, created: int, prompt_tokens: int) -> ChatFormatter:
        logprobs = submit.params.logprobs is not None
        return ChatFormatter(request_id, model_id, created, prompt_tokens, logprobs=logprobs, decided=decided)

    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return core.Prepared(
        submit, formatter, "messages", n=req.n, stream=bool(req.stream), include_usage=include_usage
    )


def to_submit(req: ChatRequest, model_id: str, default_max_tokens: int = 0) -> Submit:
    """Every check a request gets before it reaches the pipeline, then the pipeline's Submit."""
    core.check_model(req.model, model_id)
    asks = {"tools": bool(req.tools), "functions": bool(req.functions)}
    core.refuse_unsupported(asks | {"function_call": req.function_call not in (None, "none")})
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = core.sampling_params(
        req, max_tokens=limit, default_max_tokens=default_max_tokens,
        max_tokens_name="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
        stop=req.stop, logprobs=requested(True, req.logprobs, req.top_logprobs),
        response_format=core.response_format(req.response_format),
    )  # fmt: skip
    return core.make_submit(req, params, messages=chat_messages(req.messages))


class ChatFormatter(core.Formatter):
    """`chat.completion` chunks and responses: the assistant's message."""

    object_chunk = "chat.completion.chunk"
    chat_logprobs = True

    def __init__(
        self, request_id: str, model: str, created: int, prompt_tokens: int, logprobs: bool = False,
        decided: bool = False,
    ) -> None:  # fmt: skip
        prefixed = RESPONSE_PREFIXES["chat"] + request_id  # what `audit show` takes
        super().__init__(prefixed, model, created, prompt_tokens, logprobs, decided)

    def _chunk(
        self, text: str | None, finish_reason: str | None, logprobs: dict[str, Any] | None = None,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        delta = (delta or {}) | ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])

    def opening(self) -> dict[str, Any]:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return self._chunk("", None, delta={"role": "assistant"})

    def response(self, done: Result) -> dict[str, Any]:
        message = {"role": "assistant", "content": done.text}
        choice = {
            "index": 0, "message": message, "logprobs": self._whole_logprobs(done),
            "finish_reason": self.finish_reason(done),
        }  # fmt: skip
        return self._finished(self._envelope("chat.completion", [choice]), done)

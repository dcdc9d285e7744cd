"""`POST /v1/chat/completions`: OpenAI's chat completions. What is its own: the messages
(api/chat_messages.py), tool calls (api/tools.py, api/tool_calls.py), the chat spelling of logprobs
and of the token limit, and the `chat.completion` chunk and response; the rest is the shared core's
(api/core.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.api import core, tool_calls, tools
from pipeline.api.chat_messages import ChatMessage, chat_messages, tool_fields
from pipeline.api.errors import ApiError, decode_json
from pipeline.api.extension import asks_decided, decided_field
from pipeline.api.logprobs_format import requested
from pipeline.decoding.logprobs import TokenLogprobs
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
    tools: list[tools.Tool] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None
    # OpenAI's legacy spelling of tools: the same path, answered in the legacy shape (`function_call`).
    functions: list[tools.FunctionDef] | None = None
    function_call: Any = None


def decode(body: bytes) -> ChatRequest:
    """Malformed JSON, a wrong type or a missing field: a 400 naming the field."""
    return decode_json(body, ChatRequest)


def prepare(body: bytes, model_id: str, default_max_tokens: int = 0) -> core.Prepared:
    """A body as the gateway runs it (api/generation.py)."""
    req = decode(body)
    plan = tool_plan(req)
    submit = to_submit(req, model_id, default_max_tokens, plan)
    decided = asks_decided(req.speclanes, req.stream)

    def formatter(request_id: str, created: int, prompt_tokens: int) -> ChatFormatter:
        logprobs = submit.params.logprobs is not None
        return ChatFormatter(
            request_id, model_id, created, prompt_tokens, logprobs=logprobs, decided=decided, plan=plan
        )

    include_usage = req.stream_options is not None and req.stream_options.include_usage
    calls = plan is not None and plan.calls
    return core.Prepared(
        submit, formatter, "messages", format_param=_tools_param(plan) if calls else "response_format",
        n=req.n, stream=bool(req.stream), include_usage=include_usage,
    )  # fmt: skip


def tool_plan(req: ChatRequest) -> tools.ToolPlan | None:
    return tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls, req.functions, req.function_call)


def _tools_param(plan: tools.ToolPlan | None) -> str:
    return "functions" if plan is not None and plan.legacy else "tools"


def to_submit(
    req: ChatRequest, model_id: str, default_max_tokens: int = 0, plan: tools.ToolPlan | None = None
) -> Submit:
    """Every check a request gets before it reaches the pipeline, then the pipeline's Submit."""
    core.check_model(req.model, model_id)
    plan = plan or tool_plan(req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = core.sampling_params(
        req, max_tokens=limit, default_max_tokens=default_max_tokens,
        max_tokens_name="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
        stop=req.stop, logprobs=requested(True, req.logprobs, req.top_logprobs),
        response_format=_output_format(req, plan),
    )  # fmt: skip
    return core.make_submit(
        req, params, messages=chat_messages(req.messages, plan), **tool_fields(req.messages, plan)
    )


def _output_format(req: ChatRequest, plan: tools.ToolPlan | None) -> str | None:
    """The grammar the answer follows: the tool calls' (api/tool_calls.py) where it may call, with
    the request's JSON response_format as the text answer's, else the request's response_format."""
    asked = core.response_format(req.response_format)
    if plan is None or not plan.calls:
        return asked
    answer = tool_calls.answer_schema(asked, "response_format")
    return core.response_format(
        {"type": "grammar", "grammar": tool_calls.grammar(plan, answer)}, _tools_param(plan)
    )


class ChatFormatter(core.Formatter):
    """`chat.completion` chunks and responses: the assistant's message, its text or its tool calls.
    A stream's calls are parsed as they come (api/tool_calls.py): a call's first delta carries its
    index, id and name, the next ones more of its arguments, as OpenAI streams them."""

    object_chunk = "chat.completion.chunk"
    chat_logprobs = True

    def __init__(
        self, request_id: str, model: str, created: int, prompt_tokens: int, logprobs: bool = False,
        decided: bool = False, plan: tools.ToolPlan | None = None,
    ) -> None:  # fmt: skip
        prefixed = RESPONSE_PREFIXES["chat"] + request_id  # what `audit show` takes
        super().__init__(prefixed, model, created, prompt_tokens, logprobs, decided)
        self.plan = plan if plan is not None and plan.calls else None
        self.parser = self._parser()

    def _parser(self) -> tool_calls.CallParser | None:
        return None if self.plan is None else tool_calls.CallParser(decided=self.plan.choice == "required")

    def for_choice(self) -> ChatFormatter:
        other = super().for_choice()
        assert isinstance(other, ChatFormatter)
        other.parser = other._parser()
        return other

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

    def text(
        self, text: str, logprobs: Sequence[TokenLogprobs] = (), decided: str = ""
    ) -> dict[str, Any] | None:
        if self.parser is None:
            return super().text(text, logprobs, decided)
        fields = self._delta(self.parser.feed(text))
        if not (fields or logprobs or (self.decided and decided)):
            return None
        chunk = self._chunk(None, None, logprobs=self._logprobs(logprobs), delta=fields)
        return chunk | decided_field(decided) if self.decided else chunk

    def closing(self, done: Result) -> dict[str, Any]:
        """The last chunk; under tools, with any text held back because it might have begun a call."""
        fields = {} if self.parser is None else self._delta(self.parser.finish())
        calls = self.parser is not None and bool(self.parser.calls)
        chunk = self._chunk(None, self._finish(done, calls), delta=fields)
        return chunk | {"speculation": core.speculation_stats(done)}

    def _finish(self, done: Result, calls: bool) -> str:
        """`tool_calls` (legacy: `function_call`) for an answer that called and ended by itself."""
        reason = self.finish_reason(done)
        if calls and reason == "stop" and self.plan is not None:
            return "function_call" if self.plan.legacy else "tool_calls"
        return reason

    def _delta(self, delta: tool_calls.Delta) -> dict[str, Any]:
        """A parsed piece of the answer as a chunk's delta: content, or tool_calls entries."""
        fields: dict[str, Any] = {"content": delta.content} if delta.content else {}
        if not delta.calls or self.plan is None:
            return fields
        entries = [self._call(*call) for call in tool_calls.merged([delta]).calls]
        if self.plan.legacy:  # one call: its name (first), its arguments as they come
            function: dict[str, Any] = {}
            for entry in entries:
                function |= {k: v for k, v in entry["function"].items() if k == "name"}
                function["arguments"] = function.get("arguments", "") + entry["function"]["arguments"]
            return fields | {"function_call": function}
        return fields | {"tool_calls": entries}

    def _call(self, index: int, name: str | None, arguments: str) -> dict[str, Any]:
        if name is None:
            return {"index": index, "function": {"arguments": arguments}}
        function = {"name": name, "arguments": arguments}
        return {
            "index": index,
            "id": tool_calls.call_id(self.id, index),
            "type": "function",
            "function": function,
        }

    def response(self, done: Result) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": done.text}
        calls = []
        if self.plan is not None:
            delta = tool_calls.merged(tool_calls.parse(done.text, self.plan))
            calls = [self._call(*call) for call in delta.calls]
            message["content"] = delta.content or (None if calls else "")
        if calls and self.plan is not None and self.plan.legacy:
            message["function_call"] = calls[0]["function"]
        elif calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
        choice = {
            "index": 0, "message": message, "logprobs": self._whole_logprobs(done),
            "finish_reason": self._finish(done, bool(calls)),
        }  # fmt: skip
        return self._finished(self._envelope("chat.completion", [choice]), done)

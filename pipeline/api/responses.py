"""`POST /v1/responses`: OpenAI's Responses API, its stateless subset. What is its own: `input` (a
string, or messages and function-call items) with `instructions`, `max_output_tokens`, `text.format`
for structured output, tools in the Responses spelling, and the response object and its stream of
typed events (api/response_events.py). The prompt is built as a chat request's is (api/chat_messages.py,
api/tools.py), so a turn asked either way is the same prompt.

Stateless: this server keeps no responses, so `previous_response_id` and `store: true` are refused
with a 400 that says to send the whole conversation as `input` instead.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from pipeline.api import core, tool_calls, tools
from pipeline.api.chat_messages import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    ToolCall,
    chat_messages,
    tool_fields,
)  # fmt: skip
from pipeline.api.errors import ApiError, decode_json
from pipeline.api.logprobs_format import requested
from pipeline.api.response_events import Echo, ResponseFormatter
from pipeline.protocol.messages import Submit

TEXT_PARTS = ("input_text", "output_text", "text")  # content part types that are text
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value this server answers


class Part(msgspec.Struct, kw_only=True):
    type: str
    text: Any = None


class InputItem(msgspec.Struct, kw_only=True):
    """A message (`type` "message" or absent), a function call the model made, or its output."""

    type: str = "message"
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """A tool in the Responses spelling: the function's fields at the top level."""

    type: str
    name: Annotated[str, msgspec.Meta(pattern=tools.NAME_PATTERN)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None


class ResponsesRequest(core.SamplingFields, kw_only=True):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: Any = None
    reasoning: Any = None


def decode(body: bytes) -> ResponsesRequest:
    return decode_json(body, ResponsesRequest)


def prepare(body: bytes, model_id: str, default_max_tokens: int = 0) -> core.Prepared:
    """A body as the gateway runs it (api/generation.py)."""
    req = decode(body)
    plan = tool_plan(req)
    submit = to_submit(req, model_id, default_max_tokens, plan)
    echo = Echo(
        instructions=req.instructions, max_output_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, tools=[msgspec.to_builtins(t) for t in req.tools or []],
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text_format=(req.text.format if req.text is not None else None) or {"type": "text"},
        metadata=req.metadata or {}, top_logprobs=req.top_logprobs,
    )  # fmt: skip

    def formatter(request_id: str, created: int, prompt_tokens: int) -> ResponseFormatter:
        logprobs = submit.params.logprobs is not None
        return ResponseFormatter(
            request_id, model_id, created, prompt_tokens, echo=echo, plan=plan, logprobs=logprobs
        )

    calls = plan is not None and plan.calls
    return core.Prepared(
        submit, formatter, "input", format_param="tools" if calls else "text.format", stream=bool(req.stream)
    )


def to_submit(
    req: ResponsesRequest, model_id: str, default_max_tokens: int = 0, plan: tools.ToolPlan | None = None
) -> Submit:
    """Every check a request gets before it reaches the pipeline, then the pipeline's Submit."""
    core.check_model(req.model, model_id)
    _stateless(req)
    core.refuse_unsupported({
        "include": bool(set(req.include or ()) - {LOGPROBS_INCLUDE}),
        "background": bool(req.background), "conversation": req.conversation is not None,
        "reasoning": req.reasoning is not None,
    })  # fmt: skip
    plan = plan or tool_plan(req)
    params = core.sampling_params(
        req, max_tokens=req.max_output_tokens, max_tokens_name="max_output_tokens",
        default_max_tokens=default_max_tokens, response_format=_output_format(req, plan),
        logprobs=requested(True, asks_logprobs(req), req.top_logprobs),
    )  # fmt: skip
    turns = _messages(req)
    return core.make_submit(req, params, messages=chat_messages(turns, plan), **tool_fields(turns, plan))


def asks_logprobs(req: ResponsesRequest) -> bool:
    """OpenAI's Responses API gives each output_text its tokens' logprobs when `include` names them;
    `top_logprobs` alone asks for them too, as a client setting it means to see them."""
    return LOGPROBS_INCLUDE in (req.include or ()) or bool(req.top_logprobs)


def _stateless(req: ResponsesRequest) -> None:
    """This server stores no responses: a request that needs one stored, or refers to one, is a 400."""
    if req.previous_response_id is not None:
        raise ApiError(
            400, "previous_response_id is not supported: this server stores no responses; send the whole "
            "conversation as input", param="previous_response_id", code="unsupported_parameter",
        )  # fmt: skip
    if req.store:
        raise ApiError(
            400, "store: true is not supported: this server stores no responses; leave store out or set it "
            "to false", param="store", code="unsupported_parameter",
        )  # fmt: skip


def tool_plan(req: ResponsesRequest) -> tools.ToolPlan | None:
    """The Responses spelling of tools and tool_choice, as the chat spelling that api/tools.py reads."""
    functions = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function" or tool.name is None:
            raise ApiError(
                400, f"tools.{i}: only function tools with a name are supported, got type {tool.type!r}",
                param=f"tools.{i}.type", code="unsupported_parameter",
            )  # fmt: skip
        function = tools.FunctionDef(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
        )
        functions.append(tools.Tool(type="function", function=function))
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools.plan(functions, choice, req.parallel_tool_calls)


def _output_format(req: ResponsesRequest, plan: tools.ToolPlan | None) -> str | None:
    """text.format (its json_schema spelling has the schema's fields at the top), or the tool calls'
    grammar with it as the text answer's, as for chat."""
    spec = req.text.format if req.text is not None else None
    if spec is not None and spec.get("type") == "json_schema":
        inner = {k: spec[k] for k in ("name", "schema", "strict") if k in spec}
        spec = {"type": "json_schema", "json_schema": inner}
    asked = core.response_format(spec, "text.format")
    if plan is None or not plan.calls:
        return asked
    answer = tool_calls.answer_schema(asked, "text.format")
    return core.response_format({"type": "grammar", "grammar": tool_calls.grammar(plan, answer)}, "tools")


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` and `input` as chat messages: function calls join the assistant's turn, their
    outputs are tool messages."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return [*messages, ChatMessage(role="user", content=req.input)]
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        if item.type == "message":
            if item.role is None:
                raise ApiError(400, f"{where}.role is missing", param=f"{where}.role")
            messages.append(ChatMessage(role=item.role, content=_text(item.content, f"{where}.content")))
        elif item.type == "function_call":
            if item.name is None:
                raise ApiError(400, f"{where}.name is missing", param=f"{where}.name")
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments or "{}")
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            content = _text(item.output, f"{where}.output")
            messages.append(ChatMessage(role="tool", content=content, tool_call_id=item.call_id))
        else:
            raise ApiError(
                400, f"{where}.type: {item.type!r} items are not supported (message, function_call, "
                "function_call_output)", param=f"{where}.type", code="unsupported_parameter",
            )  # fmt: skip
    return messages


def _text(content: str | list[Part] | None, where: str) -> str | list[ContentPart] | None:
    """Content as chat messages hold it: the Responses text part types become text parts; any other
    (an image, a file) is refused by name."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise ApiError(
                400, f"{where}.{j}: content parts of type {part.type!r} are not supported (only text)",
                param=f"{where}.{j}.type", code="unsupported_parameter",
            )  # fmt: skip
        parts.append(ContentPart(type="text", text=part.text))
    return parts

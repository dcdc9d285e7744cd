"""Chat messages as OpenAI's API defines them, checked before they reach the chat template, and the
tool turns among them written in this server's tool format.

A message the template would render wrongly (an unknown role dropped or mislabelled, a null
content rendered as "None" or as nothing) is refused here with a 400 whose `param` names the
field (`messages.2.role`, `messages.0.content.1.type`): the client learns what to fix instead of
getting a completion of a prompt it did not mean. What this server cannot do (images, audio,
files) is refused by name, never dropped silently.

Tools reach the model as plain messages, so every chat template renders them (the fallback format,
documented in docs/api.md): the offered functions and how to call them in a system message; an
assistant's earlier calls as the `<tool_call>` blocks it would write (api/tool_calls.py); a tool's
result as a user message holding a `<tool_response>` block (consecutive results in one message, so
templates that insist on alternating roles accept them). The same turns also go structured, with the
`tools` array (`tool_fields`), for a model whose own template renders tools (model/tool_templates.py).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pipeline.api.errors import ApiError
from pipeline.api.tool_calls import arguments_object, call_text
from pipeline.api.tools import ToolPlan, describe, function_spec

# `developer` is OpenAI's newer name for `system`; the chat templates know only `system`.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TOOL_ROLES = ("tool", "function")  # a tool's result; `function` is the legacy spelling
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"


class ContentPart(msgspec.Struct):
    type: str
    text: Any = None  # checked here, so a wrong type is named like every other content problem


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # the legacy spelling of one call
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None


def chat_messages(messages: list[ChatMessage], plan: ToolPlan | None = None) -> list[dict[str, str]]:
    """The messages as the chat template takes them: {"role", "content"} with text content; the
    offered tools in the system message, tool turns in the fallback format."""
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        role = _role(message, i)
        if role == "tool":
            result = RESPONSE_OPEN + _content(message, i) + RESPONSE_CLOSE
            if out and out[-1]["role"] == "user" and out[-1]["content"].endswith(RESPONSE_CLOSE):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
        elif role == "assistant":
            out.append({"role": role, "content": _assistant(message, i)})
        else:
            out.append({"role": role, "content": _content(message, i)})
    if plan is not None and plan.calls:
        out = _with_tools(out, plan)
    return out


def tool_fields(messages: list[ChatMessage], plan: ToolPlan | None) -> dict[str, Any]:
    """Submit's `tools` and `tool_messages` where the answer may call: the conversation as a
    template that renders tools takes it (HF's convention: arguments as objects, results as `tool`
    messages with the id of the call they answer)."""
    if plan is None or not plan.calls:
        return {}
    tools = [{"type": "function", "function": function_spec(f)} for f in plan.offered]
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, calls = _role(message, i), _calls(message)
        content = None if calls and message.content is None else _content(message, i)
        turn: dict[str, Any] = {"role": role, "content": content}
        if role == "tool":
            turn |= {"tool_call_id": message.tool_call_id, "name": message.name}
        if calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": arguments_object(c.function.arguments)}}
                for c in calls
            ]  # fmt: skip
        turns.append(turn)
    return {"tools": tools, "tool_messages": turns}


def _calls(message: ChatMessage) -> list[ToolCall]:
    """An assistant's calls, the legacy `function_call` among them."""
    legacy = [ToolCall(function=message.function_call)] if message.function_call is not None else []
    return [*(message.tool_calls or []), *legacy]


def _role(message: ChatMessage, index: int) -> str:
    where = f"messages.{index}"
    if message.role in TOOL_ROLES:
        return "tool"
    if message.role not in ROLES:
        known = ", ".join([*ROLES, *TOOL_ROLES])
        raise ApiError(400, f"{where}.role: {message.role!r} is not a role ({known})", param=f"{where}.role")
    for name in ("tool_calls", "function_call"):
        if getattr(message, name) and message.role != "assistant":
            raise ApiError(
                400, f"{where}.{name}: only an assistant's message calls tools", param=f"{where}.{name}"
            )
    return ROLES[message.role]


def _assistant(message: ChatMessage, index: int) -> str:
    """An assistant's turn: its text, then its calls as it would have written them."""
    calls = _calls(message)
    if not calls:
        return _content(message, index)
    blocks = [call_text(c.function.name, _arguments(c.function.arguments)) for c in calls]
    text = "" if message.content is None else _content(message, index)
    return "\n".join([text, *blocks] if text else blocks)


def _arguments(arguments: str | dict[str, Any]) -> str:
    """Arguments as the grammar writes them (compact JSON), or the client's text when not JSON."""
    value = arguments_object(arguments)
    if isinstance(value, str) and value == arguments:
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _with_tools(messages: list[dict[str, str]], plan: ToolPlan) -> list[dict[str, str]]:
    """The offered functions and how to call them, in the system message (one is added if none)."""
    lines = [
        "You can call functions. Each is given as JSON: its name, what it does, and a JSON Schema of "
        "its arguments.",
        *(describe(function) for function in plan.offered),
        "To call a function, answer with one block like this per call, and nothing else:",
        call_text("<function name>", "<arguments as a JSON object>"),
        "Each result comes back in a <tool_response> block.",
    ]
    if plan.named is not None:
        lines.append(f"Call {plan.named} now.")
    elif plan.choice == "required":
        lines.append("Call a function now.")
    else:
        lines.append("If no function helps, answer in text.")
    tools = "\n".join(lines)
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + tools}, *messages[1:]]
    return [{"role": "system", "content": tools}, *messages]


def _content(message: ChatMessage, index: int) -> str:
    where = f"messages.{index}.content"
    content = message.content
    if content is None:  # OpenAI allows it only beside tool calls
        raise ApiError(
            400, f"{where} is missing or null: give a string or a list of text parts", param=where
        )  # fmt: skip
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise ApiError(
                400, f"{where}.{j}: content parts of type {part.type!r} are not supported (only 'text')",
                param=f"{where}.{j}.type", code="unsupported_parameter",
            )  # fmt: skip
        if not isinstance(part.text, str):
            raise ApiError(400, f"{where}.{j}.text must be a string", param=f"{where}.{j}.text")
        texts.append(part.text)
    return "".join(texts)

"""Chat messages as OpenAI's API defines them, checked before they reach the chat template.

A message the template would render wrongly (an unknown role dropped or mislabelled, a null
content rendered as "None" or as nothing) is refused here with a 400 whose `param` names the
field (`messages.2.role`, `messages.0.content.1.type`): the client learns what to fix instead of
getting a completion of a prompt it did not mean. What this server cannot do (tool calls, images,
audio, files) is refused by name, never dropped silently.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.api.errors import ApiError

# `developer` is OpenAI's newer name for `system`; the chat templates know only `system`.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TOOL_ROLES = ("tool", "function")


class ContentPart(msgspec.Struct):
    type: str
    text: Any = None  # checked here, so a wrong type is named like every other content problem


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None
    function_call: dict[str, Any] | None = None


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template takes them: {"role", "content"} with text content."""
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    return [{"role": _role(m, i), "content": _content(m, i)} for i, m in enumerate(messages)]


def _role(message: ChatMessage, index: int) -> str:
    where = f"messages.{index}"
    if message.role in TOOL_ROLES:
        raise ApiError(
            400, f"{where}.role: {message.role!r} messages answer tool calls, and this server does not "
            "support tools", param=f"{where}.role", code="unsupported_parameter",
        )  # fmt: skip
    if message.role not in ROLES:
        known = ", ".join(ROLES)
        raise ApiError(400, f"{where}.role: {message.role!r} is not a role ({known})", param=f"{where}.role")
    for name in ("tool_calls", "function_call"):
        if getattr(message, name):
            raise ApiError(
                400, f"{where}.{name}: this server does not support tools",
                param=f"{where}.{name}", code="unsupported_parameter",
            )  # fmt: skip
    return ROLES[message.role]


def _content(message: ChatMessage, index: int) -> str:
    where = f"messages.{index}.content"
    content = message.content
    if content is None:  # OpenAI allows it only beside tool_calls, which are refused above
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

"""The HTTP API's two chunk-streaming surfaces (api/chat.py, api/completions.py) behind one call, as
the wire-format tests take them: a body and whether it is a chat request."""

from __future__ import annotations

from pipeline.api import chat, completions
from pipeline.api.chat import ChatRequest
from pipeline.api.completions import CompletionRequest
from pipeline.protocol.messages import Submit


def decode_request(body: bytes, is_chat: bool) -> ChatRequest | CompletionRequest:
    return chat.decode(body) if is_chat else completions.decode(body)


def to_submit(req: ChatRequest | CompletionRequest, model: str, default_max_tokens: int = 0) -> Submit:
    if isinstance(req, ChatRequest):
        return chat.to_submit(req, model, default_max_tokens)
    return completions.to_submit(req, model, default_max_tokens)

"""`POST /tokenize` and `POST /detokenize` as pure functions: bodies in, pipeline messages out;
the orchestrator's replies in, response bodies out.

Clients of both llama-server and vLLM call these paths, with different field names, so both
spellings are taken and both answered:
- tokenize: the text as `content` (llama-server) or `prompt` (vLLM), or chat `messages` (vLLM,
  rendered through the chat template as a chat completion's prompt is); `add_special` (llama-server)
  or `add_special_tokens` (vLLM) for the BOS token, by default as a completion's prompt gets it;
  `with_pieces` (llama-server). The answer has `tokens` (ids, or {"id", "piece"} objects with
  pieces), plus vLLM's `count` and `max_model_len`.
- detokenize: `tokens` in; the text out as both `content` (llama-server) and `prompt` (vLLM).
Naming the same thing twice (`content` and `prompt`) is a 400, as is any other malformed body.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.api.chat_messages import ChatMessage, chat_messages
from pipeline.api.errors import ApiError, decode_json
from pipeline.protocol.messages import Detokenize, Tokenize, Tokens


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    content: str | None = None  # llama-server
    prompt: str | None = None  # vLLM
    messages: list[ChatMessage] | None = None  # vLLM's chat form
    add_special: bool | None = None  # llama-server
    add_special_tokens: bool | None = None  # vLLM
    add_generation_prompt: bool = True  # vLLM, with messages
    with_pieces: bool = False  # llama-server
    return_token_strs: bool | None = None  # vLLM: not supported


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def _one_of(names: dict[str, object]) -> None:
    given = [name for name, value in names.items() if value is not None]
    if len(given) != 1:
        listed = ", ".join(f"`{name}`" for name in names)
        detail = "none was given" if not given else f"got {' and '.join(given)}"
        raise ApiError(400, f"give exactly one of {listed}: {detail}", param=given[-1] if given else None)


def decode_tokenize(body: bytes) -> TokenizeRequest:
    return decode_json(body, TokenizeRequest)


def decode_detokenize(body: bytes) -> DetokenizeRequest:
    return decode_json(body, DetokenizeRequest)


def to_tokenize(req: TokenizeRequest) -> Tokenize:
    _one_of({"content": req.content, "prompt": req.prompt, "messages": req.messages})
    special = {"add_special": req.add_special, "add_special_tokens": req.add_special_tokens}
    if None not in special.values() and req.add_special != req.add_special_tokens:
        raise ApiError(400, "add_special and add_special_tokens disagree", param="add_special_tokens")
    if req.return_token_strs:
        raise ApiError(
            400, "return_token_strs is not supported by this server; with_pieces gives each token's text",
            param="return_token_strs", code="unsupported_parameter",
        )  # fmt: skip
    add_special = req.add_special if req.add_special is not None else req.add_special_tokens
    messages = chat_messages(req.messages) if req.messages is not None else None
    return Tokenize(
        text=req.content if req.content is not None else req.prompt, messages=messages,
        add_special=add_special, add_generation_prompt=req.add_generation_prompt, with_pieces=req.with_pieces,
    )  # fmt: skip


def piece(data: bytes) -> str | list[int]:
    """llama-server's form: the text, or the bytes when they are not whole UTF-8 characters."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return list(data)


def tokenize_response(reply: Tokens, with_pieces: bool) -> dict[str, Any]:
    tokens: list[Any] = list(reply.tokens)
    if with_pieces:
        tokens = [{"id": t, "piece": piece(p)} for t, p in zip(reply.tokens, reply.pieces, strict=True)]
    return {"tokens": tokens, "count": len(reply.tokens), "max_model_len": reply.context_length}


def to_detokenize(req: DetokenizeRequest) -> Detokenize:
    return Detokenize(tokens=req.tokens)


def detokenize_response(text: str) -> dict[str, str]:
    return {"content": text, "prompt": text}

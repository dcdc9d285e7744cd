"""Log-probabilities in the OpenAI API: what a request asks for, and the two response shapes.

- Chat: `logprobs: true` with `top_logprobs` 0..20 gives each choice (and each streamed chunk, for the
  tokens of its delta) `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
- Completions: `logprobs: N` (0..20; OpenAI caps it at 5, vLLM at 20 as here) gives `{"tokens",
  "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}`; each dict holds the N
  likeliest tokens and the chosen one, as OpenAI documents ("up to logprobs + 1").

The numbers and which distribution they describe: `decoding.logprobs`. Every served token has an
entry (the end-of-sequence token too, which counts as a completion token but adds no text).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from pipeline.api.errors import ApiError
from pipeline.decoding.logprobs import TokenLogprobs, token_string
from pipeline.decoding.sampling import TOP_LOGPROBS_LIMIT


def requested(chat: bool, logprobs: bool | int | None, top_logprobs: int | None) -> int | None:
    """`SamplingParams.logprobs` for a request's fields (None: none asked for); a 400 naming the
    field for a value neither API takes."""
    limit = f"0 to {TOP_LOGPROBS_LIMIT}"
    if chat:
        if isinstance(logprobs, int) and not isinstance(logprobs, bool):
            message = "logprobs is true or false in chat; top_logprobs says how many alternatives"
            raise ApiError(400, message, param="logprobs")
        if not logprobs:
            if top_logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        count = top_logprobs or 0
        if not 0 <= count <= TOP_LOGPROBS_LIMIT:
            raise ApiError(400, f"top_logprobs must be {limit}, got {count}", param="top_logprobs")
        return count
    if top_logprobs:
        message = "completions take logprobs: N (the alternatives per token), not top_logprobs"
        raise ApiError(400, message, param="top_logprobs", code="unsupported_parameter")
    if logprobs is None or logprobs is False:
        return None
    if logprobs is True or not 0 <= logprobs <= TOP_LOGPROBS_LIMIT:
        raise ApiError(400, f"logprobs must be a number {limit}, got {logprobs}", param="logprobs")
    return logprobs


def _chat_token(token: int, piece: bytes, logprob: float) -> dict[str, Any]:
    return {"token": token_string(piece), "logprob": logprob, "bytes": list(piece)}


class LogprobsFormatter:
    """One request's entries, in the shape of its API; completions count `text_offset` on across
    the chunks of a stream (a fresh formatter for a whole response)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.offset = 0  # characters of text so far
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def format(self, items: Sequence[TokenLogprobs]) -> dict[str, Any]:
        if self.chat:
            content = [
                _chat_token(e.token, e.piece, e.logprob)
                | {"top_logprobs": [_chat_token(t.token, t.piece, t.logprob) for t in e.top]}
                for e in items
            ]
            return {"content": content}
        return {
            "tokens": [token_string(e.piece) for e in items],
            "token_logprobs": [e.logprob for e in items],
            "top_logprobs": [
                {token_string(t.piece): t.logprob for t in e.top} | {token_string(e.piece): e.logprob}
                for e in items
            ],
            "text_offset": [self._advance(e.piece) for e in items],
        }

    def _advance(self, piece: bytes) -> int:
        """Where this token's text starts in the output: the characters decoded before it (a token
        that completes a character split across tokens starts where that character does)."""
        start = self.offset
        self.offset += len(self._decoder.decode(piece))
        return start

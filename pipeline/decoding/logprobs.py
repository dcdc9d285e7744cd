"""Log-probabilities of the emitted tokens, as pure functions on the rows the verifier already has.

Which distribution: the target's logits with the controls that make up this request's model
(`controls.shaped_logits`: logit_bias, the penalties; the grammar's mask under `response_format`),
as a float64 log-softmax, before temperature, min-p, top-k and top-p. So a token's logprob says
how likely the model (as this request shapes it) found it, not how the sampler's filters reweighed
it: the same numbers at temperature 0 and 1, and a token the grammar or a -100 bias forbids has
none (-inf: never listed). This is vLLM's `processed_logprobs` minus the sampler's own steps; the
OpenAI API does not say which it reports.

Each emitted token's row is the verify row that decided it (the prefill's last row for the first
token, the kept path's rows in a step), so these are exactly the numbers plain decoding computes
at that position (row invariance) and cost one log-softmax per emitted row, only when asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One of the likeliest tokens at a position. `piece`: the bytes the token stands for (a
    byte-level token may hold part of a UTF-8 character, so bytes, not a string, are exact)."""

    token: int
    piece: bytes
    logprob: float


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """An emitted token's log-probability and the `SamplingParams.logprobs` likeliest tokens at its
    position, most likely first (ties: the lower id first)."""

    token: int
    piece: bytes
    logprob: float
    top: list[TopLogprob] = []


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """log(softmax) of each row, in float64, without forming the probabilities (no underflow to
    -inf for unlikely tokens). -inf logits (masked, banned) stay -inf."""
    rows = np.asarray(rows, dtype=np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def likeliest(row: np.ndarray, n: int) -> list[int]:
    """The n likeliest tokens of a log-probability row, most likely first, ties by id; never a token
    of probability 0 (a row with fewer possible tokens lists fewer). A partition, not a full sort:
    this runs for every emitted token of a vocabulary of tens of thousands."""
    n = min(n, int(np.isfinite(row).sum()))
    if n <= 0:
        return []
    nth = row[np.argpartition(-row, n - 1)[n - 1]]  # the n-th largest value; ties at it go by id
    above = np.flatnonzero(row > nth)
    chosen = [*above.tolist(), *np.flatnonzero(row == nth)[: n - above.size].tolist()]
    return sorted(chosen, key=lambda t: (-row[t], t))


def entries(
    shaped: np.ndarray, tokens: Sequence[int], n: int, token_bytes: Callable[[int], bytes]
) -> list[TokenLogprobs]:
    """One entry per emitted token: row i of `shaped` (the shaped logits that decided it) and
    tokens[i], with its n likeliest alternatives."""
    logprobs = log_softmax(shaped)
    out = []
    for row, token in zip(logprobs, tokens, strict=True):
        top = [TopLogprob(t, token_bytes(t), float(row[t])) for t in likeliest(row, n)]
        out.append(TokenLogprobs(int(token), token_bytes(int(token)), float(row[token]), top))
    return out


def token_string(data: bytes) -> str:
    """A token's text as the OpenAI API spells it: the text, or for bytes that are not whole UTF-8
    characters, "bytes:" and their escapes ("bytes:\\xe2\\x80")."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def readable(items: Sequence[TokenLogprobs]) -> list[dict[str, object]]:
    """Entries as JSON objects (`--json`): the wire form is arrays, for size."""

    def one(token: int, piece: bytes, logprob: float) -> dict[str, object]:
        return {"token": token, "text": token_string(piece), "logprob": logprob}

    return [
        one(e.token, e.piece, e.logprob) | {"top_logprobs": [one(t.token, t.piece, t.logprob) for t in e.top]}
        for e in items
    ]

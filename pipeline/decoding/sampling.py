"""Sampling as pure functions on numpy arrays.

Every way of choosing a token is expressed as a probability vector (greedy is the
one-hot of the argmax), so plain decoding and speculative acceptance share one
definition of "the target's distribution", and every draw is an explicit uniform
number that can be recorded and replayed.
"""

from __future__ import annotations

import ctypes
import math
import secrets
from collections.abc import Mapping

import msgspec
import numpy as np

from pipeline.decoding.grammar.format import parse_response_format
from pipeline.decoding.noise import SAMPLE, uniform
from pipeline.model.native import loaded_kernels

MAX_TOKENS_LIMIT = 2**31 - 1  # any context is far smaller; the bound keeps every integer in 64 bits
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias: [-100, 100]; -100 bans the token (`controls`)
TOKEN_ID_LIMIT = 2**31  # any vocabulary is far smaller; the bound keeps a token id in 32 bits
PENALTY_LIMIT = 2.0  # OpenAI's (and vLLM's) range for presence and frequency penalties: [-2, 2]
TOP_LOGPROBS_LIMIT = 20  # OpenAI's (and vLLM's default) cap on the alternatives listed per token


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a request chooses tokens and when it stops. temperature 0 means greedy.

    The controls that read the context (logit_bias, the three penalties) are applied by
    `controls.shaped_logits`; min_p, like temperature, top-k and top-p, by `target_probs`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one (vLLM)
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far (OpenAI)
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far (OpenAI)
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of seen tokens (vLLM)
    # token id -> added to its logit, in [-100, 100] (OpenAI). Given as a mapping or as pairs, kept
    # as (token, bias) pairs sorted by token: a dict would make the params unhashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: `response_format` as canonical JSON text (`grammar.format`), None for free text.
    # Text, not a compiled grammar, because this struct crosses the wire; the verifier compiles it.
    response_format: str | None = None
    # Log-probabilities of the emitted tokens (`logprobs`): None, off; N, each token's own and the N
    # likeliest alternatives' (0 to 20). Here, not on the request, so it travels to the verify lane.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self._check_sampling()
        bias = self.logit_bias
        pairs = sorted((int(t), float(b)) for t, b in (bias.items() if isinstance(bias, Mapping) else bias))
        msgspec.structs.force_setattr(self, "logit_bias", tuple(pairs))
        self._check_controls()

    def _check_sampling(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_tokens > MAX_TOKENS_LIMIT:  # generation also ends where the context does
            raise ValueError(f"max_tokens must be <= {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.response_format is not None:
            if parse_response_format(self.response_format) is None:  # malformed: ResponseFormatError
                raise ValueError("response_format of type text constrains nothing: leave it unset (None)")
            if self.ignore_eos:  # past the grammar's end only EOS is allowed: it would repeat forever
                raise ValueError("response_format ends the output where its grammar ends: drop ignore_eos")
        if self.logprobs is not None and not 0 <= self.logprobs <= TOP_LOGPROBS_LIMIT:
            raise ValueError(f"logprobs must be in [0, {TOP_LOGPROBS_LIMIT}], got {self.logprobs}")

    def _check_controls(self) -> None:
        """The ranges vLLM checks (and OpenAI documents), with its messages."""
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        tokens = [token for token, _ in self.logit_bias]
        if len(set(tokens)) != len(tokens):
            raise ValueError("logit_bias names a token id twice")
        for token, bias in self.logit_bias:
            if not 0 <= token < TOKEN_ID_LIMIT:
                raise ValueError(f"logit_bias token ids must be in [0, 2**31), got {token}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def request_seed(seed: int | None) -> int:
    """The request's seed: the one asked for, or a fresh one (reported back, so the run can be
    repeated); every random number of the request is keyed by it (`noise.uniform`)."""
    if seed is None:  # from the OS's entropy, as numpy's SeedSequence() draws it, minus its set-up
        seed = secrets.randbits(63)  # (the first SeedSequence in a process took 7.7 ms of admission)
    return seed


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a token is drawn from: temperature, then min-p, then top-k, then top-p
    (vLLM's order). `logits` are the model's, or `controls.shaped_logits` of them when the
    request uses logit_bias or penalties.

    Works on one row (vocab,) or a block of rows (n, vocab); returns float64 rows
    that sum to 1. Greedy gives the one-hot of the first argmax.
    """
    if params.greedy:
        logits = np.asarray(logits, dtype=np.float64)
        probs = np.zeros_like(logits)
        np.put_along_axis(probs, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return probs
    # Every step below in float64, in place where nothing reads the input again: the same bits as
    # logits.astype(float64) / T, then np.exp(scaled - max) (`test_sampling`), in fewer passes and
    # (vocab,) arrays; a row of the default model took about a fifth less time.
    scaled = np.divide(logits, params.temperature, dtype=np.float64)
    if params.min_p > 0.0:
        scaled = _min_p(scaled, params.min_p)
    if 0 < params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k, axis=-1)[..., -params.top_k, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    top = scaled.max(axis=-1, keepdims=True)
    probs = scaled - top if params.top_p < 1.0 else np.subtract(scaled, top, out=scaled)  # _top_p reads it
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        probs = _top_p(probs, scaled, params.top_p)
    return probs


def _min_p(scaled: np.ndarray, min_p: float) -> np.ndarray:
    """Drop the tokens less than min_p times as likely as the most likely one (after temperature).
    The ratio is exp(logit - max logit), so the most likely token (ratio 1) always stays."""
    ratio = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    return np.where(ratio < min_p, -np.inf, scaled)


def _top_p(probs: np.ndarray, scaled: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest most-likely set whose mass reaches top_p (at least one token).

    Ranked by logit, not probability: logits a hair apart can round to equal
    probabilities, and the more likely token must never be the one dropped.
    """
    order = np.argsort(-scaled, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


def draw(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from one probability row with the uniform number u in [0, 1)."""
    cdf = np.cumsum(probs)
    # side="right" lands only on entries with mass; round-off can overshoot the end.
    index = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return index if index < probs.size else int(np.flatnonzero(probs)[-1])


def sample_at(probs: np.ndarray, seed: int, position: int, purpose: int = SAMPLE) -> tuple[int, float | None]:
    """A token from one probability row with the number keyed by (seed, position, purpose), and
    that number. None when only one token is possible: greedy decoding (and any filter that
    leaves one token) uses no randomness. Where this process has the native kernels loaded,
    `draw.c` counts and draws in one pass, with the same result (`test_sampling`)."""
    if (drawn := native_sample(probs, seed, position, purpose)) is not None:
        return drawn
    if np.count_nonzero(probs) == 1:  # counted, not listed: a listing cost 0.1 ms a row
        return int(np.flatnonzero(probs)[0]), None
    u = uniform(seed, position, purpose)
    return draw(probs, u), u


def native_sample(
    probs: np.ndarray, seed: int, position: int, purpose: int
) -> tuple[int, float | None] | None:
    """`sample_at` by `draw.c`, or None where the kernels are not loaded or the row is one it leaves
    to numpy (`native_draw`)."""
    if (kernels := loaded_kernels()) is None or probs.dtype != np.float64 or not probs.flags.c_contiguous:
        return None
    u = uniform(seed, position, purpose)
    if (found := native_draw(kernels, probs, u)) is None:
        return None
    index, nonzero = found
    return (index, None) if nonzero == 1 else (index, u)


def native_draw(kernels: ctypes.CDLL, probs: np.ndarray, u: float) -> tuple[int, int] | None:
    """`draw(probs, u)` and `np.count_nonzero(probs)` in one pass of `draw.c` (where one entry is
    nonzero, that entry's index), for a contiguous float64 row; None for a row it leaves to numpy
    (a NaN, an infinity, a negative entry, no mass)."""
    nonzero, last = ctypes.c_long(), ctypes.c_long()
    index = kernels.draw_f64(probs.ctypes.data, probs.size, u, ctypes.byref(nonzero), ctypes.byref(last))
    if index < 0:
        return None
    if nonzero.value == 1 or index >= probs.size:  # the one token; or round-off past the end, as `draw`
        return last.value, nonzero.value
    return index, nonzero.value


class TargetRows:
    """The target's distributions for a block of logits rows, computed only for the rows a
    verdict visits: a deterministic draft is decided row by row down the kept path, so the rows
    past the first rejection (and a tree's other branches) never need their float64
    probabilities. Greedy rows are their argmax, read from the logits as `target_probs` would
    (the one-hot of the first argmax; float32 to float64 is exact). Same tokens, same numbers as
    `sample_at(target_probs(row))`, without the (rows, vocab) arrays."""

    def __init__(self, logits: np.ndarray, params: SamplingParams) -> None:
        self.logits, self.params = logits, params
        self.best = logits.argmax(axis=-1) if params.greedy else None
        self._probs: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def probs(self, row: int) -> np.ndarray:
        if row not in self._probs:
            self._probs[row] = target_probs(self.logits[row], self.params)
        return self._probs[row]

    def sample(self, row: int, seed: int, position: int) -> tuple[int, float | None]:
        """The target's own token for `row`, with the number keyed by (seed, position)."""
        if self.best is not None:
            return int(self.best[row]), None
        return sample_at(self.probs(row), seed, position)

    def q(self, row: int, token: int) -> float:
        """The target's probability of `token` at `row`."""
        if self.best is not None:
            return float(token == int(self.best[row]))
        return float(self.probs(row)[token])


class ProbabilityRows(TargetRows):
    """Rows given as probabilities already (shaped by the controls, tests): sampled as
    `sample_at` samples."""

    def __init__(self, probs: np.ndarray) -> None:
        self.best, self._probs = None, dict(enumerate(probs))

    def __len__(self) -> int:
        return len(self._probs)

"""The sampling controls that read the context: logit_bias and the presence, frequency and
repetition penalties, as one pure function of the logits and each row's history.

Row i of a verify block decides the token after its own history: the request's context so far
(prompt, then the tokens generated so far) followed by that row's path (in a chain
[pending, d1..dk], row i's path is d1..di; in a token tree it is the path from the root to node
i). Every side that computes a target or draft row (the verify lane, the in-process loop, the
model drafter, `audit verify`) calls `shaped_logits` with the history that row conditions on, so
a position's distribution is the same function of its context whichever block, tree or batch it
was computed in, and speculation stays exact.

The semantics are vLLM's, in its order: the bias is added first (OpenAI: "-100 should result in a
ban", so -100 bans the token outright; any other bias is added); then the repetition penalty over
the prompt and the generated tokens divides a positive logit and multiplies a negative one; then
the frequency penalty (times each generated occurrence) and the presence penalty (once per
generated token) are subtracted. The penalties leave the entry of a token outside a row's history
bit for bit as it was. Temperature, min-p, top-k and top-p follow in `sampling.target_probs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.sampling import LOGIT_BIAS_LIMIT, SamplingParams, target_probs
from pipeline.decoding.tree import path


def uses_context(params: SamplingParams) -> bool:
    """Whether the request's logits are shaped at all: with none of these controls, the model's
    logits go to `target_probs` untouched (and no history is read)."""
    return bool(params.logit_bias) or penalised(params)


def penalised(params: SamplingParams) -> bool:
    return (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) != (0.0, 0.0, 1.0)


def vocabulary_problem(params: SamplingParams, vocab_size: int) -> str | None:
    """What makes the controls unusable with this vocabulary: a bias for a token id the model does
    not have, or a ban of every token (no distribution is left to draw from)."""
    outside = [t for t, _ in params.logit_bias if t >= vocab_size]
    if outside:
        return f"logit_bias names token id {min(outside)}, outside the model's vocabulary [0, {vocab_size})"
    banned = sum(bias <= -LOGIT_BIAS_LIMIT for _, bias in params.logit_bias)
    if banned >= vocab_size:
        return "logit_bias bans every token of the vocabulary (-100 bans a token)"
    return None


def shaped_logits(
    logits: np.ndarray,
    params: SamplingParams,
    context: Sequence[int],
    prompt_length: int,
    paths: Sequence[Sequence[int]],
) -> np.ndarray:
    """Rows (n, vocab) of `logits` with the controls applied, as float64; row i conditions on
    `context` (its first `prompt_length` tokens are the prompt) followed by `paths[i]`.
    Without controls the logits come back as they are (no copy, no history read)."""
    if not uses_context(params):
        return logits
    rows = np.array(logits, dtype=np.float64, ndmin=2)  # a copy: the caller's logits stay as they were
    if len(paths) != rows.shape[0]:
        raise ValueError(f"{len(paths)} row histories for {rows.shape[0]} rows")
    if params.logit_bias:
        _add_bias(rows, params.logit_bias)
    if penalised(params):
        counts = generated_counts(context[prompt_length:], paths, rows.shape[1])
        in_prompt = np.zeros(rows.shape[1], dtype=bool)
        in_prompt[np.asarray(context[:prompt_length], dtype=np.int64)] = True
        _penalise(rows, counts, in_prompt, params)
    return rows


def shaped_probs(
    logits: np.ndarray,
    params: SamplingParams,
    context: Sequence[int],
    prompt_length: int,
    paths: Sequence[Sequence[int]],
) -> np.ndarray:
    """`target_probs` of `shaped_logits`: the distribution each row's token is drawn from."""
    return target_probs(shaped_logits(logits, params, context, prompt_length, paths), params)


def chain_paths(drafts: Sequence[int]) -> list[list[int]]:
    """The row paths of a linear verify block [pending, d1..dk]: row i has seen d1..di."""
    return [list(drafts[:i]) for i in range(len(drafts) + 1)]


def row_paths(drafts: Sequence[int], parents: Sequence[int] | None) -> list[list[int]]:
    """The row paths of a verify block [pending, *drafts]: a chain (parents None), or the token tree
    whose node i continues node parents[i]: row i + 1 has seen the tokens from the root down to node i."""
    if parents is None:
        return chain_paths(drafts)
    return [[], *([drafts[node] for node in path(parents, i)] for i in range(len(drafts)))]


def generated_counts(generated: Sequence[int], paths: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """(n, vocab) occurrence counts of each row's generated history: `generated`, then its path."""
    base = np.bincount(np.asarray(generated, dtype=np.int64), minlength=vocab)
    counts = np.tile(base, (len(paths), 1))
    for row, seen in zip(counts, paths, strict=True):
        np.add.at(row, np.asarray(seen, dtype=np.int64), 1)
    return counts


def _add_bias(rows: np.ndarray, logit_bias: tuple[tuple[int, float], ...]) -> None:
    ids = np.array([token for token, _ in logit_bias], dtype=np.int64)
    bias = np.array([value for _, value in logit_bias], dtype=np.float64)
    rows[:, ids] = np.where(bias <= -LOGIT_BIAS_LIMIT, -np.inf, rows[:, ids] + bias)


def _penalise(rows: np.ndarray, counts: np.ndarray, in_prompt: np.ndarray, params: SamplingParams) -> None:
    """vLLM's `apply_penalties`, touching only the entries of tokens in each row's history."""
    generated = counts > 0
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        repeated = np.where(rows > 0, rows / penalty, rows * penalty)
        rows[...] = np.where(generated | in_prompt, repeated, rows)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        lowered = rows - params.frequency_penalty * counts - params.presence_penalty
        rows[...] = np.where(generated, lowered, rows)

"""Speculative acceptance (Leviathan et al. 2023; Chen et al. 2023) as pure functions.

Given k draft tokens, the draft distributions p they were drawn from (None for a
deterministic drafter: p is then one-hot on each draft token), and the k + 1 target
distributions q from one verify pass, keep draft token x with probability
min(1, q(x) / p(x)); at the first rejection draw from norm(max(0, q - p)); if all k are
kept draw a bonus token from q[k]. The emitted tokens are then distributed exactly as
the target alone would produce them. Greedy is the case where every q is one-hot.

A random number is drawn only when the outcome is actually uncertain, so greedy
decoding consumes no randomness and every decision can be replayed from its record.
"""

from __future__ import annotations

import msgspec
import numpy as np

from pipeline.decoding.sampling import sample_from


class Decision(msgspec.Struct, frozen=True, array_like=True):
    """One draft position's verdict, enough to audit and replay it."""

    position: int
    draft_token: int
    p: float  # draft probability of the token (1.0 for deterministic drafters)
    q: float  # target probability of the token
    u: float | None  # the uniform draw, None when the outcome was certain
    kept: bool
    replacement: int | None  # the token emitted instead, at the first rejection


class Verdict(msgspec.Struct, frozen=True):
    tokens: list[int]  # accepted draft tokens, then the correction or bonus token
    accepted: int
    decisions: list[Decision]
    final_u: float | None  # the draw that chose the correction/bonus token, if one was needed


def residual(q: np.ndarray, p: np.ndarray | None, token: int) -> np.ndarray:
    """norm(max(0, q - p)): what the target still owes after a rejection of `token`."""
    if p is None:
        rest = q.copy()
        rest[token] = 0.0
    else:
        rest = np.maximum(q - p, 0.0)
    total = rest.sum()
    # q <= p everywhere only happens through round-off (both sum to 1); q itself is then right.
    return rest / total if total > 0 else q


def verify(
    draft_tokens: list[int],
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> Verdict:
    """Accept a prefix of the draft and emit one more token; see the module docstring."""
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} draft tokens, got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"need {k} draft rows for {k} draft tokens, got {draft_probs.shape[0]}")
    decisions: list[Decision] = []
    for i, x in enumerate(draft_tokens):
        q_row = target_probs[i]
        p_x = 1.0 if draft_probs is None else float(draft_probs[i][x])
        q_x = float(q_row[x])
        u = None
        if q_x >= p_x:
            kept = True
        elif q_x == 0.0:
            kept = False
        else:
            u = float(rng.random())
            kept = u * p_x < q_x
        if not kept:
            p_row = None if draft_probs is None else draft_probs[i]
            replacement, final_u = sample_from(residual(q_row, p_row, x), rng)
            decisions.append(Decision(i, x, p_x, q_x, u, False, replacement))
            return Verdict([*draft_tokens[:i], replacement], i, decisions, final_u)
        decisions.append(Decision(i, x, p_x, q_x, u, True, None))
    bonus, final_u = sample_from(target_probs[k], rng)
    return Verdict([*draft_tokens, bonus], k, decisions, final_u)

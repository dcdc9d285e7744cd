"""Speculative acceptance as pure functions, with position-keyed random numbers
(`noise.uniform(seed, position, purpose)`).

A deterministic drafter (n-gram, suffix: p is one-hot) keeps a draft token exactly when the
target's own sample at that position, made with that position's number, equals it; the
first sample that differs is emitted instead, and when every draft is kept the next
position's sample is the bonus. This is the Leviathan rule for a one-hot p (keep with
probability q(x), else a token from q without x), and every emitted token is the very token
plain seeded decoding samples there: seeded output is identical with or without speculation.

A sampling drafter (the model drafter, with rows p) follows Leviathan et al. 2023 / Chen et
al. 2023: keep x with probability min(1, q(x) / p(x)) (number ACCEPT at its position); at
the first rejection draw from norm(max(0, q - p)) (number RESIDUAL); if all k are kept draw
the bonus from q[k] (number SAMPLE). Emitted tokens follow the target's distribution, and a
fixed seed reproduces a fixed run; they equal plain seeded decoding's only where every draft
is kept and at the bonus position.

Greedy is the case where every q is one-hot: no number is used.
"""

from __future__ import annotations

import msgspec
import numpy as np

from pipeline.decoding.noise import ACCEPT, RESIDUAL, SAMPLE, uniform
from pipeline.decoding.sampling import ProbabilityRows, TargetRows, sample_at


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
    path: list[int] = []  # the kept draft nodes (a tree's node indices; 0..accepted-1 for a chain)


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
    seed: int,
    start: int,
) -> Verdict:
    """Accept a prefix of the draft and emit one more token; see the module docstring. Row i of
    `target_probs` decides sequence position `start + i`."""
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} draft tokens, got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"need {k} draft rows for {k} draft tokens, got {draft_probs.shape[0]}")
    decisions: list[Decision] = []
    for i, x in enumerate(draft_tokens):
        q_row, position = target_probs[i], start + i
        q_x = float(q_row[x])
        if draft_probs is None:  # the target's own sample decides
            sampled, u = sample_at(q_row, seed, position, SAMPLE)
            if sampled != x:
                decisions.append(Decision(i, x, 1.0, q_x, u, False, sampled))
                return Verdict([*draft_tokens[:i], sampled], i, decisions, u, list(range(i)))
            decisions.append(Decision(i, x, 1.0, q_x, u, True, None))
            continue
        p_x, u = float(draft_probs[i][x]), None
        if q_x >= p_x:
            kept = True
        elif q_x == 0.0:
            kept = False
        else:
            u = uniform(seed, position, ACCEPT)
            kept = u * p_x < q_x
        if not kept:
            replacement, final_u = sample_at(residual(q_row, draft_probs[i], x), seed, position, RESIDUAL)
            decisions.append(Decision(i, x, p_x, q_x, u, False, replacement))
            return Verdict([*draft_tokens[:i], replacement], i, decisions, final_u, list(range(i)))
        decisions.append(Decision(i, x, p_x, q_x, u, True, None))
    bonus, final_u = sample_at(target_probs[k], seed, start + k, SAMPLE)
    return Verdict([*draft_tokens, bonus], k, decisions, final_u, list(range(k)))


def verify_tree(
    tokens: list[int], parents: list[int], target: TargetRows | np.ndarray, seed: int, start: int
) -> Verdict:
    """The deterministic rule on a token tree: from the root, sample the target's own token at
    each position (number SAMPLE, keyed by the position); while a child of the current node
    carries it, move there; the first sample no child carries is the correction, or the bonus
    below a leaf. Row 0 of `target_probs` is the pending token's and decides position `start`;
    row i + 1 is node i's. Every emitted token is the target's own seeded sample at its position
    (greedy: its argmax), so the output is plain decoding's whatever the tree held.

    Decisions: one per level reached that had children, for the child kept, or for the first
    child when none was (its `replacement` is the token emitted instead)."""
    rows = target if isinstance(target, TargetRows) else ProbabilityRows(target)
    if len(rows) != len(tokens) + 1:
        raise ValueError(f"need {len(tokens) + 1} target rows for {len(tokens)} draft nodes")
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    decisions: list[Decision] = []
    kept: list[int] = []
    node = -1
    while True:
        depth = len(kept)
        sampled, u = rows.sample(node + 1, seed, start + depth)
        below = children.get(node, [])
        match = next((c for c in below if tokens[c] == sampled), None)
        if match is None:
            if below:
                first = tokens[below[0]]
                decisions.append(Decision(depth, first, 1.0, rows.q(node + 1, first), u, False, sampled))
            return Verdict([*(tokens[n] for n in kept), sampled], depth, decisions, u, kept)
        decisions.append(Decision(depth, sampled, 1.0, rows.q(node + 1, sampled), u, True, None))
        kept.append(match)
        node = match

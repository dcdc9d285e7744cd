"""The acceptance rule emits tokens distributed exactly as the target's rows, whatever p is;
with a deterministic drafter it emits the very tokens plain seeded sampling gives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline.decoding.acceptance as acceptance
from pipeline.decoding.acceptance import residual, verify
from pipeline.decoding.noise import ACCEPT, RESIDUAL, SAMPLE, uniform
from pipeline.decoding.sampling import sample_at

from .stats import chi_square

V = 5


def random_rows(rng: np.random.Generator, n: int, zeros: bool = True) -> np.ndarray:
    rows = rng.dirichlet(np.full(V, 0.6), size=n)
    if zeros:  # knock out a token per row so supports differ between p and q
        rows[np.arange(n), rng.integers(0, V, n)] = 0.0
        rows /= rows.sum(axis=1, keepdims=True)
    return rows


def first_tokens(p: np.ndarray | None, q: np.ndarray, draws: int, seed: int) -> np.ndarray:
    """Counts of the first emitted token over many steps (each with its own request seed) with
    drafts drawn from p (uniform guesses when p is None: a deterministic drafter may propose
    anything), drawn with the test's own generator."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(V, np.int64)
    k = q.shape[0] - 1
    for trial in range(draws):
        if p is None:
            draft = [int(rng.integers(V)) for _ in range(k)]
        else:
            draft = [int(rng.choice(V, p=row)) for row in p]
        counts[verify(draft, p, q, seed * 10**6 + trial, 0).tokens[0]] += 1
    return counts


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-draft", "one-hot-draft"])
def test_first_token_follows_the_target(seed, deterministic):
    rng = np.random.default_rng(100 + seed)
    k = 3
    p = None if deterministic else random_rows(rng, k)
    q = random_rows(rng, k + 1)
    statistic, critical = chi_square(first_tokens(p, q, 20_000, seed), q[0])
    assert statistic < critical


def test_bonus_token_follows_the_last_target_row():
    rng = np.random.default_rng(7)
    q = random_rows(rng, 3)
    draft = [int(np.argmax(q[0])), int(np.argmax(q[1]))]
    q[0], q[1] = np.eye(V)[draft[0]], np.eye(V)[draft[1]]  # the drafts are always kept
    counts = np.zeros(V, np.int64)
    for trial in range(20_000):
        verdict = verify(draft, None, q, trial, 5)
        assert verdict.accepted == 2
        counts[verdict.tokens[-1]] += 1
    statistic, critical = chi_square(counts, q[2])
    assert statistic < critical


@pytest.mark.parametrize(
    "broken",
    [
        lambda q, p, token: q,  # forgets to subtract p at the rejection
        lambda q, p, token: np.full_like(q, 1.0 / q.size),  # uniform correction
    ],
    ids=["residual-without-subtracting-p", "uniform-correction"],
)
def test_a_wrong_residual_is_caught(monkeypatch, broken):
    rng = np.random.default_rng(3)
    p, q = random_rows(rng, 1, zeros=False), random_rows(rng, 2, zeros=False)
    monkeypatch.setattr(acceptance, "residual", broken)
    statistic, critical = chi_square(first_tokens(p, q, 20_000, 0), q[0])
    assert statistic > critical


def test_a_wrong_acceptance_ratio_is_caught(monkeypatch):
    """Keeping with probability q/p without the min(1, .) cap changes nothing; keeping
    with probability p/q instead must be caught."""
    rng = np.random.default_rng(5)
    p, q = random_rows(rng, 1, zeros=False), random_rows(rng, 2, zeros=False)

    def inverted(draft, draft_probs, target_probs, seed, start):
        x = draft[0]
        keep = uniform(seed, start, ACCEPT) < min(1.0, draft_probs[0][x] / max(target_probs[0][x], 1e-12))
        if keep:
            return acceptance.Verdict([x, sample_at(target_probs[1], seed, start + 1)[0]], 1, [], None)
        fix = sample_at(residual(target_probs[0], draft_probs[0], x), seed, start, RESIDUAL)[0]
        return acceptance.Verdict([fix], 0, [], None)

    monkeypatch.setattr(acceptance, "verify", inverted)
    counts = np.zeros(V, np.int64)
    for trial in range(20_000):
        x = int(rng.choice(V, p=p[0]))
        counts[acceptance.verify([x], p, q, trial, 0).tokens[0]] += 1
    statistic, critical = chi_square(counts, q[0])
    assert statistic > critical


@settings(max_examples=200)
@given(st.integers(0, 2**32), st.integers(1, 6))
def test_greedy_keeps_exactly_the_matching_prefix(seed, k):
    rng = np.random.default_rng(seed)
    q = np.eye(V)[rng.integers(0, V, k + 1)]  # greedy target rows are one-hot
    draft = [int(t) for t in rng.integers(0, V, k)]
    verdict = verify(draft, None, q, seed, 3)
    targets = q.argmax(axis=1).tolist()
    n = next((i for i in range(k) if draft[i] != targets[i]), k)
    assert verdict.accepted == n
    assert verdict.tokens == targets[: n + 1]
    assert verdict.final_u is None and all(d.u is None for d in verdict.decisions)  # no randomness used
    assert [d.kept for d in verdict.decisions] == [True] * n + ([False] if n < k else [])


@settings(max_examples=300)
@given(
    st.integers(0, 2**64 - 1), st.integers(0, 5000), st.integers(0, 6), st.integers(0, 2**32), st.booleans()
)
def test_a_deterministic_draft_emits_exactly_the_seeded_samples(seed, start, k, rows_seed, lucky):
    """Whatever is drafted, each emitted token is the target's own sample at its position with
    that position's number: plain seeded decoding's token. `lucky` drafts those very samples
    (all kept, then the bonus), otherwise the drafts are guesses."""
    rng = np.random.default_rng(rows_seed)
    q = random_rows(rng, k + 1)
    plain = [sample_at(q[i], seed, start + i)[0] for i in range(k + 1)]
    draft = plain[:k] if lucky else [int(t) for t in rng.integers(0, V, k)]
    verdict = verify(draft, None, q, seed, start)
    assert verdict.tokens == plain[: verdict.accepted + 1]
    assert verdict.accepted == next((i for i in range(k) if draft[i] != plain[i]), k)
    for i, d in enumerate(verdict.decisions):
        assert d.u == (None if np.count_nonzero(q[i]) == 1 else uniform(seed, start + i, SAMPLE))


@settings(max_examples=100)
@given(st.integers(0, 2**32))
def test_decisions_replay(seed):
    """Each record holds what is needed to re-derive its verdict."""
    rng = np.random.default_rng(seed)
    p, q = random_rows(rng, 3), random_rows(rng, 4)
    draft = [int(rng.choice(V, p=row)) for row in p]
    verdict = verify(draft, p, q, seed, 11)
    for d in verdict.decisions:
        assert d.p == pytest.approx(p[d.position][d.draft_token])
        assert d.q == pytest.approx(q[d.position][d.draft_token])
        if d.u is None:
            assert d.kept == (d.q >= d.p)
        else:
            assert d.u == uniform(seed, 11 + d.position, ACCEPT)
            assert d.kept == (d.u * d.p < d.q)
    assert verify(draft, p, q, seed, 11) == verdict  # a fixed seed reproduces a fixed run


def test_row_counts_are_checked():
    with pytest.raises(ValueError, match="target rows"):
        verify([1, 2], None, np.ones((2, V)) / V, 0, 0)
    with pytest.raises(ValueError, match="draft rows"):
        verify([1, 2], np.ones((1, V)) / V, np.ones((3, V)) / V, 0, 0)

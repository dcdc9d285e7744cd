"""The measuring scripts behind two README claims (`ops/bench/tree_bound.py`, `coupling.py`): their
arithmetic, so a figure they print cannot come from a wrong count."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pipeline.decoding.drafters import Proposal
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.drafters.suffix import SuffixSource
from pipeline.decoding.sampling import SamplingParams

BENCH = Path(__file__).resolve().parents[1] / "ops" / "bench"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tree_bound, coupling = script("tree_bound"), script("coupling")


def test_a_tree_keeps_its_best_path_and_a_chain_its_prefix():
    # root children 5 and 7; 7 -> 8 -> 9, 5 -> 6
    tree = Proposal([5, 7, 6, 8, 9], None, "t", parents=[-1, -1, 0, 1, 3])
    assert tree_bound.kept(tree, [7, 8, 9, 1]) == 3
    assert tree_bound.kept(tree, [5, 6, 9]) == 2
    assert tree_bound.kept(tree, [4]) == 0
    assert tree_bound.kept(Proposal([1, 2, 3]), [1, 2, 4]) == 2


def test_any_pair_counts_tokens_whose_pair_with_the_previous_one_was_seen():
    context = [1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 2, 3]
    assert tree_bound.any_pair(context, [4, 5, 6, 7]) == 3  # 3 4, 4 5, 5 6 occur; 6 7 does not
    assert tree_bound.any_pair(context, [9, 9, 2, 3, 4]) == 5  # pairs from two occurrences, spliced
    assert tree_bound.any_pair(context, [8]) == 0


def test_any_pair_holds_every_path_of_the_drafters_trees():
    """The bound is above what the n-gram and suffix drafters' trees can hold, on a context with
    repeats."""
    context = [1, 2, 3, 4, 1, 2, 5, 6, 2, 3, 4, 7, 1, 2, 3]
    truth = [4, 1, 2, 5, 6, 2]
    for source in (NgramSource(), SuffixSource()):
        drafter = source.start(context, SamplingParams(), 0)
        drafter.accept(context)
        proposal = drafter.propose(context, 32, True)
        assert 0 < tree_bound.kept(proposal, truth) <= tree_bound.any_pair(context, truth)


def test_a_walk_verifies_exactly_what_it_keeps():
    steps, rows = tree_bound.walk([0, 0], [1, 2, 3, 4, 5], lambda context, truth: len(truth), depth=2)
    assert (steps, rows) == (2, [3, 2])  # 1 from the prefill, then 2 + bonus, then 1 + bonus


def distributions(size: int):
    weights = st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=size, max_size=size)
    return weights.filter(lambda w: sum(w) > 1e-3).map(lambda w: np.array(w) / sum(w))


@given(st.integers(2, 12).flatmap(lambda n: st.tuples(distributions(n), distributions(n))))
def test_shared_u_couples_no_better_than_the_rule(pair):
    """No coupling agrees more often than the maximal one, whose agreement is sum(min(p, q))."""
    p, q = pair
    assert coupling.coupled_acceptance(p, q) <= coupling.rule_acceptance(p, q) + 1e-9
    assert abs(coupling.coupled_acceptance(p, p) - 1.0) < 1e-9


def test_shared_u_agreement_counts_interval_overlaps():
    p, q = np.array([0.5, 0.5, 0.0]), np.array([0.25, 0.5, 0.25])
    # u in [0, 0.25) picks 0 from both, [0.5, 0.75) picks 1 from both: half the time
    assert coupling.coupled_acceptance(p, q) == 0.5
    assert coupling.rule_acceptance(p, q) == 0.75

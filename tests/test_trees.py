"""Token-tree verification: the emitted tokens are plain decoding's, seed for seed, whatever the
tree held; their distribution is the target's (chi-square, with a wrong tree rule caught); and
the drafters really propose trees, merged from every candidate they know."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

import pipeline.decoding.target as target_module
from pipeline.decoding.acceptance import verify_tree
from pipeline.decoding.drafters import NoDraftSource, Proposal, first_share, tree_proposal
from pipeline.decoding.drafters.ngram import SHORTER_WEIGHT, NgramSource
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.drafters.suffix import SuffixSource, SuffixTable
from pipeline.decoding.noise import SAMPLE, uniform
from pipeline.decoding.sampling import SamplingParams, draw, sample_at
from pipeline.decoding.speculative import decode
from pipeline.decoding.tree import check, is_chain, merge, path
from pipeline.model import load_model

from .stats import chi_square
from .tinymodel import TinySpec, write_tiny_gguf

V = 4


def rows_for(context: tuple[int, ...]) -> np.ndarray:
    """A synthetic target: a fixed distribution for every context (sometimes one-hot)."""
    digest = hashlib.blake2b(repr(context).encode(), digest_size=16).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    q = rng.dirichlet(np.full(V, 0.7))
    if rng.random() < 0.2:
        q = np.eye(V)[int(np.argmax(q))]
    return q


@st.composite
def draft_trees(draw_, max_nodes: int = 10):
    n = draw_(st.integers(0, max_nodes))
    parents, tokens = [], []
    for _ in range(n):
        parent = draw_(st.integers(-1, len(parents) - 1))
        token = draw_(st.integers(0, V - 1))
        if (parent, token) not in zip(parents, tokens, strict=True):
            parents.append(parent)
            tokens.append(token)
    return tokens, parents


def target_rows(tokens: list[int], parents: list[int], prefix: tuple[int, ...]) -> np.ndarray:
    rows = [rows_for(prefix)]
    for node in range(len(tokens)):
        rows.append(rows_for(prefix + tuple(tokens[n] for n in path(parents, node))))
    return np.stack(rows)


@settings(max_examples=300)
@given(
    draft_trees(),
    st.integers(0, 2**64 - 1),
    st.integers(0, 1000),
    st.lists(st.integers(0, V - 1), max_size=3),
)
def test_a_tree_emits_exactly_plain_seeded_decoding(tree, seed, start, prefix):
    """Whatever the tree, the tokens are the ones plain seeded decoding samples, and the kept
    path is the longest path of the tree that plain decoding walks."""
    tokens, parents = tree
    assert check(tokens, parents) is None
    context = tuple(prefix)
    plain = []
    for position in range(start, start + len(tokens) + 1):
        token, _ = sample_at(rows_for(context), seed, position)
        plain.append(token)
        context += (token,)
    verdict = verify_tree(tokens, parents, target_rows(tokens, parents, tuple(prefix)), seed, start)
    assert verdict.tokens == plain[: len(verdict.tokens)]
    assert [tokens[n] for n in verdict.path] == plain[: verdict.accepted]
    longest = max(
        (
            len(path(parents, n))
            for n in range(len(tokens))
            if [tokens[m] for m in path(parents, n)] == plain[: len(path(parents, n))]
        ),
        default=0,
    )
    assert verdict.accepted == longest


def wrong_tree_rule(tokens, parents, q, seed, start):
    """A plausible but wrong rule: at the root, try each child in turn with its own number, keeping
    it with probability q(child); if none is kept, sample from q (no residual)."""
    children = [i for i, p in enumerate(parents) if p == -1]
    for n, child in enumerate(children):
        if uniform(seed, start * 97 + n, SAMPLE) < q[0][tokens[child]]:
            return tokens[child]
    return draw(q[0], uniform(seed, start, SAMPLE))


@pytest.mark.parametrize(("rule", "caught"), [(None, False), (wrong_tree_rule, True)], ids=["ours", "wrong"])
def test_the_first_token_follows_the_target_and_a_wrong_tree_rule_is_caught(rule, caught):
    rng = np.random.default_rng(3)
    q0 = np.array([0.1, 0.2, 0.3, 0.4])
    tokens, parents = [0, 1, 3, 2], [-1, -1, 0, 1]  # two branches under the root, one more level
    q = np.stack([q0, *rng.dirichlet(np.ones(V), size=len(tokens))])
    counts = np.zeros(V, np.int64)
    for trial in range(20_000):
        seed = 10**6 + trial
        first = (
            verify_tree(tokens, parents, q, seed, 0).tokens[0]
            if rule is None
            else rule(tokens, parents, q, seed, 0)
        )
        counts[first] += 1
    statistic, critical = chi_square(counts, q0)
    assert (statistic >= critical) == caught, (statistic, critical)


def test_the_second_token_follows_the_target_below_a_branch():
    """Below the kept child the next token follows that child's own row."""
    q0 = np.array([0.5, 0.5, 0.0, 0.0])
    below = {0: np.array([0.1, 0.2, 0.3, 0.4]), 1: np.array([0.4, 0.3, 0.2, 0.1])}
    tokens, parents = [0, 1, 2], [-1, -1, 0]
    q = np.stack([q0, below[0], below[1], np.full(V, 0.25)])
    counts = {0: np.zeros(V, np.int64), 1: np.zeros(V, np.int64)}
    for trial in range(20_000):
        verdict = verify_tree(tokens, parents, q, 77 + trial, 5)
        counts[verdict.tokens[0]][verdict.tokens[1]] += 1
    for first in (0, 1):
        statistic, critical = chi_square(counts[first], below[first])
        assert statistic < critical


def test_merge_builds_a_prefix_tree_best_first():
    tokens, parents, shares = merge([([1, 2, 3], 0.5), ([1, 2, 4], 0.25), ([5, 6], 0.25)], 10, 10)
    # By path probability discounted 0.8 a level: .6, .48, .26 (3), .2 (5), .13 (4), .16 (6)
    assert tokens == [1, 2, 3, 5, 6, 4]
    assert parents == [-1, 0, 1, -1, 3, 1]
    assert shares == [0.75, 1.0, 0.5 / 0.75, 0.25, 1.0, 0.25 / 0.75]
    assert merge([([1, 2, 3], 1.0)], 2, 10)[0] == [1, 2]
    assert merge([([1, 2, 3], 1.0), ([1, 7], 1.0)], 10, 1) == ([1], [-1], [1.0])


@given(
    st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=6), st.floats(0.01, 1.0)), max_size=8),
    st.integers(0, 12),
)
def test_a_merged_tree_is_well_formed(candidates, max_nodes):
    tokens, parents, shares = merge(candidates, max_nodes, 5)
    assert check(tokens, parents) is None and len(tokens) <= max_nodes
    assert all(0 < s <= 1.0 + 1e-12 for s in shares)


def test_ngram_trees_hold_every_continuation_of_the_suffix():
    context = [1, 2, 3, 10, 11, 9, 1, 2, 3, 20, 21, 9, 1, 2, 3]
    proposal = NgramSource(1, 3).start([], SamplingParams(), 0).propose(context, 6, tree=True)
    roots = [t for t, parent in zip(proposal.tokens, proposal.parents, strict=True) if parent == -1]
    assert roots == [20, 10]  # both continuations, the latest first
    assert proposal.tokens[:2] == [20, 10]
    linear = NgramSource(1, 3).start([], SamplingParams(), 0).propose(context, 6)
    assert linear.parents is None and linear.tokens[:2] == [20, 21]  # the latest match only


def test_suffix_trees_follow_the_tables_branches():
    table = SuffixTable(max_n=2)
    for tail in ([10, 11], [10, 11], [20, 21]):
        table.add([1, 2, *tail])
    found = dict((tuple(p), w) for p, w in table.candidates([1, 2], 2, 8))
    assert found[(10, 11)] == pytest.approx(2 / 3) and found[(20, 21)] == pytest.approx(1 / 3)


def test_a_suffix_known_on_fewer_tokens_drafts_with_less_weight():
    """What followed one earlier occurrence of a single token is weak evidence: such candidates weigh
    SHORTER_WEIGHT less for each token short of SHORT_MATCH, as the n-gram drafter's do."""
    table = SuffixTable(max_n=4)
    table.add([1, 2, 3, 7, 8])
    long = dict((tuple(p), w) for p, w in table.candidates([1, 2, 3], 2, 8))
    short = dict((tuple(p), w) for p, w in table.candidates([9, 9, 3], 2, 8))  # only "3" is known
    assert long == {(7, 8): pytest.approx(1.0)}
    assert short == {(7, 8): pytest.approx(SHORTER_WEIGHT**2)}


@given(
    st.lists(st.integers(0, 4), min_size=2, max_size=40), st.floats(0, 1), st.sampled_from(["ngram", "auto"])
)
def test_a_floor_drops_only_trees_whose_first_node_weighs_less(context, floor, name):
    """A drafter asked with a floor proposes what it would without one, or nothing, and nothing only
    when the tree's likeliest first node would have less than the floor of its candidates' weight."""
    start = make_draft_source(name, None).start  # type: ignore[arg-type]
    prompt = context[: len(context) // 2]  # what the suffix drafter's own table holds
    free = start(prompt, SamplingParams(), 0).propose(context, 8, tree=True)
    floored = start(prompt, SamplingParams(), 0).propose(context, 8, tree=True, floor=floor)
    roots = [s for s, parent in zip(free.shares or [], free.parents or [], strict=True) if parent < 0]
    if free.tokens and max(roots) >= floor:
        assert floored.tokens  # a tree that could pay is always built
    if name == "ngram":  # one drafter: the same tree, or none
        assert floored == free or (not floored.tokens and max(roots, default=0.0) < floor)


def test_a_composite_judges_what_is_left_by_what_the_dropped_could_have_added():
    """Under `auto` each drafter drops candidates under half the floor; the first node of the tree
    left then needs only the other half, since the dropped ones could have lifted it that much."""
    from pipeline.decoding.drafters.composite import CompositeDrafter

    class Fixed:
        name = "fixed"

        def __init__(self, found):
            self.found = found

        def candidates(self, context, k, floor=0.0):
            return self.found if sum(w for _, w in self.found) >= floor else []

    both = CompositeDrafter("auto", [Fixed([([1, 2], 0.1)]), Fixed([([1, 3], 0.25)])])
    assert both.propose([0], 4, tree=True).shares[0] == pytest.approx(0.1 + 0.25 * 0.9)  # over 0.3
    assert both.propose([0], 4, tree=True, floor=0.3).tokens == [1, 3]  # the first drafter's dropped


def test_tree_proposal_drops_a_tree_under_the_floor():
    candidates = [([1, 2], 0.05), ([1, 3], 0.03), ([4], 0.02)]  # the first node "1" holds 0.08
    assert tree_proposal("x", candidates, 4, floor=0.08).tokens == [1, 2, 3, 4]
    assert tree_proposal("x", candidates, 4, floor=0.081).tokens == []
    assert first_share([([7], 3.0), ([8], 1.0)]) == 0.75


# --- end to end on a tiny model ----------------------------------------------------------


@pytest.fixture(scope="module", params=["native", "torch"])
def tiny_target(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("trees") / "target.gguf"
    write_tiny_gguf(path, TinySpec(seed=41, scale=1.1, quant="Q4_1"))
    return load_model(path, request.param)


def branching_prompt(rng: np.random.Generator, branches: int) -> list[int]:
    """The same stem followed by different continuations, from a small alphabet: most n-grams the
    output ends with recur with several continuations, so the drafters see branches."""
    stem = rng.integers(3, 12, size=3).tolist()
    out = []
    for _ in range(branches):
        out += stem + rng.integers(3, 12, size=6).tolist()
    return out + stem


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    top_k=st.sampled_from([0, 3]),
    top_p=st.sampled_from([1.0, 0.8]),
    k=st.sampled_from([None, 2, 5, 12]),
    branches=st.integers(2, 4),
    drafter=st.sampled_from(["ngram", "suffix", "auto"]),
)
def test_tree_speculation_equals_plain_decoding(
    tiny_target, seed, temperature, top_k, top_p, k, branches, drafter
):
    target = tiny_target
    rng = np.random.default_rng(seed % 2**32)
    prompt = branching_prompt(rng, branches)
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=20, ignore_eos=True
    )
    source = {
        "ngram": NgramSource(1, 3),
        "suffix": SuffixSource(),
        "auto": make_draft_source("auto", target),
    }[drafter]
    decode(
        target, branching_prompt(rng, 2), replace(params, seed=seed // 2), source, k=4
    )  # fills the suffix cache
    plain = decode(target, prompt, params, NoDraftSource(), k=0)
    spec = decode(target, prompt, params, source, k=k)
    assert spec.tokens == plain.tokens


def test_trees_are_really_verified(tiny_target, monkeypatch):
    """The test above is only worth its name if real trees reach the verifier."""
    shapes = []

    def spy(tokens, parents, *args):
        shapes.append(is_chain(parents))
        return verify_tree(tokens, parents, *args)

    monkeypatch.setattr(target_module, "verify_tree", spy)
    prompt = branching_prompt(np.random.default_rng(1), 4)
    out = decode(tiny_target, prompt, SamplingParams(max_tokens=16, ignore_eos=True), NgramSource(1, 3), k=8)
    assert shapes.count(False) >= 1
    assert out.stats.nodes_per_step > 0


def test_shorter_ngrams_add_weak_branches_and_a_later_drafter_keeps_a_share():
    from pipeline.decoding.drafters.composite import prioritised
    from pipeline.decoding.drafters.ngram import candidates

    context = np.array([5, 6, 7, 1, 9, 9, 4, 7, 2, 5, 6, 7])  # "5 6 7" recurs once; "7" twice more
    found = candidates(context, 3, 3, 5)
    assert found[0][0] == [1, 9, 9] and found[0][1] > 0.8  # the long match leads
    assert {tuple(t) for t, _ in found} >= {(1, 9, 9), (2, 5, 6)}  # the 1-gram "7" adds a branch
    assert sum(w for _, w in found) == pytest.approx(1.0)
    weak = candidates(np.array([1, 2, 3, 9, 4, 9]), 2, 3, 5)  # only a 1-gram match
    assert sum(w for _, w in weak) == pytest.approx(0.01)
    mixed = prioritised([[([1], 1.0)], [([2], 1.0)]])
    assert mixed == [([1], 1.0), ([2], 0.25)]


class Member:
    """A composite member named as a kind, with fixed candidates, recording what it is asked."""

    def __init__(self, name: str, found: list) -> None:
        self.name, self.found, self.asked = name, found, []

    def candidates(self, context, k, floor=0.0):
        self.asked.append("candidates")
        return self.found

    def propose(self, context, k, tree=False, floor=0.0):
        self.asked.append(("propose", tree))
        if not self.found:
            return Proposal([])
        return Proposal([7, 8, 9], None, self.name, [-1, 0, 0] if tree else None)


@pytest.mark.parametrize("ngram_found", [True, False], ids=["ngram-has-candidates", "ngram-has-none"])
def test_a_member_that_is_not_merged_drafts_only_the_steps_the_merged_ones_leave(ngram_found):
    """`auto` with a head: the n-gram candidates make the step's tree, the head is not asked; where
    they have none, the head proposes a tree of its own, under its own label (its calibration)."""
    from pipeline.decoding.drafters.composite import CompositeDrafter

    ngram = Member("ngram", [([1, 2], 1.0)] if ngram_found else [])
    head = Member("learned", [([5], 1.0)])
    proposal = CompositeDrafter("auto", [ngram, head]).propose([3, 4], k=4, tree=True)
    assert ngram.asked == ["candidates"]
    if ngram_found:
        assert (proposal.drafter, proposal.tokens, head.asked) == ("auto", [1, 2], [])
    else:
        assert (proposal.drafter, proposal.tokens, proposal.parents) == ("learned", [7, 8, 9], [-1, 0, 0])
        assert head.asked == [("propose", True)]
    members = [Member("ngram", []), Member("learned", [([5], 1.0)])]
    chain = CompositeDrafter("auto", members).propose([3, 4], k=4)
    assert chain.drafter == "learned" and chain.parents is None  # asked for a chain, a chain

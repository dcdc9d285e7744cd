"""The speculative loop end to end on tiny models: exact for every drafter and k."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline.decoding.acceptance as acceptance
from pipeline.decoding.drafters import NoDraftSource
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.drafters.ngram import NgramIndex, NgramSource, candidates, lookup
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.drafters.suffix import SuffixSource, SuffixTable
from pipeline.decoding.sampling import SamplingParams, target_probs
from pipeline.decoding.speculative import decode
from pipeline.model import Model, ModelFileError

from .stats import chi_square
from .tinymodel import TinySpec, write_tiny_gguf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target and a draft with the same vocabulary: the target's own weights at another
    scale, so the two rank tokens alike but disagree on probabilities (p != q with
    overlapping supports, the case where the residual matters)."""
    root = tmp_path_factory.mktemp("spec")
    write_tiny_gguf(root / "target.gguf", TinySpec(seed=21, scale=1.2))
    write_tiny_gguf(root / "draft.gguf", TinySpec(seed=21, scale=0.8))
    return Model.load(root / "target.gguf"), Model.load(root / "draft.gguf")


def sources(target, draft):
    return {
        "ngram": NgramSource(),
        "suffix": SuffixSource(),
        "model": ModelSource(draft, target),
        "self-model": ModelSource(target, target),
        "auto": make_draft_source("auto", target, draft),
    }


def repetitive_prompt(rng: np.random.Generator, length: int) -> list[int]:
    """Random tokens with a repeated stretch, so n-gram drafters find matches."""
    base = rng.integers(3, 267, size=max(2, length // 3)).tolist()
    return (base * 4)[:length]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    k=st.sampled_from([None, 1, 2, 5, 8]),
    length=st.integers(2, 40),
    drafter=st.sampled_from(["ngram", "suffix", "model", "self-model", "auto"]),
)
def test_greedy_output_is_identical_to_plain_decoding(models, seed, k, length, drafter):
    target, draft = models
    prompt = repetitive_prompt(np.random.default_rng(seed), length)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = decode(target, prompt, params, NoDraftSource(), k=0)
    spec = decode(target, prompt, params, sources(target, draft)[drafter], k=k)
    assert spec.tokens == plain.tokens
    assert spec.text == plain.text


def test_self_drafting_accepts_everything_greedy(models):
    target, _ = models
    prompt = repetitive_prompt(np.random.default_rng(1), 12)
    out = decode(
        target, prompt, SamplingParams(max_tokens=30, ignore_eos=True), ModelSource(target, target), k=4
    )
    assert out.stats.drafted > 0 and out.stats.acceptance_rate == 1.0
    assert out.stats.mean_accepted_length > 4


def continuation_distribution(model: Model, prompt: list[int], params: SamplingParams, n: int) -> dict:
    """Exact probability of every n-token continuation, by enumeration over the target."""
    dist = {}
    frontier = [((), 1.0)]
    for _ in range(n):
        nxt = []
        for prefix, mass in frontier:
            logits = model.forward(model.new_cache(), [*prompt, *prefix], all_logits=False)[0]
            probs = target_probs(logits, params)
            nxt += [((*prefix, int(t)), mass * probs[t]) for t in np.flatnonzero(probs)]
        frontier = nxt
    dist.update(frontier)
    return dist


def goodness_of_fit(target: Model, source, runs: int = 2500) -> tuple[float, float]:
    """Chi-square of 3-token sampled continuations against their exact probabilities."""
    prompt = [40, 41, 42, 40, 41]
    params = SamplingParams(temperature=1.3, top_k=3, max_tokens=3, ignore_eos=True)
    exact = continuation_distribution(target, prompt, params, 3)
    counts = dict.fromkeys(exact, 0)
    for seed in range(runs):
        out = decode(target, prompt, msgspec.structs.replace(params, seed=seed), source, k=2)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    if set(counts) != set(exact):
        return float("inf"), 0.0  # a continuation the target cannot produce was emitted
    return chi_square([counts[c] for c in exact], [exact[c] for c in exact])


@pytest.mark.parametrize("drafter", ["model", "ngram", "none"])
def test_sampled_continuations_follow_the_target(models, drafter):
    target, draft = models
    source = {"none": NoDraftSource(), **sources(target, draft)}[drafter]
    statistic, critical = goodness_of_fit(target, source)
    assert statistic < critical


def test_a_wrong_residual_is_caught_end_to_end(models, monkeypatch):
    """The same check fails when the correction after a rejection ignores p."""
    target, draft = models
    monkeypatch.setattr(acceptance, "residual", lambda q, p, token: q)
    statistic, critical = goodness_of_fit(target, ModelSource(draft, target))
    assert statistic > critical


def test_seeded_speculative_sampling_is_reproducible(models):
    target, draft = models
    params = SamplingParams(temperature=0.9, seed=42, max_tokens=20, ignore_eos=True)
    runs = [decode(target, [50, 51, 52], params, ModelSource(draft, target), k=3).tokens for _ in range(2)]
    assert runs[0] == runs[1]


class ExplodingDrafter:
    """Drafts well (the n-gram drafter) until `method` raises, then keeps raising."""

    name = "exploding"

    def __init__(self, method, after):
        self.inner, self.method, self.after, self.calls = (
            NgramSource(1, 3).start([], None, None),
            method,
            after,
            0,
        )

    def _maybe_explode(self, method):
        if method == self.method:
            self.calls += 1
            if self.calls > self.after:
                raise RuntimeError("drafter bug")

    def propose(self, context, k, tree=False, floor=0.0):
        self._maybe_explode("propose")
        return self.inner.propose(context, k, tree, floor)

    def accept(self, context):
        self._maybe_explode("accept")

    def finish(self, context):
        self._maybe_explode("finish")


class ExplodingSource:
    name = "exploding"

    def __init__(self, method, after):
        self.method, self.after = method, after

    def start(self, prompt, params, rng):
        return ExplodingDrafter(self.method, self.after)


@pytest.mark.parametrize(("method", "after"), [("propose", 0), ("propose", 3), ("accept", 2), ("finish", 0)])
def test_a_failing_drafter_degrades_to_plain_decoding(models, method, after):
    target, _ = models
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = repetitive_prompt(np.random.default_rng(3), 30)
    plain = decode(target, prompt, params, NoDraftSource(), k=0)
    out = decode(target, prompt, params, ExplodingSource(method, after), k=4)
    assert out.tokens == plain.tokens
    assert out.stats.draft_failures == 1


def test_max_iterations_ends_the_request(models):
    target, _ = models
    out = decode(
        target,
        [60, 61],
        SamplingParams(max_tokens=50, ignore_eos=True),
        NoDraftSource(),
        k=0,
        max_iterations=5,
    )
    assert out.finish_reason == "max_iterations_exceeded"
    assert out.stats.steps == 5 and len(out.tokens) == 6


def test_draft_model_with_another_vocabulary_is_refused(models, tmp_path):
    target, _ = models
    other = TinySpec(seed=23)
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, other)
    model = Model.load(path)
    model.tokenizer.hf.add_tokens(["<extra>"])  # same size on paper, different strings
    with pytest.raises(ModelFileError, match="vocabulary"):
        ModelSource(model, target)


def test_ngram_lookup_prefers_longest_then_latest_match():
    context = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # suffix [2, 3] also occurs at 5-6 (followed by 7, 8) and at 1-2 (followed by 9): latest wins
    assert lookup(context, 2, 1, 3) == [7, 8]
    assert lookup(np.array([4, 5, 6]), 3, 1, 3) == []
    assert lookup(np.array([1, 2, 1]), 5, 1, 3) == [2, 1]


def test_suffix_table_drafts_across_requests_and_stays_bounded():
    table = SuffixTable(max_n=4, max_entries=1000)
    table.add([10, 11, 12, 13, 14, 15, 16])
    assert table.draft([99, 11, 12], 4) == [13, 14, 15, 16]
    for start in range(0, 5000, 7):
        table.add(list(range(start, start + 7)))
    assert len(table) <= 1000


def test_suffix_drafter_learns_from_a_previous_request(models):
    target, _ = models
    source = SuffixSource()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    first = decode(target, [70, 71, 72], params, source, k=None)
    second = decode(target, [70, 71, 72], params, source, k=None)
    assert second.tokens == first.tokens
    assert second.stats.accepted > first.stats.accepted


@pytest.mark.parametrize("bad", [-1, 33])
def test_k_out_of_range_is_refused(models, bad):
    target, _ = models
    with pytest.raises(ValueError, match="k must be"):
        decode(target, [1, 2], SamplingParams(), NgramSource(), k=bad)


def _scan_matches(context: list[int], n: int) -> list[int]:
    """Where the followers of earlier occurrences of the context's last n tokens stand, by a plain scan."""
    length = len(context)
    suffix = context[length - n :]
    return [s + n for s in range(length - n) if context[s : s + n] == suffix]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=60),
    st.lists(st.integers(1, 60), max_size=5),
    st.integers(1, 5),
)
def test_the_ngram_index_finds_every_match_a_scan_finds(tokens, cuts, max_n):
    """The drafter's index, extended step by step (or handed a context that is no extension of
    what it saw), answers what a scan of the whole context answers."""
    index = NgramIndex(max_n)
    for cut in [*cuts, len(tokens)]:
        context = tokens[:cut] if cut <= len(tokens) else [9, *tokens][:cut]  # 9: a context that changed
        index.update(context)
        for n in range(1, max_n + 1):
            expected = _scan_matches(context, n) if n < len(context) else []
            assert index.matches(n) == expected
    assert index.candidates(4, 1, max_n) == candidates(np.asarray(tokens), 4, 1, max_n)

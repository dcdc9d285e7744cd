"""The model families' fast path beyond what test_row_invariance.py covers: Gemma 3's sliding-window
layers keep only their window in the KV cache (`row_cache.RowCache`), and that changes no bit.

A long sequence (many windows) gives the same logits (`np.array_equal`) decoded one token at a time,
in chunks of any size, with rollbacks of rejected drafts in between, as token trees, or adopted
from another cache, as in one prefill; the local buffer stays bounded while it does.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.decoding.adaptive import K_LIMIT
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.tree import path
from pipeline.model import load_model
from pipeline.model.row_cache import WINDOW_MARGIN
from pipeline.workers.prefix_reuse import Holder, best_holder

from .tinymodel import TinySpec, reference_logits, write_tiny_gguf

WINDOW = 8
LONG = 360  # 45 windows, and several compactions of the local buffer
# Local layers 0, 1, 3 and 4, global 2 and 5 (a pattern key of period 3), head width 32 with d_model 64.
GEMMA = TinySpec(architecture="gemma3", quant="Q8_0", n_layers=6, n_heads=4, n_kv_heads=1, head_size=32,
                 sliding_window=WINDOW, swa_pattern=3, context=512, seed=51)  # fmt: skip
STEADY = 2 * (WINDOW + WINDOW_MARGIN)  # row_cache: a buffer that one-token steps never grow past


@pytest.fixture(scope="module", params=["native", "torch"])
def gemma(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("window") / "gemma3.gguf"
    weights = write_tiny_gguf(path, GEMMA)
    model = load_model(path, request.param)
    tokens = np.random.default_rng(7).integers(3, 267, size=LONG).tolist()
    return model, weights, tokens, model.forward(model.new_cache(), tokens)


def test_the_tiny_model_mixes_local_and_global_layers(gemma):
    model, _, _, _ = gemma
    assert model.cfg.local_layers == (0, 1, 3, 4)
    assert model.cfg.sliding_window == WINDOW
    assert model.new_cache().n_local == 4


def test_margin_covers_the_deepest_rollback_the_decoders_make():
    """A rejected verify block or a model drafter's k drafts: at most K_LIMIT tokens and the pending one."""
    assert WINDOW_MARGIN >= K_LIMIT + 1


def test_one_token_at_a_time_equals_one_prefill_and_stays_bounded(gemma):
    model, _, tokens, want = gemma
    cache = model.new_cache(capacity=1)
    got = []
    for t in tokens:
        got.append(model.forward(cache, [t]))
        assert cache.local_capacity <= STEADY
        assert cache.local_k.shape[-1] <= STEADY + 31  # the stride: up to a multiple of 16, not of 256
    assert cache.base >= LONG - STEADY  # it really dropped the old positions
    assert np.array_equal(np.concatenate(got), want)


def test_a_long_forward_grows_the_buffer_and_the_next_step_gives_it_back(gemma):
    model, _, tokens, want = gemma
    cache = model.new_cache()
    model.forward(cache, tokens[:300])
    assert cache.local_capacity >= 300
    assert np.array_equal(model.forward(cache, tokens[300:301]), want[300:301])
    assert cache.local_capacity == STEADY
    assert np.array_equal(model.forward(cache, tokens[301:]), want[301:])


@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    rejected=st.lists(st.integers(0, K_LIMIT + 1), min_size=1, max_size=10),
)
def test_chunks_and_rollbacks_give_the_prefills_bits(gemma, sizes, rejected):
    """Chunks of any size, each followed by drafts that are rejected and rolled back."""
    model, _, tokens, want = gemma
    cache, pieces, start, i = model.new_cache(), [], 0, 0
    while start < len(tokens):
        size = sizes[i % len(sizes)]
        pieces.append(model.forward(cache, tokens[start : start + size]))
        start, i = start + size, i + 1
        drafts = rejected[i % len(rejected)]
        if drafts and start < len(tokens):
            model.forward(cache, [(7 * j + 5) % 260 + 3 for j in range(drafts)])
            cache.truncate(start)
        assert cache.local_capacity <= max(STEADY, max(sizes) + WINDOW + WINDOW_MARGIN + K_LIMIT + 1)
    assert np.array_equal(np.concatenate(pieces), want)


def test_a_rollback_past_the_kept_window_is_refused(gemma):
    model, _, tokens, _ = gemma
    cache = model.new_cache()
    for t in tokens[:300]:
        model.forward(cache, [t])
    assert cache.base > 0
    with pytest.raises(ValueError, match="sliding-window"):
        cache.truncate(cache.base)
    assert cache.length == 300
    cache.truncate(0)  # nothing to read before position 0: always possible
    assert (cache.length, cache.base) == (0, 0)
    assert np.array_equal(model.forward(cache, tokens[:20]), gemma[3][:20])


def test_adopting_a_prefix_copies_the_window_or_is_refused(gemma):
    model, _, tokens, want = gemma
    source = model.new_cache()
    for start in range(0, 340, 17):
        model.forward(source, tokens[start : start + 17])
    length = 330
    assert source.lends(length) and not source.lends(100)
    copy = model.new_cache()
    copy.adopt(source, length)
    assert np.array_equal(model.forward(copy, tokens[length:]), want[length:])
    with pytest.raises(ValueError, match="local layers"):
        model.new_cache().adopt(source, 100)
    empty = model.new_cache()
    empty.adopt(source, 0)  # nothing to copy: always possible
    assert (empty.length, empty.base) == (0, 0)
    assert np.array_equal(model.forward(empty, tokens[:30]), want[:30])


def test_prefix_reuse_copies_only_from_a_cache_that_still_holds_the_window(gemma):
    """The verify lane's prefix copies (`workers.prefix_reuse`) pass over a holder whose local layers
    dropped what the copy needs: that prompt is prefilled instead of failing the lane."""
    model, _, tokens, _ = gemma
    donor = model.new_cache()
    for start in range(0, 340, 17):
        model.forward(donor, tokens[start : start + 17])
    holder = Holder(tokens[:340], donor)
    early = SimpleNamespace(tokens=[*tokens[:100], 5, 6], fed=0, cache=model.new_cache())
    assert best_holder(early, [holder]) == (None, 0)
    late = SimpleNamespace(tokens=[*tokens[:335], 5], fed=0, cache=model.new_cache())
    assert best_holder(late, [holder]) == (holder, 335)


def test_a_windowed_draft_model_starts_over_where_its_cache_cannot_roll_back(gemma):
    """A model drafter whose context parts from what it fed long before the window: its cache cannot
    roll back that far, so it feeds the context again and drafts what a fresh drafter drafts."""
    model, _, tokens, _ = gemma
    drafter = ModelSource(model, model).start(tokens[:10], SamplingParams(max_tokens=8), seed=1)
    drafter.propose(tokens[:300], 4)
    assert drafter.cache.base > 0
    other = [*tokens[:100], 9, 9, 9]
    fresh = ModelSource(model, model).start(tokens[:10], SamplingParams(max_tokens=8), seed=1)
    assert drafter.propose(other, 4).tokens == fresh.propose(other, 4).tokens


@st.composite
def trees(draw, max_rows: int = 14):
    """(tokens, parents): row 0 the root, paths deeper than the window."""
    rows = draw(st.integers(1, max_rows))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, rows)]
    return draw(st.lists(st.integers(3, 266), min_size=rows, max_size=rows)), parents


@settings(max_examples=10, deadline=None)
@given(prefix_length=st.integers(1, LONG - 20), tree=trees(), data=st.data())
def test_tree_rows_and_a_kept_path_equal_the_chain(gemma, prefix_length, tree, data):
    """A tree after a long prefix (a compacted buffer), paths deeper than the window: each row is its
    chain's bits, and the kept path continues as one token at a time would."""
    model, _, tokens, _ = gemma
    prefix, (drafts, parents) = tokens[:prefix_length], tree
    cache = model.new_cache(capacity=1)
    for start in range(0, prefix_length, 29):
        model.forward(cache, prefix[start : start + 29])
    logits = model.forward_batch([(cache, drafts, parents)])[0]
    fed = model.new_cache()
    model.forward(fed, prefix)
    for row in range(len(drafts)):
        chain = copy.deepcopy(fed)  # a fresh cache fed the prefix, without feeding it again per row
        want = model.forward(chain, [drafts[r] for r in path(parents, row)])[-1]
        assert np.array_equal(logits[row], want), row
    kept = path(parents, data.draw(st.integers(0, len(drafts) - 1)))
    cache.keep(prefix_length, kept)
    after = [11, 12, 13]
    chain = model.new_cache()
    want = model.forward(chain, [*prefix, *(drafts[r] for r in kept), *after])[-len(after) :]
    assert np.array_equal(model.forward(cache, after), want)


def test_the_fast_runtime_follows_the_float64_reference_far_past_the_window(gemma):
    """Not bitwise (activations are quantized to 8 bits): close, and a wrong window, RoPE base or
    norm would show as a jump (measured about 0.02 of the logits' range with the rules right)."""
    model, weights, tokens, got = gemma
    want = reference_logits(weights, GEMMA, tokens[:200])
    distance, scale = float(np.abs(got[:200] - want).max()), float(np.abs(want).max())
    print(f"{model.backend} gemma3: max |fast - f64| {distance:.4f}, logits up to {scale:.1f}")
    assert distance < 0.05 * scale
    assert (got[:200].argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_portable_build_gives_the_same_bits_on_gemma3(gemma, portable_kernels):
    """GeGLU, QK-norm, post-norms and windowed attention compute the same bits on a plain x86-64-v2
    build (no AVX2, no AVX-512) as on this CPU's: vector bodies and scalar tails alike."""
    model, _, tokens, want = gemma
    if model.backend != "native":
        pytest.skip("the portable build is the native backend's")
    fast_lib, head_lib = model.lib, model.head_products.lib
    try:
        model.lib = model.head_products.lib = portable_kernels
        got = model.forward(model.new_cache(), tokens[:120])
        cache = model.new_cache(capacity=1)
        stepped = np.concatenate([model.forward(cache, [t]) for t in tokens[:120]])
    finally:
        model.lib, model.head_products.lib = fast_lib, head_lib
    assert np.array_equal(got, want[:120]) and np.array_equal(stepped, want[:120])


# --- the real Gemma 3 270M ------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma3_270m_is_row_invariant_across_its_window(gemma3_served):
    """The real file (window 512, local layers at base 10^4, global at 10^6): 1,300 positions, past
    the point where the local buffer compacts, in chunks with rollbacks and one token at a time at
    the end give one prefill's logits bit for bit, and the local buffer stays bounded."""
    model = gemma3_served
    if model.backend != "native":
        pytest.skip(f"the served backend here is {model.backend}")
    sentence = model.tokenizer.encode("Row invariance across the sliding window, chunk after chunk. ")
    text = (sentence * 200)[:1300]
    want = model.forward(model.new_cache(), text)
    rng = np.random.default_rng(3)
    cache, pieces, start = model.new_cache(), [], 0
    while start < 1270:
        size = int(rng.integers(1, 48))
        pieces.append(model.forward(cache, text[start : min(start + size, 1270)]))
        start = min(start + size, 1270)
        model.forward(cache, rng.integers(3, 1000, size=int(rng.integers(1, 17))).tolist())
        cache.truncate(start)
    pieces.extend(model.forward(cache, [t]) for t in text[1270:])
    assert cache.base > 0 and cache.local_capacity <= 2 * (512 + WINDOW_MARGIN)
    assert np.array_equal(np.concatenate(pieces), want)

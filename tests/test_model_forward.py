"""The runtime's forward pass against a plain float64 reference, on tiny GGUF files."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model import Model
from pipeline.model.store import FORMAT_VERSION

from .tinymodel import TinySpec, reference_logits

SHAPES = {
    "gqa-tied": TinySpec(),
    "mha-untied": TinySpec(n_heads=4, n_kv_heads=4, tied=False, seed=1),
    "mqa-3-layers": TinySpec(n_layers=3, n_heads=6, n_kv_heads=1, d_model=96, seed=2),
    "qwen2-bias": TinySpec(architecture="qwen2", qkv_bias=True, seed=3),
    "q8_0": TinySpec(quant="Q8_0", seed=4),
}


@pytest.fixture(params=list(SHAPES), ids=list(SHAPES))
def tiny(request, tiny_model_file):
    spec = SHAPES[request.param]
    path, weights = tiny_model_file(spec)
    return Model.load(path), weights, spec


def prompt(n: int, seed: int = 0, vocab: int = 267) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def test_block_forward_matches_reference(tiny):
    model, weights, spec = tiny
    tokens = prompt(23)
    got = model.forward(model.new_cache(), tokens)
    want = reference_logits(weights, spec, tokens)
    assert got.shape == (23, spec.vocab)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def test_token_by_token_matches_block(tiny):
    model, _, _ = tiny
    tokens = prompt(17, seed=1)
    block = model.forward(model.new_cache(), tokens)
    cache = model.new_cache(capacity=4)  # forces the cache to grow on the way
    steps = np.concatenate([model.forward(cache, [t]) for t in tokens])
    np.testing.assert_allclose(steps, block, atol=5e-5, rtol=0)


def test_mixed_block_sizes_match_block(tiny):
    model, _, _ = tiny
    tokens = prompt(20, seed=2)
    block = model.forward(model.new_cache(), tokens)
    cache = model.new_cache()
    pieces, start = [], 0
    for size in (5, 1, 3, 8, 2, 1):
        pieces.append(model.forward(cache, tokens[start : start + size]))
        start += size
    np.testing.assert_allclose(np.concatenate(pieces), block, atol=5e-5, rtol=0)


def test_rollback_then_refeed_matches_clean_run(tiny):
    model, _, _ = tiny
    tokens = prompt(12, seed=3)
    continuation = prompt(6, seed=4)
    clean = model.new_cache()
    model.forward(clean, tokens)
    want = model.forward(clean, continuation)

    cache = model.new_cache()
    model.forward(cache, tokens)
    model.forward(cache, prompt(8, seed=5))  # eight rejected draft tokens
    cache.truncate(len(tokens))
    got = model.forward(cache, continuation)
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)


def test_batched_sequences_match_separate_runs(tiny):
    model, _, _ = tiny
    a, b = model.new_cache(), model.new_cache()
    model.forward(a, prompt(9, seed=6))
    model.forward(b, prompt(4, seed=7))
    solo_a = model.forward(_copy(a), [5, 6, 7])
    solo_b = model.forward(_copy(b), [8])
    batched = model.forward_batch([(a, [5, 6, 7]), (b, [8])])
    np.testing.assert_allclose(batched[0], solo_a, atol=5e-5, rtol=0)
    np.testing.assert_allclose(batched[1], solo_b, atol=5e-5, rtol=0)
    assert (a.length, b.length) == (12, 5)


def test_last_logits_only(tiny):
    model, _, _ = tiny
    tokens = prompt(10, seed=8)
    full = model.forward(model.new_cache(), tokens)
    last = model.forward(model.new_cache(), tokens, all_logits=False)
    np.testing.assert_allclose(last, full[-1:], atol=1e-5, rtol=0)


def test_context_and_token_range_are_enforced(tiny):
    model, _, spec = tiny
    cache = model.new_cache()
    with pytest.raises(ValueError, match="exceeds the context"):
        model.forward(cache, [5] * (spec.context + 1))
    with pytest.raises(ValueError, match="out of range"):
        model.forward(cache, [spec.vocab])
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(1)
    assert cache.length == 0  # a refused forward leaves the cache as it was


def test_prepared_weights_are_cached_and_memory_mapped(tiny_model_file, weight_cache):
    path, _ = tiny_model_file(TinySpec(seed=9), name="cached.gguf")
    first = Model.load(path)
    second = Model.load(path)
    assert isinstance(second.w["wqkv"].base, np.memmap) or isinstance(
        np.asarray(second.w["wqkv"]).base, np.memmap
    )
    assert any(p.name.endswith(f"-v{FORMAT_VERSION}") for p in weight_cache.iterdir())
    tokens = prompt(5, seed=10)
    np.testing.assert_array_equal(
        first.forward(first.new_cache(), tokens), second.forward(second.new_cache(), tokens)
    )


def _copy(cache):
    clone = type(cache)(cache.cfg, cache.capacity)
    clone.k[...] = cache.k
    clone.v[...] = cache.v
    clone.length = cache.length
    return clone

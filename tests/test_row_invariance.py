"""Row invariance of the fast backends (native and torch), bit for bit (`np.array_equal`, never a tolerance).

A position's logits must depend only on its sequence's tokens: not on how many new tokens the
forward carries, not on which other sequences share it or how long they are, not on whether
the position came from a prefill (whole or chunked) or a decode step. Greedy speculation then
equals plain greedy decoding by construction, near-ties included.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.decoding.drafters import NoDraftSource
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.drafters.suffix import SuffixSource
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Model, load_model, row_cache

from .tinymodel import TinySpec, random_weights, reference_logits, write_tiny_gguf

SPECS = {
    "q4_1-gqa": TinySpec(quant="Q4_1", context=160, seed=11),  # int4 products
    "q4_0-mqa-3-layers": TinySpec(quant="Q4_0", n_layers=3, n_heads=6, n_kv_heads=1, d_model=96, seed=12),
    "f32-untied": TinySpec(tied=False, seed=13),  # bf16 products, a head requantized to Q8_0
    "qwen2-bias-q4_1": TinySpec(architecture="qwen2", qkv_bias=True, quant="Q4_1", seed=14),
    "q8_0": TinySpec(quant="Q8_0", seed=15),
    "q5_1": TinySpec(quant="Q5_1", seed=16),
    # as llama-quantize's Q4_K_M does with rows of 320: Q5_0 for Q/K/V, O, gate and up, Q6_K down
    "q4_k_m-q5_0-q6_k": TinySpec(quant="Q4_K_M", d_model=320, d_ff=512, n_heads=5, n_kv_heads=1, seed=17),
    # Q/K Q4_K and V Q6_K: a product in two parts
    "q4_k_m-in-parts": TinySpec(quant="Q4_K_M", d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, seed=18),
    "q5_k": TinySpec(quant="Q5_K", d_model=256, d_ff=256, n_heads=4, n_kv_heads=2, seed=19),
    # Gemma 3: QK-norm, post-norms, GeGLU, the embedding scale, heads of 32 with d_model 64, and local
    # layers 0 and 2 (a pattern key of period 2) whose window of 8 the tests' sequences go far past
    "gemma3-window-8": TinySpec(architecture="gemma3", quant="Q8_0", n_layers=4, n_heads=4, n_kv_heads=1,
                                head_size=32, sliding_window=8, swa_pattern=2, context=160, seed=20),
    "qwen3-q4_k_m": TinySpec(architecture="qwen3", quant="Q4_K_M", d_model=256, d_ff=512, n_heads=4,
                             n_kv_heads=2, seed=24),
    # Llama 3's per-frequency RoPE divisors (rope_freqs.weight), with linear RoPE scaling on top
    "llama3-rope-freqs": TinySpec(quant="Q4_1", rope_freqs=True, rope_scale=4.0, rope_theta=5e5, seed=25),
}  # fmt: skip


FAST_BACKENDS = ("native", "torch")


@pytest.fixture(
    scope="module", params=[(s, b) for s in SPECS for b in FAST_BACKENDS], ids=lambda p: f"{p[0]}-{p[1]}"
)
def tiny(request, tmp_path_factory):
    name, backend = request.param
    spec = SPECS[name]
    path = tmp_path_factory.mktemp("rowinv") / "tiny.gguf"
    weights = write_tiny_gguf(path, spec)
    return load_model(path, backend), spec, weights


def one_at_a_time(model, tokens: list[int]) -> np.ndarray:
    cache = model.new_cache(capacity=1)  # grows on the way: reallocation must not matter either
    return np.concatenate([model.forward(cache, [t]) for t in tokens])


tokens_strategy = st.lists(st.integers(3, 266), min_size=2, max_size=70)


@settings(max_examples=20, deadline=None)
@given(tokens=tokens_strategy, sizes=st.lists(st.integers(1, 33), min_size=1, max_size=12))
def test_any_split_into_blocks_gives_the_same_bits(tiny, tokens, sizes):
    model, _, _ = tiny
    want = one_at_a_time(model, tokens)
    cache, pieces, start, i = model.new_cache(), [], 0, 0
    while start < len(tokens):
        size = sizes[i % len(sizes)]
        pieces.append(model.forward(cache, tokens[start : start + size]))
        start, i = start + size, i + 1
    assert np.array_equal(np.concatenate(pieces), want)
    assert np.array_equal(model.forward(model.new_cache(), tokens), want)


@settings(max_examples=20, deadline=None)
@given(
    prefix=tokens_strategy,
    block=st.lists(st.integers(3, 266), min_size=1, max_size=33),
    others=st.lists(
        st.tuples(
            st.lists(st.integers(3, 266), max_size=40), st.lists(st.integers(3, 266), min_size=1, max_size=20)
        ),
        max_size=4,
    ),
    where=st.integers(0, 4),
)
def test_batch_neighbours_do_not_change_a_sequence(tiny, prefix, block, others, where):
    """A verify block computed alone and inside a batched forward with other sequences of any length."""
    model, _, _ = tiny
    alone_cache = model.new_cache()
    model.forward(alone_cache, prefix)
    alone = model.forward(alone_cache, block)
    cache = model.new_cache()
    model.forward(cache, prefix)
    batch = []
    for context, new in others:
        other = model.new_cache()
        if context:
            model.forward(other, context)
        batch.append((other, new))
    at = min(where, len(batch))
    batch.insert(at, (cache, block))
    got = model.forward_batch(batch)[at]
    assert np.array_equal(got, alone)
    assert np.array_equal(alone, one_at_a_time(model, prefix + block)[len(prefix) :])


def test_last_row_only_equals_that_row_of_all_rows(tiny):
    model, _, _ = tiny
    tokens = list(range(3, 40))
    full = model.forward(model.new_cache(), tokens)
    last = model.forward(model.new_cache(), tokens, all_logits=False)
    assert np.array_equal(last[0], full[-1])


def test_each_sequence_gets_all_its_rows_logits_or_its_last_as_asked(tiny):
    """A verify lane's forward: verify steps want every row's logits, prompt chunks the last only."""
    model, _, _ = tiny
    seqs = [list(range(3, 20)), list(range(30, 41)), [5, 6, 7]]
    full, _ = model.forward_features([(model.new_cache(), s) for s in seqs], features=False)
    mixed, found = model.forward_features(
        [(model.new_cache(), s) for s in seqs], all_logits=[True, False, True], features=True
    )
    assert [len(x) for x in mixed] == [17, 1, 3] and [len(f) for f in found] == [17, 11, 3]
    assert np.array_equal(mixed[0], full[0]) and np.array_equal(mixed[2], full[2])
    assert np.array_equal(mixed[1][0], full[1][-1])
    last, _ = model.forward_features(
        [(model.new_cache(), s) for s in seqs], all_logits=[False] * 3, features=False
    )
    assert all(np.array_equal(x[0], f[-1]) for x, f in zip(last, full, strict=True))


def test_rollback_then_refeed_gives_the_same_bits(tiny):
    model, _, _ = tiny
    tokens = list(range(5, 30))
    want = model.forward(model.new_cache(), [*tokens, 7, 8, 9])[len(tokens) :]
    cache = model.new_cache()
    model.forward(cache, tokens)
    model.forward(cache, [100, 101, 102, 103, 104, 105, 106, 107])  # eight rejected drafts
    cache.truncate(len(tokens))
    assert np.array_equal(model.forward(cache, [7, 8, 9]), want)


def test_torch_backend_stays_close_to_the_float64_reference(tiny):
    """Not a bitwise property: the fast targets quantize activations (int8 or bf16). The distance is
    reported so a regression in the kernels (a wrong layout, a lost bias) shows as a jump."""
    model, spec, weights = tiny
    tokens = list(np.random.default_rng(3).integers(3, 267, size=30))
    got = model.forward(model.new_cache(), tokens)
    want = reference_logits(weights, spec, tokens)
    distance = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    print(
        f"{model.backend} {spec.quant} {spec.architecture}: "
        f"max |fast - f64| {distance:.4f}, logits up to {scale:.1f}"
    )
    assert distance < 0.05 * scale
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


# --- greedy speculation equals plain greedy, near-ties included -----------------------------


def near_tie_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Embedding rows in pairs that differ by about 0.001%: with the tied head, the two tokens of a
    pair get logits within round-off of each other at every position (near-ties, some exact)."""
    weights = random_weights(spec)
    embed = weights["token_embd.weight"]
    noise = np.random.default_rng(spec.seed).standard_normal(embed[4::2].shape).astype(np.float32)
    embed[4::2] = embed[3:-1:2] * (1 + 1e-5 * noise)
    return weights


FLAT = {
    "Q4_1": TinySpec(seed=31, quant="Q4_1"),
    "Q5_1": TinySpec(seed=31, quant="Q5_1"),
    "Q5_K": TinySpec(seed=31, quant="Q5_K", d_model=256, d_ff=256),
    "Q4_K_M": TinySpec(seed=31, quant="Q4_K_M", d_model=256, d_ff=512),  # Q4_K, Q6_K
    "Q4_K_M_320": TinySpec(
        seed=31, quant="Q4_K_M", d_model=320, d_ff=512, n_heads=5, n_kv_heads=1
    ),  # Q5_0 too
    # Gemma 3 with a window of 8 in layers 0 and 2: speculation's rollbacks cross compacted buffers
    "GEMMA3": TinySpec(
        seed=31,
        architecture="gemma3",
        quant="Q8_0",
        n_layers=4,
        n_heads=4,
        n_kv_heads=1,
        head_size=32,
        sliding_window=8,
        swa_pattern=2,
    ),
}


@pytest.fixture(
    scope="module", params=[*FAST_BACKENDS, *(f"native-{quant}" for quant in FLAT if quant != "Q4_1")]
)
def flat_models(request, tmp_path_factory):
    """Target and draft with near-tied logits: where a runtime that is not row-invariant would
    pick different argmaxes in a block and alone. On each fast backend with Q4_1 blocks, and on
    the native one with every other block type it holds (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_0) and
    with a windowed Gemma 3."""
    backend, _, quant = request.param.partition("-")
    root = tmp_path_factory.mktemp("flat")
    for name, scale in (("target", 1.0), ("draft", 0.8)):
        spec = replace(FLAT[quant or "Q4_1"], scale=scale)
        write_tiny_gguf(root / f"{name}.gguf", replace(spec, weights=near_tie_weights(spec)))
    return load_model(root / "target.gguf", backend), load_model(root / "draft.gguf", backend)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    k=st.sampled_from([None, 1, 3, 8, 16]),
    length=st.integers(2, 40),
    drafter=st.sampled_from(["ngram", "suffix", "model", "self-model", "auto"]),
    tree=st.booleans(),
)
def test_greedy_speculation_is_identical_on_near_ties(flat_models, seed, k, length, drafter, tree):
    target, draft = flat_models
    base = np.random.default_rng(seed).integers(3, 267, size=max(2, length // 3)).tolist()
    prompt = (base * 4)[:length]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    source = {
        "ngram": NgramSource(), "suffix": SuffixSource(), "model": ModelSource(draft, target),
        "self-model": ModelSource(target, target), "auto": make_draft_source("auto", target, draft),
    }[drafter]  # fmt: skip
    plain = decode(target, prompt, params, NoDraftSource(), k=0)
    spec = decode(target, prompt, params, source, k=k, tree=tree)
    assert spec.tokens == plain.tokens


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    temperature=st.sampled_from([0.3, 0.8, 1.0, 1.7]),
    top_k=st.sampled_from([0, 2, 20]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    k=st.sampled_from([None, 1, 3, 8, 16]),
    length=st.integers(2, 40),
    drafter=st.sampled_from(["ngram", "suffix", "auto"]),
    earlier=st.integers(0, 2),
    tree=st.booleans(),
)
def test_seeded_speculation_equals_plain_seeded_decoding(
    flat_models, seed, temperature, top_k, top_p, k, length, drafter, earlier, tree
):
    """Every deterministic drafter, any k, after earlier requests that filled the suffix cache
    (which changes what is drafted): the tokens are exactly plain seeded decoding's, because each
    position is sampled with its own number (`decoding.noise`) from bit-identical rows."""
    target, _ = flat_models
    rng = np.random.default_rng(seed % 2**32)
    base = rng.integers(3, 267, size=max(2, length // 3)).tolist()
    prompt = (base * 4)[:length]
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=24, ignore_eos=True
    )
    source = {"ngram": NgramSource(), "suffix": SuffixSource(), "auto": make_draft_source("auto", target)}[
        drafter
    ]
    for _ in range(earlier):  # other requests teach the cross-request cache other continuations
        other = rng.integers(3, 267, size=8).tolist() * 3
        decode(target, other, msgspec.structs.replace(params, seed=int(rng.integers(2**32))), source, k=4)
    plain = decode(target, prompt, params, NoDraftSource(), k=0)
    spec = decode(target, prompt, params, source, k=k, tree=tree)
    assert spec.tokens == plain.tokens


def test_flat_target_really_has_near_ties(flat_models):
    """The near-tie test above is only worth its name if the top two logits are close."""
    target, _ = flat_models
    logits = target.forward(target.new_cache(), list(range(3, 60)))
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert float(np.median(top2[:, 1] - top2[:, 0])) < 1e-3


# --- the default model ---------------------------------------------------------------------


def test_default_model_logits_are_row_invariant(served_model):
    model = served_model
    if model.backend == "numpy":
        pytest.skip(f"the default backend here is {model.backend}")
    tokens = model.tokenizer.encode("Row invariance: the same position, the same bits, whatever the block.")
    tokens = (tokens * 3)[:48]
    want = one_at_a_time(model, tokens)
    assert np.array_equal(model.forward(model.new_cache(), tokens), want)
    cache, pieces, start = model.new_cache(), [], 0
    for size in (5, 1, 17, 2, 33):
        pieces.append(model.forward(cache, tokens[start : start + size]))
        start += size
    assert np.array_equal(np.concatenate(pieces)[: len(tokens)], want)
    other, mine = model.new_cache(), model.new_cache()
    model.forward(other, tokens[:20])
    model.forward(mine, tokens[:30])
    got = model.forward_batch([(other, tokens[5:30]), (mine, tokens[30:])])[1]
    assert np.array_equal(got, want[30:])


@given(st.integers(1, 70_000))
def test_a_key_row_stride_is_a_multiple_of_16_and_never_of_256(capacity):
    stride = row_cache._stride(capacity)
    assert capacity <= stride <= capacity + 31 and stride % 16 == 0 and stride % 256 != 0


def test_the_cache_s_capacity_changes_no_bit(served_model):
    """A cache's capacity sets its rows' stride (`row_cache._stride`): the same tokens give the same
    bits in caches whose strides are 48, 144, 272 and 1,040 elements, batched together or not."""
    model = served_model
    if model.backend == "numpy":
        pytest.skip(f"the default backend here is {model.backend}")
    tokens = model.tokenizer.encode("The stride of a cache's rows is layout, never arithmetic.")[:40]
    caches = [model.new_cache(capacity=c) for c in (41, 130, 260, 1030)]
    assert [c.stride for c in caches] == [48, 144, 272, 1040]
    want = model.forward(caches[0], tokens)
    for cache in caches[1:]:
        assert np.array_equal(model.forward(cache, tokens), want)
    steps = model.forward_batch([(cache, [tokens[-1]]) for cache in caches])
    assert all(np.array_equal(step, steps[0]) for step in steps)


def test_the_thread_count_changes_no_bit(served_model):
    """The native kernels split a forward's rows (from ROWS_PARALLEL = 32 on), every product's output
    tiles (claimed by whichever thread is free, `gemm_blocks`) and a batch's attention units between
    OpenMP threads, never a sum: 1, 2 and 3 threads (more than the cores: claims move) give the
    same bits, for a prefill, a step, and a batch of sequences of different lengths with a token
    tree among them. The suite's workers run one thread each (conftest.pytest_configure), users as
    many as their cores."""
    model = served_model
    if model.backend != "native":
        pytest.skip("needs the native backend")
    gomp = ctypes.CDLL("libgomp.so.1")  # the one the kernels link (pipeline/model/native.py)
    tokens = model.tokenizer.encode("Threads split rows and outputs between them, and never a sum. " * 6)[:80]

    def forwards() -> list[np.ndarray]:
        caches = [model.new_cache() for _ in range(3)]
        got = [model.forward(caches[0], tokens[:70]), model.forward(caches[0], tokens[70:])]
        model.forward(caches[1], tokens[:9])
        model.forward(caches[2], tokens[:40])
        tree = (caches[2], tokens[40:45], np.array([-1, 0, 0, 1, 2], np.int32))
        return got + model.forward_batch([(caches[0], tokens[:3]), (caches[1], [5]), tree])

    before, runs = gomp.omp_get_max_threads(), []
    try:
        for threads in (1, 2, 3):
            gomp.omp_set_num_threads(threads)
            assert gomp.omp_get_max_threads() == threads
            runs.append(forwards())
    finally:
        gomp.omp_set_num_threads(before)
    for run in runs[1:]:
        assert all(np.array_equal(got, want) for got, want in zip(run, runs[0], strict=True))


def test_numpy_reference_is_documented_as_not_row_invariant(tmp_path):
    """The reference's products go through OpenBLAS (GEMV for one row, GEMM for several): its
    logits may differ in the last bits between a block and single steps. Greedy equality on the
    reference therefore holds only away from near-ties; the model docstring says so. This test
    keeps that statement honest: it records whether the difference shows on this machine."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=41, d_model=128, d_ff=256, n_heads=4, n_kv_heads=2))
    model = Model.load(path)
    tokens = list(range(3, 40))
    block = model.forward(model.new_cache(), tokens)
    alone = one_at_a_time(model, tokens)
    np.testing.assert_allclose(block, alone, atol=1e-4, rtol=0)  # close, as documented
    print("numpy reference bit-identical block vs single steps here:", np.array_equal(block, alone))


def test_portable_build_gives_the_same_bits_as_this_cpus_build(served_model, portable_kernels):
    """products.c and rowkernels.c promise the same integers and float operations on every path:
    a build for a plain x86-64-v2 CPU (no AVX2, no AVX-512, no VNNI) must give the default model's
    logits bit for bit as the build for this machine."""
    if served_model.backend != "native":
        pytest.skip("needs the native backend")
    tokens = served_model.tokenizer.encode("The portable path must give the same bits, row for row.")
    want = served_model.forward(served_model.new_cache(), tokens)
    fast_lib, head_lib = served_model.lib, served_model.head_products.lib
    try:
        served_model.lib = served_model.head_products.lib = portable_kernels
        got = served_model.forward(served_model.new_cache(), tokens)
    finally:
        served_model.lib, served_model.head_products.lib = fast_lib, head_lib
    assert np.array_equal(got, want)

"""The model families (Gemma 3, Qwen 3, Llama 3 beside llama and qwen2): their configs as read from
tiny GGUF files, the numpy oracle against the float64 reference of each family, and the refusals.

The shape tests of test_model_forward (token by token, mixed blocks, rollback, batches) run here
again on the families' tiny models: a sliding window is a mask, and every path that builds one
(a block, a single decode row, a batch) must agree.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.model import Model
from pipeline.model.errors import ModelFileError
from pipeline.model.gguf_file import FAMILIES, _open, read_config
from pipeline.model.llama import causal_mask, window_mask

from . import test_model_forward as shapes
from .tinymodel import TinySpec, local_layers, random_weights, reference_logits

# Global base 1e6 as the real file: the local layers' family base (10000) must differ to be tested.
GEMMA = {"architecture": "gemma3", "head_size": 24, "sliding_window": 8, "rope_theta": 1e6}
FAMILY_SPECS = {
    # 3 layers, period 3: layers 0 and 1 local, 2 global; head_dim 24 with d_model 64
    "gemma3-mixed": TinySpec(**GEMMA, n_layers=3, swa_pattern=3, seed=20),
    # no pattern key: the family's period 6 makes layer 5 the only global layer
    "gemma3-default-pattern": TinySpec(**GEMMA, n_layers=6, d_model=48, n_heads=2, n_kv_heads=1, seed=21),
    "gemma3-flags-q8_0": TinySpec(**GEMMA, n_layers=3, swa_pattern=(False, True, True), quant="Q8_0", seed=2),
    # Q4_K needs rows of 256: the Q4_K_M mix of Q4_K, Q6_K, Q5_0 and Q8_0, as the real file holds
    "gemma3-q4_k_m": TinySpec(
        architecture="gemma3", rope_theta=1e6, head_size=32, sliding_window=8, swa_pattern=2, d_model=256,
        d_ff=256, n_heads=2, n_kv_heads=1, quant="Q4_K_M", seed=23,
    ),
    "qwen3": TinySpec(architecture="qwen3", head_size=24, seed=24),
    "qwen3-q8_0-untied": TinySpec(architecture="qwen3", head_size=32, tied=False, quant="Q8_0", seed=25),
    "llama3-rope-freqs": TinySpec(rope_freqs=True, rope_theta=500000.0, seed=26),
    "llama3-linear-q8_0": TinySpec(rope_scale=4.0, quant="Q8_0", seed=27),
}  # fmt: skip
CONTEXT = 40  # five windows of 8


@pytest.fixture(params=list(FAMILY_SPECS), ids=list(FAMILY_SPECS))
def tiny(request, tiny_model_file):
    spec = FAMILY_SPECS[request.param]
    path, weights = tiny_model_file(spec)
    return Model.load(path), weights, spec


test_token_by_token_matches_block = shapes.test_token_by_token_matches_block
test_mixed_block_sizes_match_block = shapes.test_mixed_block_sizes_match_block
test_rollback_then_refeed_matches_clean_run = shapes.test_rollback_then_refeed_matches_clean_run
test_batched_sequences_match_separate_runs = shapes.test_batched_sequences_match_separate_runs
test_last_logits_only = shapes.test_last_logits_only


def test_oracle_matches_reference(tiny):
    model, weights, spec = tiny
    tokens = shapes.prompt(CONTEXT, seed=30)
    got = model.forward(model.new_cache(), tokens)
    want = reference_logits(weights, spec, tokens)
    assert got.shape == (CONTEXT, spec.vocab)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def test_decode_past_the_window_matches_reference(tiny):
    """One row at a time, the path with no causal mask of its own, far past the window."""
    model, weights, spec = tiny
    tokens = shapes.prompt(CONTEXT, seed=31)
    cache = model.new_cache(capacity=4)
    model.forward(cache, tokens[:5])
    steps = np.concatenate([model.forward(cache, [t]) for t in tokens[5:]])
    np.testing.assert_allclose(steps, reference_logits(weights, spec, tokens)[5:], atol=2e-4, rtol=0)


def test_config_of_each_family(tiny):
    model, _, spec = tiny
    cfg, family = model.cfg, FAMILIES[spec.architecture]
    assert (cfg.head_dim, cfg.q_dim) == (spec.head_dim, spec.n_heads * spec.head_dim)
    assert (cfg.qk_norm, cfg.post_norms) == (spec.qk_norm, spec.gemma)
    assert cfg.activation == ("gelu_tanh" if spec.gemma else "silu")
    assert cfg.embed_scale == (pytest.approx(math.sqrt(spec.d_model)) if spec.gemma else 1.0)
    assert cfg.query_scale == pytest.approx(spec.head_dim**-0.5)
    assert cfg.local_layers == tuple(i for i, local in enumerate(local_layers(spec)) if local)
    assert cfg.sliding_window == (spec.sliding_window if family.sliding else 0)
    assert cfg.rope_theta_local == (10000.0 if family.sliding else 0.0)
    assert (cfg.rope_scale, cfg.rope_freq_factors) == (spec.rope_scale, spec.rope_freqs)


def _logits(tiny_model_file, spec: TinySpec, tokens: list[int]) -> np.ndarray:
    path, _ = tiny_model_file(spec, name=f"window-{spec.sliding_window}-{spec.swa_pattern}.gguf")
    model = Model.load(path)
    return model.forward(model.new_cache(), tokens)


def test_the_window_is_not_dead_code(tiny_model_file):
    """A wider window changes exactly the rows that see keys the narrow one hides (positions 8 on),
    and only on local layers: with every layer global the window changes nothing."""
    tokens = shapes.prompt(CONTEXT, seed=32)
    weights = random_weights(TinySpec(**GEMMA, n_layers=3, seed=33))
    narrow, wide = (
        TinySpec(**(GEMMA | {"sliding_window": w}), n_layers=3, seed=33, weights=weights) for w in (8, 64)
    )
    a, b = _logits(tiny_model_file, narrow, tokens), _logits(tiny_model_file, wide, tokens)
    np.testing.assert_array_equal(a[:8], b[:8])
    assert np.abs(a[8:] - b[8:]).max(axis=-1).min() > 1e-3
    narrow.swa_pattern = wide.swa_pattern = (False, False, False)
    np.testing.assert_array_equal(
        _logits(tiny_model_file, narrow, tokens), _logits(tiny_model_file, wide, tokens)
    )


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, 30), rows=st.integers(1, 12), window=st.integers(1, 50))
def test_window_mask_hides_exactly_the_far_keys(start, rows, window):
    mask = causal_mask(start, rows) if rows > 1 else None
    got = window_mask(mask, np.arange(start + rows), window)
    query = np.arange(start, start + rows)[:, None]
    key = np.arange(start + rows)[None, :]
    want = np.where((key > query) | (query - key >= window), -np.inf, 0.0)
    if got is None:
        assert not np.isinf(want).any()
    else:
        np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def _config(tiny_model_file, spec: TinySpec):
    path, _ = tiny_model_file(spec)
    return read_config(_open(path))


def test_gemma3_defaults_where_the_file_is_silent(tiny_model_file):
    """The real 270M's shape: 18 layers with no pattern key, so globals at 5, 11 and 17."""
    cfg = _config(
        tiny_model_file, TinySpec(**GEMMA, n_layers=18, d_model=32, n_heads=2, n_kv_heads=1, d_ff=32)
    )
    assert tuple(i for i in range(18) if not cfg.is_local(i)) == (5, 11, 17)
    assert (cfg.sliding_window, cfg.rope_theta_local, cfg.attn_scale) == (8, 10000.0, 0.0)


def test_gemma3_27b_query_scale(tiny_model_file):
    """llama.cpp scales the 27B's (62 layers) queries by (d_model / n_heads) ** -0.5, not head_dim's."""
    spec = TinySpec(**(GEMMA | {"head_size": 8}), n_layers=62, d_model=48, n_heads=2, n_kv_heads=1, d_ff=16)
    assert _config(tiny_model_file, spec).query_scale == pytest.approx(24**-0.5)


def test_legacy_linear_scale_key(tiny_model_file):
    cfg = _config(tiny_model_file, TinySpec(extra={"llama.rope.scale_linear": 8.0}))
    assert cfg.rope_scale == 8.0


FINAL_CAP, ATTN_CAP = {"gemma3.final_logit_softcapping": 30.0}, {"gemma3.attn_logit_softcapping": 50.0}
REFUSED = {
    "final-softcap": (TinySpec(**GEMMA, extra=FINAL_CAP), "final logit soft-capping"),
    "attn-softcap": (TinySpec(**GEMMA, extra=ATTN_CAP), "attention logit soft-capping"),
    "yarn": (TinySpec(extra={"llama.rope.scaling.type": "yarn"}), "unsupported rope scaling 'yarn'"),
    "longrope": (TinySpec(architecture="qwen3", extra={"qwen3.rope.scaling.type": "longrope"}), "'longrope'"),
    "partial-rotary": (TinySpec(extra={"llama.rope.dimension_count": 8}), "partial rotary"),
    "value-width": (TinySpec(**GEMMA, extra={"gemma3.attention.value_length": 16}), "value heads of 16"),
    "no-window": (TinySpec(**(GEMMA | {"sliding_window": 0})), "'gemma3.attention.sliding_window' is missi"),
    "gemma-rope-freqs": (TinySpec(**GEMMA, rope_freqs=True), "rope_freqs.weight tensor in a gemma3 file"),
    "pattern-length": (TinySpec(**GEMMA, swa_pattern=(True,)), "1 flags for 2 layers"),
    "wide-heads": (TinySpec(n_heads=2, n_kv_heads=1, head_size=288), "heads of 288 values"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_refused_files_say_why(tiny_model_file, case):
    spec, message = REFUSED[case]
    path, _ = tiny_model_file(spec)
    with pytest.raises(ModelFileError, match=message):
        Model.load(path)


@pytest.mark.parametrize("name", ["attn_q_norm", "post_ffw_norm"])
def test_missing_family_tensor(tiny_model_file, name):
    weights = random_weights(TinySpec(**GEMMA, seed=34))
    del weights[f"blk.1.{name}.weight"]
    path, _ = tiny_model_file(TinySpec(**GEMMA, seed=34, weights=weights))
    with pytest.raises(ModelFileError, match=rf"tensor 'blk\.1\.{name}\.weight' is missing"):
        Model.load(path)


def test_unknown_architecture_lists_the_supported(tiny_model_file):
    path, _ = tiny_model_file(TinySpec(architecture="gemma2"))
    with pytest.raises(ModelFileError, match=r"'gemma2' \(supported: gemma3, llama, qwen2, qwen3\)"):
        Model.load(path)

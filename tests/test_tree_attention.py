"""Token-tree forwards: each tree row's logits are bit for bit what a chain through its path
computes (`np.array_equal`), on every fast backend, and `KVCache.keep` compacts a kept path into
the cache exactly as if that path had been decoded one token at a time.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.decoding.tree import path
from pipeline.model import load_model
from pipeline.model.llama import moved_rows

from .tinymodel import TinySpec, write_tiny_gguf

SPECS = {
    "q4_1-gqa": TinySpec(quant="Q4_1", context=160, seed=21),
    "qwen2-bias-q8_0": TinySpec(architecture="qwen2", qkv_bias=True, quant="Q8_0", seed=22),
    "3-per-kv-64": TinySpec(quant="Q4_1", n_heads=6, n_kv_heads=2, d_model=384, seed=23),  # the 3x64 kernel
}


@pytest.fixture(
    scope="module",
    params=[(s, b) for s in SPECS for b in ("native", "torch", "numpy")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def tiny(request, tmp_path_factory):
    name, backend = request.param
    file = tmp_path_factory.mktemp("tree") / "tiny.gguf"
    write_tiny_gguf(file, SPECS[name])
    return load_model(file, backend)


@st.composite
def trees(draw, max_rows: int = 12):
    """(tokens, parents) with row 0 the root (parent -1) and every other row under an earlier one."""
    rows = draw(st.integers(1, max_rows))
    parents = [-1] + [draw(st.integers(-1 if i == 0 else 0, i - 1)) for i in range(1, rows)]
    tokens = draw(st.lists(st.integers(3, 266), min_size=rows, max_size=rows))
    return tokens, parents


def agree(model, got: np.ndarray, want: np.ndarray) -> bool:
    """Bit for bit on the row-invariant backends; the numpy reference only promises closeness."""
    if model.backend == "numpy":
        return bool(np.allclose(got, want, rtol=1e-4, atol=1e-4))
    return bool(np.array_equal(got, want))


@settings(max_examples=15, deadline=None)
@given(prefix=st.lists(st.integers(3, 266), min_size=1, max_size=60), tree=trees())
def test_each_tree_row_equals_the_chain_through_its_path(tiny, prefix, tree):
    model = tiny
    tokens, parents = tree
    cache = model.new_cache(capacity=4)
    model.forward(cache, prefix)
    logits = model.forward_batch([(cache, tokens, parents)])[0]
    for row in range(len(tokens)):
        rows = path(parents, row)
        chain = model.new_cache(capacity=4)
        model.forward(chain, prefix)
        want = model.forward(chain, [tokens[r] for r in rows])[-1]
        assert agree(model, logits[row], want), (row, rows)


@settings(max_examples=10, deadline=None)
@given(
    prefix=st.lists(st.integers(3, 266), min_size=1, max_size=40),
    tree=trees(),
    data=st.data(),
    after=st.lists(st.integers(3, 266), min_size=1, max_size=5),
)
def test_a_kept_path_continues_like_one_token_at_a_time(tiny, prefix, tree, data, after):
    model = tiny
    tokens, parents = tree
    kept = path(parents, data.draw(st.integers(0, len(tokens) - 1)))
    cache = model.new_cache(capacity=4)
    model.forward(cache, prefix)
    model.forward_batch([(cache, tokens, parents)])
    cache.keep(len(prefix), kept)
    got = model.forward(cache, after)
    chain = model.new_cache(capacity=1)
    want = np.concatenate([model.forward(chain, [t]) for t in [*prefix, *(tokens[r] for r in kept), *after]])
    assert cache.length == len(prefix) + len(kept) + len(after)
    assert agree(model, got, want[-len(after) :])


@given(tree=trees(), data=st.data())
def test_keep_copies_from_the_first_row_out_of_its_place(tree, data):
    """`keep` leaves the kept path's rows that are already in place: they are exactly its prefix
    0, 1, ..., moved - 1, and the row at `moved` (if any) is out of place."""
    _, parents = tree
    kept = path(parents, data.draw(st.integers(0, len(parents) - 1)))
    rows, moved = moved_rows(kept)
    assert rows == kept
    assert rows[:moved] == list(range(moved))
    assert moved == len(kept) or rows[moved] != moved


def test_a_tree_shares_a_batch_with_chains_without_changing_their_bits(tiny):
    model = tiny
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 266, 30).tolist()
    chain_tokens = rng.integers(3, 266, 6).tolist()
    alone = model.new_cache()
    model.forward(alone, prompt)
    want = model.forward(alone, chain_tokens)
    chain, tree = model.new_cache(), model.new_cache()
    model.forward(chain, prompt)
    model.forward(tree, prompt[:10])
    got = model.forward_batch([(chain, chain_tokens), (tree, [5, 6, 7, 8], [-1, 0, 0, 1])])[0]
    assert agree(model, got, want)


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2], [-1, 0, 5]])
def test_a_malformed_tree_is_refused_before_the_cache_moves(tiny, parents):
    model = tiny
    cache = model.new_cache()
    model.forward(cache, [3, 4, 5])
    with pytest.raises(ValueError, match="parent"):
        model.forward_batch([(cache, [7] * len(parents), parents)])
    assert cache.length == 3

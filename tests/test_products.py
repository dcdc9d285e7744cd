"""products.c directly: every block type the native backend holds (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K), every pass size (1..8 rows a pass, several passes), a last tile of padding,
bit for bit (`np.array_equal`).

The model-level tests (test_row_invariance, test_tree_attention) see these kernels only through
the kinds a tiny file happens to hold; here each kind meets every row count the kernel
specialises on, on this CPU's build and on a portable build without AVX-512 or VNNI.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model.fast_products import NativeProducts
from pipeline.model.native_weights import NativeMatrix, QuantBlocks, dequantize, fuse_runs, pack, split_blocks
from tests.kquants import BLOCK_TYPES, K_TYPES, random_raw
from tests.kquants import dequantize as gguf_dequantize

N_OUT = 40  # three tiles of 16, the last one half padding


def width(kind: str) -> int:
    """Three blocks of 32; two super-blocks of 256 for the K types."""
    return 512 if kind in K_TYPES else 96


def random_blocks(kind: str, seed: int, n_out: int = N_OUT) -> QuantBlocks:
    return split_blocks(random_raw(kind, n_out, width(kind), seed), kind, (n_out, width(kind)))


def activations(rows: int, seed: int, n_in: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, n_in)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    x[-1, 40:48] *= 50  # an outlier: one block's scale set by one value
    return x


def product(lib, x: np.ndarray, matrix: NativeMatrix | list[NativeMatrix], streamed: bool = True):
    products = NativeProducts(lib, streamed)
    return products.apply(products.prepare(x), matrix)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_blocks_parse_to_gguf_py_s_own_dequantization(kind):
    """The parsed values and scales, through the header's formula, are gguf-py's weights exactly."""
    raw = random_raw(kind, 5, width(kind), seed=9)
    want = gguf_dequantize(raw, kind).reshape(5, width(kind))
    assert np.array_equal(dequantize(split_blocks(raw, kind, (5, width(kind)))), want)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_each_row_is_computed_alone_whatever_the_pass(native_lib, kind):
    """Rows 1..17 in one call (passes of 1..8 rows, and 2 or 3 passes) against each row alone."""
    matrix = pack(random_blocks(kind, seed=1))
    x = activations(17, seed=2, n_in=width(kind))
    alone = np.concatenate([product(native_lib, x[r : r + 1], matrix) for r in range(17)])
    for rows in range(1, 18):
        got = product(native_lib, x[:rows], matrix)
        assert got.shape == (rows, N_OUT)
        assert np.array_equal(got, alone[:rows]), rows


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_streamed_weights_give_the_same_bits(native_lib, kind):
    """`streamed` only changes how the weights are prefetched (non-temporally, in one pass)."""
    matrix = pack(random_blocks(kind, seed=4))
    for rows in (1, 5, 8, 9, 17):
        x = activations(rows, seed=rows, n_in=width(kind))
        assert np.array_equal(product(native_lib, x, matrix, False), product(native_lib, x, matrix)), rows


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_portable_build_gives_the_same_bits(native_lib, portable_kernels, kind):
    matrix = pack(random_blocks(kind, seed=3))
    for rows in (1, 3, 8, 13):
        x = activations(rows, seed=rows, n_in=width(kind))
        assert np.array_equal(product(portable_kernels, x, matrix), product(native_lib, x, matrix)), rows


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_products_are_the_blocks_times_the_quantized_activations(native_lib, kind):
    """Against float64: gguf-py's dequantized weights times the int8 activations the kernel itself
    quantized (their values and scales), so only the float32 epilogue's rounding remains. A wrong
    layout, sign, offset or scale shows as an error many orders larger."""
    raw = random_raw(kind, N_OUT, width(kind), seed=4)
    weights = gguf_dequantize(raw, kind).reshape(N_OUT, width(kind)).astype(np.float64)
    x = activations(5, seed=5, n_in=width(kind))
    quantized = NativeProducts(native_lib).prepare(x)
    xq = quantized.q.astype(np.float64) * np.repeat(quantized.scale.astype(np.float64), 32, axis=1)
    want = xq @ weights.T
    got = product(native_lib, x, pack(split_blocks(raw, kind, (N_OUT, width(kind)))))
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


def test_a_product_in_parts_writes_each_part_s_columns(native_lib):
    """Q4_K and Q6_K tensors fused into one product (a Q/K/V whose V is Q6_K): two parts, each its
    own columns, the same bits as each part alone."""
    q, k, v = (random_blocks(kind, seed, 32) for kind, seed in (("Q4_K", 6), ("Q4_K", 7), ("Q6_K", 8)))
    parts = fuse_runs([(q, True), (k, True), (v, True)])
    assert [b.kind for b, _ in parts] == ["Q4_K", "Q6_K"]
    matrices = [pack(*part) for part in parts]
    x = activations(3, seed=10, n_in=512)
    got = product(native_lib, x, matrices)
    alone = np.concatenate([product(native_lib, x, m) for m in matrices], axis=1)
    assert got.shape == (3, 96) and np.array_equal(got, alone)


@pytest.mark.parametrize(
    ("quant", "kinds", "requantized"),
    [
        ("Q4_K_M", "Q5_0/Q6_K/Q8_0", None),  # d 320: Q5_0 and Q8_0 where rows are not whole super-blocks
        ("F32", "Q8_0", "F32 x15"),  # 2 layers x 7 tensors and the tied head: all requantized
    ],
)
def test_describe_names_the_kinds_held_and_every_type_requantized(
    native_lib, tmp_path, quant, kinds, requantized
):
    """The kernel path printed by every benchmark and `status` says which numbers are computed:
    the block types held as the file has them, and each file type that was not, with its count."""
    from pipeline.model import load_model

    from .tinymodel import TinySpec, write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(quant=quant, d_model=320, d_ff=512, n_heads=5, n_kv_heads=1, seed=5))
    text = load_model(path, "native").describe()
    assert f"layer weights {kinds} (" in text
    if requantized is None:
        assert "(the file's own blocks)" in text
    else:
        assert f"requantized to Q8_0 here: {requantized}" in text

"""products.c directly: every kind (Q4_0, Q4_1, Q8_0), every pass size (1..8 rows a pass, several
passes), a last tile of padding, bit for bit (`np.array_equal`).

The model-level tests (test_row_invariance, test_tree_attention) see these kernels only through
the kinds a tiny file happens to hold; here each kind meets every row count the kernel
specialises on, on this CPU's build and on a portable build without AVX-512 or VNNI.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model import native
from pipeline.model.errors import BackendUnavailable
from pipeline.model.fast_products import NativeProducts
from pipeline.model.native_weights import NativeMatrix, QuantBlocks, dequantize, pack

N_OUT, N_IN = 40, 96  # three tiles of 16, the last one half padding; three blocks of 32


def random_blocks(kind: str, seed: int) -> QuantBlocks:
    """Blocks with the extreme values included: q 0 and 15 (Q4), -128 and 127 (Q8)."""
    rng = np.random.default_rng(seed)
    if kind == "Q8_0":
        q = rng.integers(-128, 128, size=(N_OUT, N_IN)).astype(np.int8)
        q[0, :2] = (-128, 127)
    else:
        q = rng.integers(0, 16, size=(N_OUT, N_IN)).astype(np.uint8)
        q[0, :2] = (0, 15)
    d = (rng.standard_normal((N_OUT, N_IN // 32)) * 0.02).astype(np.float16)
    m = (rng.standard_normal((N_OUT, N_IN // 32)) * 0.1).astype(np.float16) if kind == "Q4_1" else None
    return QuantBlocks(kind, q, d, m)


def activations(rows: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, N_IN)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    return x


def product(lib, x: np.ndarray, matrix: NativeMatrix) -> np.ndarray:
    products = NativeProducts(lib)
    return products.apply(products.prepare(x), matrix)


@pytest.fixture(scope="module")
def native_lib():
    try:
        return native.row_kernels()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_each_row_is_computed_alone_whatever_the_pass(native_lib, kind):
    """Rows 1..17 in one call (passes of 1..8 rows, and 2 or 3 passes) against each row alone."""
    matrix = pack(random_blocks(kind, seed=1))
    x = activations(17, seed=2)
    alone = np.concatenate([product(native_lib, x[r : r + 1], matrix) for r in range(17)])
    for rows in range(1, 18):
        got = product(native_lib, x[:rows], matrix)
        assert got.shape == (rows, N_OUT)
        assert np.array_equal(got, alone[:rows]), rows


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_portable_build_gives_the_same_bits(native_lib, portable_kernels, kind):
    matrix = pack(random_blocks(kind, seed=3))
    for rows in (1, 3, 8, 13):
        x = activations(rows, seed=rows)
        assert np.array_equal(product(portable_kernels, x, matrix), product(native_lib, x, matrix)), rows


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_products_are_the_blocks_times_the_activations(native_lib, kind):
    """Against float64 on the dequantized weights: int8 activations cost about 0.5% here, so a wrong
    layout, sign or offset (Q8's q + 128) shows as a far larger error."""
    blocks = random_blocks(kind, seed=4)
    x = activations(5, seed=5)
    want = x.astype(np.float64) @ dequantize(blocks).astype(np.float64).T
    got = product(native_lib, x, pack(blocks))
    assert np.abs(got - want).max() < 0.01 * np.abs(want).max()

"""The one place weight products happen, so a kernel can be swapped and measured alone.

OpenBLAS's small-row GEMM paths are uneven: some row counts cost far more than their
neighbours. `ROW_BUCKETS` pads a block of rows up to a count measured to be fast
(`speclanes bench model` re-measures the curve); the extra rows are zeros and are
dropped from the result.
"""

from __future__ import annotations

import numpy as np

ROW_BUCKETS = (1, 2, 4, 8, 16)


def padded_rows(n: int) -> int:
    for bucket in ROW_BUCKETS:
        if n <= bucket:
            return bucket
    return n


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (n, in) @ w (in, out), with the row count padded to a fast bucket."""
    n = x.shape[0]
    rows = padded_rows(n)
    if rows == n:
        return x @ w
    padded = np.zeros((rows, x.shape[1]), dtype=x.dtype)
    padded[:n] = x
    return (padded @ w)[:n]


def linear_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (n, in) @ w.T for w stored (out, in): the tied LM head reads the embedding as is."""
    return linear(x, w.T)

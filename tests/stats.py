"""A chi-square goodness-of-fit check without scipy."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z_1E4 = 3.719  # standard normal quantile for a 1e-4 false-alarm rate


def chi_square(observed: Sequence[int], expected_probs: Sequence[float]) -> tuple[float, float]:
    """(statistic, critical value at 1e-4); cells with tiny expectation are pooled."""
    observed = np.asarray(observed, float)
    expected = np.asarray(expected_probs, float) * observed.sum()
    if (observed[expected == 0] > 0).any():
        return math.inf, 0.0  # an impossible outcome happened
    order = np.argsort(expected)
    small = order[np.cumsum(expected[order]) < 5]  # pool the rarest cells until they expect 5
    cells_o = [*observed[np.setdiff1d(order, small)], observed[small].sum()]
    cells_e = [*expected[np.setdiff1d(order, small)], expected[small].sum()]
    pairs = [(o, e) for o, e in zip(cells_o, cells_e, strict=True) if e > 0]
    statistic = sum((o - e) ** 2 / e for o, e in pairs)
    df = len(pairs) - 1
    # Wilson-Hilferty approximation of the chi-square quantile.
    critical = df * (1 - 2 / (9 * df) + Z_1E4 * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical

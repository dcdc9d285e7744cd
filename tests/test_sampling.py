"""Properties of the sampling functions (hypothesis) and a distribution check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pipeline.decoding import sampling
from pipeline.decoding.noise import PURPOSES, uniform
from pipeline.decoding.sampling import (
    SamplingParams,
    draw,
    native_draw,
    request_seed,
    sample_at,
    target_probs,
)
from pipeline.model import native

from .stats import chi_square

LOGITS = st.floats(-60, 60, width=32)
logit_rows = arrays(np.float32, st.integers(2, 64), elements=st.floats(-30, 30, width=32, allow_nan=False))
settings_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.integers(0, 10),
    top_p=st.floats(0.05, 1.0),
)


@given(logit_rows, settings_strategy)
def test_target_probs_is_a_distribution(logits, params):
    probs = target_probs(logits, params)
    assert probs.shape == logits.shape
    assert (probs >= 0).all()
    assert probs.sum() == pytest.approx(1.0)
    # The most likely token always survives every filter.
    assert probs[int(np.argmax(logits))] > 0


@settings(max_examples=200)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(2, 5000)), elements=LOGITS),
    st.sampled_from([0.3, 0.8, 1.0, 1.7]),
)
def test_target_probs_keeps_the_bits_of_exp_out_of_place(logits, temperature):
    """The in-place exp gives the float64 rows the out-of-place formula gave (the draws that audit
    trails recorded before it must replay to the same tokens), one row or a block."""
    scaled = logits.astype(np.float64) / temperature
    want = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    want /= want.sum(axis=-1, keepdims=True)
    params = SamplingParams(temperature=temperature)
    assert np.array_equal(target_probs(logits, params), want)
    assert np.array_equal(target_probs(logits[0], params), want[0])


@given(logit_rows, settings_strategy)
def test_filters_keep_the_right_support(logits, params):
    probs = target_probs(logits, params)
    support = np.flatnonzero(probs)
    if params.greedy:
        assert support.tolist() == [int(np.argmax(logits))]
        return
    if 0 < params.top_k < logits.size:
        # Only tokens at least as likely as the k-th most likely one (ties included) survive.
        assert logits[support].min() >= np.sort(logits)[-params.top_k]
    # Nothing kept may be less likely than something dropped.
    dropped = np.setdiff1d(np.arange(logits.size), support)
    if dropped.size:
        assert logits[support].min() >= logits[dropped].max()


@given(logit_rows, st.floats(0.05, 0.95))
def test_top_p_keeps_the_smallest_set_reaching_p(logits, top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p)
    full = target_probs(logits, SamplingParams(temperature=1.0))
    kept = np.flatnonzero(target_probs(logits, params))
    assert full[kept].sum() >= top_p - 1e-9
    smallest_kept = kept[np.argmin(full[kept])]
    assert full[kept].sum() - full[smallest_kept] < top_p + 1e-9


@given(arrays(np.float64, st.integers(1, 20), elements=st.floats(0, 1)), st.floats(0, 1, exclude_max=True))
def test_draw_lands_on_the_support(weights, u):
    if weights.sum() == 0:
        weights[0] = 1.0
    assert weights[draw(weights, u)] > 0


@pytest.fixture(scope="session", params=["native_lib", "portable_kernels"])
def kernels(request):
    """This machine's build and the portable one: draw.c must give numpy's index on both."""
    return request.getfixturevalue(request.param)


# Rows of eighths and u on the eighths as well: u * total lands exactly on a running sum, where
# searchsorted's side="right" must move past it.
eighths = arrays(np.float64, st.integers(1, 300), elements=st.sampled_from([0.0, 0.125, 0.25, 1.0]))
spread = st.one_of(st.just(0.0), st.floats(1e-310, 1e300), st.floats(0, 1))
weights = arrays(np.float64, st.integers(1, 300), elements=spread)
draws = st.one_of(st.floats(0, 1, exclude_max=True), st.integers(0, 7).map(lambda k: k / 8))


@settings(max_examples=300)
@given(st.one_of(eighths, weights), draws)
def test_the_native_draw_is_numpy_s_draw_and_count(kernels, row, u):
    """draw.c adds in numpy's cumsum order: the same index for every row and u, and the same count."""
    nonzero = int(np.count_nonzero(row))
    if nonzero == 0 or not np.isfinite(row.sum()):
        assert native_draw(kernels, row, u) is None  # left to numpy
        return
    want = int(np.flatnonzero(row)[0]) if nonzero == 1 else draw(row, u)
    assert native_draw(kernels, row, u) == (want, nonzero)


@pytest.mark.parametrize("row", [[0.5, np.nan], [0.5, -0.1, 0.6], [0.0, 0.0], [np.inf, 1.0]])
def test_the_native_draw_leaves_rows_it_cannot_order_to_numpy(kernels, row):
    assert native_draw(kernels, np.array(row), 0.5) is None


@given(logit_rows, st.integers(0, 2**32), st.integers(0, 2**20))
def test_sample_at_is_the_same_with_and_without_the_kernels(native_lib, logits, seed, position):
    probs = target_probs(logits, SamplingParams(temperature=0.8, max_tokens=1))
    for row in np.atleast_2d(probs):
        with_kernels = sample_at(row, seed, position)
        try:
            sampling.loaded_kernels = lambda: None
            assert sample_at(row, seed, position) == with_kernels
        finally:
            sampling.loaded_kernels = native.loaded_kernels


def test_draw_follows_the_distribution():
    probs = np.array([0.5, 0.0, 0.2, 0.3])
    grid = (np.arange(10_000) + 0.5) / 10_000  # an even sweep of u: exact frequencies
    counts = np.bincount([draw(probs, u) for u in grid], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), probs, atol=1e-3)


def test_seeded_sampling_is_reproducible():
    logits = np.random.default_rng(0).standard_normal(50)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=123)
    probs = target_probs(logits, params)
    seed = request_seed(params.seed)
    draws_a = [sample_at(probs, seed, position)[0] for position in range(50)]
    assert draws_a == [sample_at(probs, 123, position)[0] for position in range(50)]
    assert len(set(draws_a)) > 1  # it really sampled
    assert request_seed(None) != request_seed(None)  # no seed: a fresh one each time, reported back


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_k", -1, "top_k"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("max_tokens", 0, "max_tokens"),
        ("seed", -1, "seed"),
        ("stop", ("",), "stop"),
    ],
)
def test_invalid_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


@settings(max_examples=50)
@given(logit_rows, st.integers(0, 2**32))
def test_greedy_consumes_no_randomness(logits, seed):
    assert sample_at(target_probs(logits, SamplingParams()), seed, 9) == (int(np.argmax(logits)), None)


@settings(max_examples=300)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**62), st.sampled_from(sorted(PURPOSES.values())))
def test_a_position_s_number_is_the_first_double_of_its_philox_stream(seed, position, purpose):
    """The definition audit trails are checked against: a Philox generator keyed by the seed, its
    counter at (position, purpose), built afresh (`uniform` resets one per thread instead)."""
    fresh = np.random.Generator(np.random.Philox(key=seed, counter=[position, purpose, 0, 0]))
    assert uniform(seed, position, purpose) == fresh.random()


@settings(max_examples=200)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.sampled_from(sorted(PURPOSES.values())))
def test_a_position_s_number_depends_on_nothing_else(seed, position, purpose):
    """The same (seed, position, purpose) always gives the same number in [0, 1), whatever was
    drawn before; another position, purpose or seed gives another one."""
    u = uniform(seed, position, purpose)
    uniform(seed, position + 1, purpose)  # other draws in between change nothing
    assert 0.0 <= u < 1.0 and uniform(seed, position, purpose) == u
    others = {uniform(seed, position + 1, purpose), uniform(seed ^ 1, position, purpose)}
    others.add(uniform(seed, position, (purpose + 1) % len(PURPOSES)))
    assert u not in others


def test_position_keyed_numbers_are_uniform():
    numbers = [uniform(7, position, 0) for position in range(20_000)]
    counts = np.bincount((np.array(numbers) * 10).astype(int), minlength=10)
    statistic, critical = chi_square(counts, np.full(10, 0.1))
    assert statistic < critical

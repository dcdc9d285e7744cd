"""`speclanes bench pipeline`'s inter-token latency: the gaps between a stream's chunks, in ms."""

from __future__ import annotations

import pytest

from pipeline.bench.pipeline_bench import inter_token_ms


def test_inter_token_latency_is_the_median_and_the_99th_percentile_gap():
    gaps = [0.010] * 98 + [0.200, 0.500]  # two stalls among a hundred chunks
    found = inter_token_ms(gaps)
    assert found["p50"] == pytest.approx(10.0)
    assert 200.0 < found["p99"] < 500.0  # between the two stalls: the 99th of 100 gaps
    assert inter_token_ms([]) == inter_token_ms([0.1]) == {"p50": 0.0, "p99": 0.0}

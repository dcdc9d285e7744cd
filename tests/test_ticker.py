"""The orchestrator's tick rides the wake-ups its bursts bring (lanes/ticker.py), on trio's mock clock."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from lanes.ticker import Ticker

EVERY, RIDE_AFTER = 0.1, 0.04
EPS = 1e-9  # the mock clock's sums of float seconds


def job_times(wake_ups: list[float], until: float) -> tuple[list[float], Ticker]:
    """When the job ran with the ticker running and another task waking after each of `wake_ups`
    (seconds after the one before) and riding it, up to `until`."""
    times: list[float] = []
    ticker = Ticker(EVERY, RIDE_AFTER, lambda: times.append(trio.current_time()))

    async def waker() -> None:
        for gap in wake_ups:
            await trio.sleep(gap)
            ticker.ride(trio.current_time())

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker.run)
            nursery.start_soon(waker)
            await trio.sleep(until)
            nursery.cancel_scope.cancel()

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    return times, ticker


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


def test_with_nothing_else_awake_the_timer_runs_the_job_every_period():
    times, ticker = job_times([], 2.0 + EVERY / 2)
    assert len(times) == 20
    assert all(abs(gap - EVERY) < EPS for gap in gaps(times))
    assert (ticker.fired, ticker.rode) == (20, 0)


def test_while_bursts_keep_the_loop_awake_they_run_the_job_and_the_timer_never_fires():
    """Bursts 55 ms apart, as a stream's reports come: each runs the tick, and the timer, which
    would wait 100 ms, never wakes the loop itself."""
    times, ticker = job_times([0.055] * 40, 2.2)
    assert ticker.fired == 0 and ticker.rode == len(times) == 40
    assert all(abs(gap - 0.055) < EPS for gap in gaps(times))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.001, max_value=0.3), max_size=40))
def test_the_job_runs_at_most_every_and_at_least_ride_after_apart(wake_ups):
    until = sum(wake_ups) + 0.5
    times, ticker = job_times(wake_ups, until)
    assert ticker.fired + ticker.rode == len(times)
    assert all(RIDE_AFTER - EPS <= gap <= EVERY + EPS for gap in gaps(times))
    assert until - times[-1] <= EVERY + EPS  # the last run is never further back than `every`

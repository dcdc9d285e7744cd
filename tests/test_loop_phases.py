"""The verify lane's loop split into phases: each phase is charged its own time and nothing of the
phases inside it, and the totals become milliseconds a forward."""

from __future__ import annotations

import pytest

from pipeline.workers.loop_phases import LoopPhase, Stopwatch, per_forward, render_split


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_nested_phase_stops_the_outer_one_s_clock():
    clock, totals = Clock(), {}
    watch = Stopwatch(totals, clock)
    with watch.phase(LoopPhase.BOOKKEEPING):
        clock.now += 1.0
        with watch.phase(LoopPhase.FORWARD):
            clock.now += 5.0
        clock.now += 0.5
        with watch.phase(LoopPhase.REPORT):
            clock.now += 0.25
            with watch.phase(LoopPhase.PAUSE):
                clock.now += 2.0
    clock.now += 100.0  # in no phase: not counted
    assert totals == {"bookkeeping": 1.5, "forward": 5.0, "report": 0.25, "pause": 2.0}


def test_the_empty_phase_times_nothing_and_hides_its_outer_phase():
    clock, totals = Clock(), {}
    watch = Stopwatch(totals, clock)
    with watch.phase(None):
        clock.now += 3.0
        with watch.phase(LoopPhase.HELD):
            clock.now += 1.0
        clock.now += 3.0
    assert totals == {"held": 1.0}


def test_an_exception_leaves_the_phase():
    clock, totals = Clock(), {}
    watch = Stopwatch(totals, clock)
    with pytest.raises(RuntimeError), watch.phase(LoopPhase.CHECKPOINT):
        clock.now += 1.0
        raise RuntimeError
    clock.now += 1.0
    assert totals == {"checkpoint": 1.0} and watch.stack == []


def test_totals_become_milliseconds_a_forward_in_phase_order():
    before = {"forward": 1.0, "pause": 0.5}
    after = {"forward": 3.0, "pause": 0.6, "bookkeeping": 0.2}
    split = per_forward(before, after, 400)
    assert list(split) == [p.value for p in LoopPhase]
    assert split["forward"] == pytest.approx(5.0) and split["pause"] == pytest.approx(0.25)
    assert split["bookkeeping"] == pytest.approx(0.5) and split["held"] == 0.0
    assert render_split(split) == "forward 5.00, bookkeeping 0.50, pause 0.25"
    assert per_forward(before, after, 0) == {} and render_split({}) == "no forwards"

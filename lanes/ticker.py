"""A periodic job that rides the wake-ups its event loop has anyway.

Why not a plain `trio.sleep` loop: on the 2-core VMs this runs on, waking a sleeping Python event
loop costs about 0.5 ms of CPU before it does anything (a bare `trio.sleep(0.05)` loop spends 9-12 ms
a second: its caches are cold after the forward's threads ran), and on a machine whose cores the
verify lane's forward uses, that CPU comes out of the forward. While steps flow the orchestrator
wakes for every burst of them (every `run.report_interval_seconds`, 50 ms, and a step); a wake-up
at least `ride_after` past the last run runs the job (`ride`) and moves the timer on. The timer
waits `every`, longer than the bursts' spacing, so it fires only when nothing else wakes the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import trio


class Ticker:
    """`job` at least every `every` seconds, and at a ride once `ride_after` has passed since it last ran."""

    def __init__(self, every: float, ride_after: float, job: Callable[[], None]) -> None:
        self.every, self.ride_after, self.job = every, ride_after, job
        self.last = -float("inf")  # when the job last ran; `run` starts the clock
        self.timer = trio.CancelScope()
        self.fired = self.rode = 0  # times the timer ran the job, and times a wake-up did

    async def run(self) -> NoReturn:
        self.last = trio.current_time()
        while True:
            with trio.CancelScope(deadline=self.last + self.every) as self.timer:
                await trio.sleep_forever()
            if (now := trio.current_time()) >= self.last + self.every:  # not when a ride ran it meanwhile
                self.fired += 1
                self._run(now)

    def ride(self, now: float) -> None:
        """Called in another task's wake-up: the job now if `ride_after` has passed since it last ran."""
        if now >= self.last + self.ride_after:
            self.rode += 1
            self._run(now)

    def _run(self, now: float) -> None:
        self.last = now
        self.timer.deadline = now + self.every  # later: the waiting timer is not woken by the move
        self.job()

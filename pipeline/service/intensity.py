"""Restart intensity, as OTP supervisors count it: at most `max_restarts` restarts within any
`within_seconds`. A lane that dies once more than that is not a transient fault a restart
cures (a bad path, a port taken, a crash at start); restarting it forever only hides it,
so the supervisor marks it failed instead. Pure: the caller passes the time in.
"""

from __future__ import annotations

from collections import deque


class RestartIntensity:
    def __init__(self, max_restarts: int, within_seconds: float) -> None:
        self.max_restarts, self.within_seconds = max_restarts, within_seconds
        self.times: deque[float] = deque()  # the restarts still inside the window

    def allow(self, now: float) -> bool:
        """Whether a restart now stays within the intensity; if it does, it is counted."""
        while self.times and self.times[0] <= now - self.within_seconds:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            return False
        self.times.append(now)
        return True

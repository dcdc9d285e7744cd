"""A helper lane's weight on a core the forward wants: its autogroup's nice (`run.helper_nice`).

Where the kernel groups tasks by session (autogroups: `/proc/sys/kernel/sched_autogroup_enabled`, for
tasks in the root cpu cgroup), every lane, started in a session of its own, is a scheduling group
weighted like the verify lane's, which spreads its weight over its two forward threads: a busy helper
then takes about two thirds of the core it shares with a forward thread. A higher nice for the
helpers' groups lets the forward keep its cores while they wait for a free one: more tok/s at 8
clients on 2 cores, nothing single-stream (docs/benchmarks.md, "Scheduling the helpers", and
`ops/bench/helper_scheduling.py`, which measures it). 0, the default, leaves them as heavy as the
verify lane.

Raising an autogroup's nice needs no privilege and can be undone, unlike `SCHED_IDLE`. The kernel
takes one such change in 100 ms from a writer without CAP_SYS_ADMIN, whichever process asks, so a
refused write (EAGAIN) is tried again. Where autogroups do not apply (a container's or a service's own
cpu cgroup) the write succeeds and changes nothing; where the kernel has none, the file is absent.
The group is the session's: a lane the supervisor started leads a session of its own, but one started
by hand shares its terminal's, whose group (the shell's, every job's) it leaves alone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

AUTOGROUP = Path("/proc/self/autogroup")
TRIES = 20  # 2 s at most: every helper of a starting pipeline asks within the same few hundred ms
RETRY_SECONDS = 0.11  # just over the kernel's 100 ms between two changes


Sleep = Callable[[float], None]


def leads_own_session() -> bool:
    return os.getsid(0) == os.getpid()


def set_autogroup_nice(
    nice: int, path: Path = AUTOGROUP, sleep: Sleep = time.sleep, own: Callable[[], bool] = leads_own_session
) -> bool:
    """This process's session group at `nice` (0-19); False where the session is not this process's
    own, the kernel has no autogroups or it would not take the change."""
    if not own():
        log.info("autogroup nice %d not set: this process shares its session's group", nice)
        return False
    for _ in range(TRIES):
        try:
            path.write_text(str(nice))
            return True
        except BlockingIOError:  # another process changed an autogroup less than 100 ms ago
            sleep(RETRY_SECONDS)
        except OSError as exc:
            log.info("autogroup nice %d not set: %s", nice, exc)
            return False
    log.warning("autogroup nice %d not set: the kernel kept refusing the change", nice)
    return False

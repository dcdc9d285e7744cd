"""One process's own standard figures (CPU time, memory, start time, file descriptors), measured by the
process itself and carried in its heartbeat: lanes may run on other hosts, so the orchestrator, which
exports the pipeline's metrics, cannot read their /proc. The Prometheus names are the ones every
client library exports (`process_cpu_seconds_total`, `process_resident_memory_bytes`, ...), one series
per process, labelled by lane and pid (observability/metrics.py).

Linux: read from /proc/self as prometheus_client's ProcessCollector does, about 30 µs per heartbeat.
Elsewhere the resident size is the peak one (getrusage) and the start time this module's import.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated

import msgspec
from opentelemetry.metrics import CallbackOptions, Meter, Observation

PROC = Path("/proc/self")
IMPORTED_AT = time.time()  # the start time where /proc has none: a lane imports this at its start
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class ProcessStats(msgspec.Struct, frozen=True, kw_only=True):
    cpu_seconds: NonNegative  # user + system, since the process started
    resident_bytes: Count
    virtual_bytes: Count = 0
    start_time: NonNegative  # Unix seconds
    open_fds: Count | None = None  # None where it cannot be counted cheaply
    max_fds: Count | None = None  # the soft limit

    @classmethod
    def measure(cls) -> ProcessStats:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        max_fds = None if soft == resource.RLIM_INFINITY else soft
        try:
            return _from_proc(cpu, max_fds)
        except (OSError, ValueError, IndexError):
            peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # kB except on macOS
            return cls(cpu_seconds=cpu, resident_bytes=peak, start_time=IMPORTED_AT, max_fds=max_fds)


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise ValueError("no btime in /proc/stat")


_BOOT: list[float] = []  # read once: it does not change while the process lives


def _from_proc(cpu: float, max_fds: int | None) -> ProcessStats:
    # Fields after the command name, which may hold spaces and parentheses (proc(5)): 22 starttime
    # (clock ticks after boot), 23 vsize (bytes), 24 rss (pages), counted from 3 here at index 0.
    fields = (PROC / "stat").read_text().rpartition(")")[2].split()
    if not _BOOT:
        _BOOT.append(_boot_time())
    started = _BOOT[0] + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return ProcessStats(
        cpu_seconds=cpu, resident_bytes=int(fields[21]) * resource.getpagesize(),
        virtual_bytes=int(fields[20]), start_time=started,
        open_fds=len(os.listdir(PROC / "fd")), max_fds=max_fds,
    )  # fmt: skip


Measured = Callable[[], Iterable[tuple[dict[str, str | int], ProcessStats]]]  # each process's labels, figures
# The OpenTelemetry instruments whose Prometheus names are the standard ones: `process.cpu` in seconds,
# a counter, becomes `process_cpu_seconds_total`; a unit in braces adds nothing to the name.
INSTRUMENTS: tuple[tuple[str, str, bool, Callable[[ProcessStats], float | None], str], ...] = (
    ("process.cpu", "s", True, lambda s: s.cpu_seconds, "User and system CPU time the process has used"),
    ("process.resident_memory", "By", False, lambda s: s.resident_bytes, "Resident memory size"),
    ("process.virtual_memory", "By", False, lambda s: s.virtual_bytes or None, "Virtual memory size"),
    ("process.start_time", "s", False, lambda s: s.start_time, "Start time of the process (Unix time)"),
    ("process.open_fds", "{fd}", False, lambda s: s.open_fds, "Open file descriptors"),
    ("process.max_fds", "{fd}", False, lambda s: s.max_fds, "Most open file descriptors allowed"),
)


def observe_processes(meter: Meter, measured: Measured) -> None:
    """Each figure of every process that `measured` names, read when metrics are collected."""
    for name, unit, counter, pick, description in INSTRUMENTS:

        def observe(
            options: CallbackOptions, pick: Callable[[ProcessStats], float | None] = pick
        ) -> Iterable[Observation]:
            values = [(labels, pick(stats)) for labels, stats in measured()]
            return [Observation(value, labels) for labels, value in values if value is not None]

        create = meter.create_observable_counter if counter else meter.create_observable_gauge
        create(name, [observe], unit, description)

"""The CPU one wake-up of a sleeping event loop costs on this machine, before it does any work.

Why it matters: the orchestrator, the audit lane, the gateway and the client do little per wake-up,
and on a 2-core machine the CPU they spend comes out of the verify lane's forward. On the VMs this
project runs on, a wake-up after a sleep costs far more than the few hundred Python calls it makes
would on warm caches, so a helper's CPU is about its wake-ups times this figure (`lane_cpu.py` counts
the wake-ups). Each loop sleeps `--period` seconds `--wakes` times doing nothing else; printed: CPU
milliseconds a wake-up (process time over the wake-ups, after a warm-up), median of `--repeats`:

- `epoll`: a bare `select.epoll().poll(period)`, the kernel's and the VM's part alone;
- `asyncio`: `asyncio.sleep(period)`;
- `trio`: `trio.sleep(period)`, as the lanes sleep.

    .venv/bin/python ops/bench/wake_cost.py [--period 0.05] [--wakes 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import select
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.bench.common import load_note


def epoll_loop(period: float, wakes: int) -> None:
    poller = select.epoll()
    for _ in range(wakes):
        poller.poll(period)
    poller.close()


def asyncio_loop(period: float, wakes: int) -> None:
    async def sleeps() -> None:
        for _ in range(wakes):
            await asyncio.sleep(period)

    asyncio.run(sleeps())


def trio_loop(period: float, wakes: int) -> None:
    async def sleeps() -> None:
        for _ in range(wakes):
            await trio.sleep(period)

    trio.run(sleeps)


LOOPS: dict[str, Callable[[float, int], None]] = {
    "epoll": epoll_loop,
    "asyncio": asyncio_loop,
    "trio": trio_loop,
}


def ms_per_wake(loop: Callable[[float, int], None], period: float, wakes: int) -> float:
    loop(period, 10)  # warm: imports, first-run allocations
    start = time.process_time()
    loop(period, wakes)
    return 1000.0 * (time.process_time() - start) / wakes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--period", type=float, default=0.05, help="seconds each loop sleeps")
    parser.add_argument("--wakes", type=int, default=100, help="wake-ups a measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load {load_note()}; {args.wakes} wake-ups {args.period:g} s apart, median of {args.repeats}")
    for name, loop in LOOPS.items():
        costs = [ms_per_wake(loop, args.period, args.wakes) for _ in range(args.repeats)]
        each = ", ".join(f"{c:.3f}" for c in costs)
        print(f"{name:>8}: {statistics.median(costs):.3f} ms of CPU a wake-up  ({each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

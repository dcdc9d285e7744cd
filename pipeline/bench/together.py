"""N clients at once, as the load benchmarks run them: a thread each, every one connecting first and
then starting at the same moment, so the wall time covers only the work all of them do together."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def together(count: int, client: Callable[[int, Callable[[], None]], T]) -> tuple[list[T], float]:
    """`client(index, ready)` for each index in its own thread; each calls `ready()` once connected,
    which waits for all the others. Returns the results in index order and the wall time from the
    first start to the last end; the first error in any thread is raised here."""
    results: list[T | None] = [None] * count
    errors: list[BaseException] = []
    starts: list[float] = []
    ends: list[float] = []
    barrier = threading.Barrier(count)

    def ready() -> None:
        barrier.wait()
        starts.append(time.perf_counter())

    def run(index: int) -> None:
        try:
            results[index] = client(index, ready)
            ends.append(time.perf_counter())
        except BaseException as exc:  # raised again by the caller's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None], max(ends) - min(starts)

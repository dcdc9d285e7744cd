"""How long a killed lane takes to be back: SIGKILL, then the time until `status` shows its successor up.

A request waits that long for a lost verify lane (then its re-prime), and decodes without drafts from
the draft lane for that long. The time covers the supervisor's back-off (`restart.initial_backoff`,
doubled for each further crash within `restart.reset_after`: later rounds wait longer by design), the
new process's start (imports, the model and the draft head from the weight cache), and its first
heartbeat over sockets connected both ways.

It starts a private, idle pipeline (`running_pipeline`), kills each lane in `--lanes` in turn,
`--rounds` times, 1.5 s apart. Run from the repository's root:

    .venv/bin/python ops/bench/restart_time.py [--rounds 3] [--lanes verify,draft] [--set K=V]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.bench.common import load_note, running_pipeline
from pipeline.protocol.client import Client


def lane_of(client: Client, name: str):
    return client.status().lane(name)


def back_after_kill(client: Client, name: str) -> float:
    """Seconds from SIGKILL to the lane's successor counted as up."""
    old = lane_of(client, name).pid
    assert old is not None, f"{name} has no process to kill"
    killed = time.perf_counter()
    os.kill(old, signal.SIGKILL)
    while not ((lane := lane_of(client, name)).pid not in (None, old) and lane.state == "up"):
        time.sleep(0.01)
    return time.perf_counter() - killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lanes", default="verify,draft")
    parser.add_argument("--set", action="append", default=[], metavar="K=V")
    args = parser.parse_args()
    lanes = args.lanes.split(",")
    times: dict[str, list[float]] = {name: [] for name in lanes}
    with running_pipeline(args.set) as config, Client(config.addresses.client, timeout=60.0) as client:
        for _ in range(args.rounds):
            for name in lanes:
                time.sleep(1.5)
                times[name].append(back_after_kill(client, name))
    print(f"seconds from SIGKILL to up, round by round; load {load_note()}")
    for name, seconds in times.items():
        print(f"{name:<13}" + " ".join(f"{s:6.2f}" for s in seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

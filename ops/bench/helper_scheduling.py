"""What the helper processes' scheduling does to the pipeline, measured in one pipeline.

Two pipelines taking turns mislead on the 2-core VMs (where each process's memory lands moves its
speed as much as most changes), so this script starts one and changes the scheduling of every thread
of its helper processes from outside, between requests, in a rotating order: the same processes and
memory serve every mode. Modes: `normal` (SCHED_OTHER, nice 0, autogroup nice 0), `idle`
(SCHED_IDLE), `batch` (SCHED_BATCH), `agN` (the helpers' autogroup at nice N, 0-19; each lane is a
session of its own, so an autogroup of its own where the kernel groups by session). It prints each
mode's paired median against the first mode's, single-stream and at N clients, and the N-client
inter-token latency's p50 and p99 (docs/benchmarks.md, "Scheduling the helpers").

Putting a thread back from SCHED_IDLE needs CAP_SYS_NICE: run it as root where `idle` is a mode.

    .venv/bin/python ops/bench/helper_scheduling.py --modes normal,idle,ag10 --pairs 12 --rounds 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from pipeline.bench.common import (
    lane_pids,
    load_note,
    paired,
    running_pipeline,
    scheduler_note,
    settled_status,
    via_pipeline,
)
from pipeline.bench.pipeline_bench import drive_clients, inter_token_ms, load_prompts
from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.client import Client

TEXT = "Write a long story about a dragon who learns to bake bread."
POLICIES = {"normal": os.SCHED_OTHER, "batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}


def apply(pids: list[int], mode: str) -> None:
    """Every thread of `pids` under `mode`; an autogroup's nice is the session's, so once a process."""
    nice = int(mode[2:]) if mode.startswith("ag") else 0
    policy = POLICIES.get(mode, os.SCHED_OTHER)
    for pid in pids:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
    time.sleep(0.11)  # the kernel takes one autogroup change in 100 ms from an unprivileged writer


def report(rates: dict[str, list[float]], label: str) -> None:
    """Each mode against the first: the median of each round's ratio (`common.paired`), and how many
    rounds it won."""
    first, *others = rates
    medians = ", ".join(f"{mode} {statistics.median(found):.1f}" for mode, found in rates.items())
    for mode in others:
        wins = sum(b > a for a, b in zip(rates[first], rates[mode], strict=True))
        ratio = paired(rates[mode], rates[first], float)
        print(f"{label}: {mode} against {first}: paired median {ratio:.3f} "
              f"({wins} of {len(rates[mode])} won); medians {medians} tok/s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="normal,idle,ag10", help="comma list; the first is the reference")
    parser.add_argument("--helpers", default="orchestrator,audit", help="the processes it changes")
    parser.add_argument("--pairs", type=int, default=12, help="single-stream requests per mode")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of N clients per mode")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--drafter", default="none")
    args = parser.parse_args()
    modes, helpers = args.modes.split(","), args.helpers.split(",")
    print(f"load={load_note()} scheduler={scheduler_note()} helpers={','.join(helpers)}", flush=True)
    with running_pipeline([]) as config, Client(config.addresses.client, timeout=60) as client:
        via_pipeline(client, "Hello.", SamplingParams(max_tokens=16, ignore_eos=True), args.drafter)
        pids = [lane_pids(settled_status(client, config))[name] for name in helpers]
        order = lambda i: modes[i % len(modes) :] + modes[: i % len(modes)]  # noqa: E731
        try:
            rates: dict[str, list[float]] = {m: [] for m in modes}
            params = SamplingParams(max_tokens=256, ignore_eos=True)
            for i in range(args.pairs):
                for mode in order(i):
                    apply(pids, mode)
                    rates[mode].append(via_pipeline(client, TEXT, params, args.drafter)["tokens_per_second"])
            if args.pairs:
                report(rates, "single stream")
            prompts, params = load_prompts(args.clients), SamplingParams(max_tokens=80, ignore_eos=True)
            rates, gaps = {m: [] for m in modes}, {m: [] for m in modes}
            for i in range(args.rounds):
                for mode in order(i):
                    apply(pids, mode)
                    address = config.addresses.client
                    outs, wall = drive_clients(address, prompts, args.clients, params, args.drafter)
                    rates[mode].append(sum(len(o["tokens"]) for o in outs) / wall)
                    gaps[mode] += [g for o in outs for g in o["gaps"]]
            if args.rounds:
                report(rates, f"{args.clients} clients")
                for mode, found in gaps.items():
                    itl = inter_token_ms(found)  # as `bench pipeline` reports it
                    print(f"  ITL {mode}: p50 {itl['p50']:.1f} ms, p99 {itl['p99']:.1f} ms")
        finally:
            apply(pids, "normal")
    print(f"load after: {load_note()}")


if __name__ == "__main__":
    main()

"""What a core of their own would do for the helper processes: where a single stream's gap comes from.

On the 2-core VMs the verify lane's forward uses both cores, and the other processes (orchestrator,
audit lane, draft lane, supervisor) and the client take their CPU from it. Here the forward runs on
one thread (OMP_NUM_THREADS=1, in process and in the verify lane) pinned to the first CPU, and each
round decodes one plain greedy request in process, then through the pipeline's socket with every
thread of the helpers and of this client either on that same CPU (`shared`: the 2-core case in
miniature) or on the second one (`spare`: a machine with a core left over for them). One pipeline
serves both layouts, re-pinned between requests in a rotating order. It prints each layout's median
ratio to in-process (docs/benchmarks.md, "A core for the helpers").

    .venv/bin/python ops/bench/helper_core.py --rounds 12
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

TEXT = "Write a long story about a dragon who learns to bake bread."
LAYOUTS = ("shared", "spare")


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of every process in `pids` onto `cpus` (a thread made later inherits its maker's)."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:  # a process that has ended (a lane the supervisor is restarting)
            continue
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
                os.sched_setaffinity(int(tid), cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds of both layouts")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens a request (EOS ignored)")
    args = parser.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":  # OpenMP reads it once, as its library loads
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "OMP_NUM_THREADS": "1"})
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("helper_core.py needs two CPUs: one for the forward, one for the helpers")

    from pipeline.bench.common import (
        chat_prompt,
        lane_pids,
        load_note,
        machine_header,
        render_header,
        running_pipeline,
        via_pipeline,
    )
    from pipeline.bench.pipeline_bench import in_process
    from pipeline.decoding.drafters.registry import make_draft_source
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.model import load_model
    from pipeline.model.default import model_path
    from pipeline.protocol.client import Client
    from pipeline.service.run_dir import running_supervisor

    forward_cpu, other_cpu = {cpus[0]}, {cpus[1]}
    model = load_model(model_path(""), "auto")
    print(render_header(machine_header(model)), f"forward threads=1 on cpu {cpus[0]}", flush=True)
    source, prompt = make_draft_source("none", model, None, None), chat_prompt(model, TEXT)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    me = [os.getpid()]
    with running_pipeline([]) as config, Client(config.addresses.client, timeout=60) as client:
        via_pipeline(client, "Hello.", SamplingParams(max_tokens=16, ignore_eos=True), "none")
        lanes = lane_pids(client.status())
        helpers = [pid for name, pid in lanes.items() if name != "verify"]
        helpers.append(running_supervisor(Path(config.run.dir)))
        pin([lanes["verify"]], forward_cpu)
        ratios: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        try:
            for i in range(args.rounds):
                for layout in LAYOUTS if i % 2 == 0 else LAYOUTS[::-1]:
                    pin(me, forward_cpu)
                    time.sleep(0.2)
                    local = in_process(model, prompt, params, source, "none")
                    pin([*helpers, *me], forward_cpu if layout == "shared" else other_cpu)
                    time.sleep(0.2)
                    piped = via_pipeline(client, TEXT, params, "none")
                    assert piped["tokens"] == local["tokens"], "the pipeline's output differs from in-process"
                    here, there = local["tokens_per_second"], piped["tokens_per_second"]
                    ratios[layout].append(there / here)
                    print(f"round {i + 1} {layout}: in-process {here:.1f} tok/s, pipeline {there:.1f} "
                          f"({there / here:.3f})", flush=True)  # fmt: skip
        finally:
            pin([*helpers, *me, lanes["verify"]], set(cpus))
    wins = sum(b > a for a, b in zip(ratios["shared"], ratios["spare"], strict=True))
    for layout, found in ratios.items():
        print(f"{layout}: pipeline / in-process, median of {len(found)}: {statistics.median(found):.3f}")
    print(f"spare beat shared in {wins} of {args.rounds} rounds; load after: {load_note()}")


if __name__ == "__main__":
    main()

"""CPU milliseconds per token of every pipeline process, on a long plain greedy stream.

Why CPU per token and not only tokens/s: on a 2-core machine every millisecond the orchestrator,
the audit lane or the client spends comes out of the verify lane's 2-thread forward, and that cost
can be counted per process however busy the machine is (other work only slows the wall clock).
tokens/s is printed too, with the machine's load beside it, but it is only comparable between
runs on a quiet machine.

It starts a private pipeline (`running_pipeline`: a temporary run directory, no gateway), warms it
with one short request, then streams `--tokens` greedy tokens with drafter `none` and EOS ignored,
`--repeats` times (`--clients N`: N streams at once, each its own prompt and client), reading each
process's utime + stime from /proc before and after each round (the supervisor, the four lanes,
this process as the client, and the machine's other work).
Heartbeats, ticks and polls cost CPU by the second whether tokens flow or not, so on a busy machine
(fewer tokens a second) the gross figure grows; `net` first measures each process idle for
`--idle-seconds` and takes that rate times the stream's duration off, leaving what the tokens cost.
Beside the CPU, each process's wake-ups a token (`wakeups`). `--http PORT` streams through the HTTP
gateway instead (chat completions as Server-Sent Events, read with httpx; the gateway serves on PORT
and its CPU is counted too). Run from the repository's root:

    .venv/bin/python ops/bench/lane_cpu.py [--tokens 1000] [--repeats 3] [--clients 1] [--http PORT]
        [--set K=V] [--json]

To compare two commits side by side, run the script of each from its own worktree, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.bench.common import (
    WORKLOADS,
    cpu_snapshot,
    lane_pids,
    load_note,
    running_pipeline,
    via_pipeline,
)
from pipeline.bench.pipeline_bench import LOAD_PROMPTS
from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.client import Client

PROCESSES = ("verify", "orchestrator", "gateway", "audit", "draft", "supervisor", "clients", "others")


def parent_pid(pid: int) -> int:
    """The supervisor is every lane's parent."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def wakeups(pids: dict[str, int]) -> dict[str, int]:
    """Times each process's main thread went to sleep and was woken (voluntary context switches),
    and this process's threads (the clients, which stream from threads of their own). Why count them:
    on these VMs a wake-up of a sleeping event loop costs about 0.5 ms of CPU before it does anything
    (`wake_cost.py`), so a helper's CPU is mostly its wake-ups times that, whatever it then does."""
    counts = {}
    for name, pid in pids.items():
        status = Path(f"/proc/{pid}/status").read_text()
        counts[name] = int(status.partition("\nvoluntary_ctxt_switches:")[2].split()[0])
    counts["clients"] = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw  # every thread, ended ones too
    return counts


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds of each process between two snapshots, and of the machine's other work."""
    used = {name: after[name] - before[name] for name in after}
    ours = sum(v for k, v in used.items() if k != "machine")
    used["others"] = max(0.0, used.pop("machine") - ours)
    return used


def idle_rates(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """CPU seconds per second of each process with no request running."""
    if seconds <= 0:
        return {}
    before = cpu_snapshot(pids)
    time.sleep(seconds)
    return {name: used / seconds for name, used in spent(before, cpu_snapshot(pids)).items()}


def via_http(port: int, text: str, tokens: int) -> list[str]:
    """One chat completion streamed through the gateway: the text of each token's event, in order
    (the gateway sends no ids; the text stands for them in the repeats' comparison)."""
    body = {
        "messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0,
        "stream": True, "ignore_eos": True, "speculation": {"drafter": "none"},
    }  # fmt: skip
    pieces = []
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with httpx.Client(timeout=120.0) as http, http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    pieces.append(choice.get("delta", {}).get("content") or "")
    return ["".join(pieces)]


def streams(address: str, texts: list[str], tokens: int, http: int = 0) -> tuple[list[list], float]:
    """One stream per text, all at once (a client each); their tokens and the wall time of all."""
    params, outputs = SamplingParams(max_tokens=tokens, ignore_eos=True), [[] for _ in texts]

    def work(index: int) -> None:
        if http:
            outputs[index] = via_http(http, texts[index], tokens)
            return
        with Client(address, timeout=120.0) as client:
            outputs[index] = via_pipeline(client, texts[index], params, "none")["tokens"]

    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outputs, time.perf_counter() - start


def one_stream(
    address: str, pids: dict[str, int], texts: list[str], tokens: int, idle: dict[str, float], http: int = 0
) -> dict:
    """Streams at once (one, or a client each); CPU ms per token of each process (gross, and net of its
    idle rate), and tok/s with the load it ran under."""
    before, woken = cpu_snapshot(pids), wakeups(pids)
    outputs, seconds = streams(address, texts, tokens, http)
    used, count = spent(before, cpu_snapshot(pids)), tokens * len(texts) if http else sum(map(len, outputs))
    woken = {name: n - woken[name] for name, n in wakeups(pids).items()}
    net = {k: max(0.0, v - idle.get(k, 0.0) * seconds) for k, v in used.items() if k != "others"}
    return {
        "tokens": count, "seconds": seconds, "tokens_per_second": count / seconds, "load": load_note(),
        "cpu_ms_per_token": {k: 1000.0 * v / count for k, v in used.items()},
        "net_cpu_ms_per_token": {k: 1000.0 * v / count for k, v in net.items()}, "output": outputs,
        "wakeups_per_token": {k: v / count for k, v in woken.items()},
    }  # fmt: skip


def render(runs: list[dict], idle: dict[str, float]) -> str:
    lines = ["cpu ms/token: " + " ".join(f"{p:>12}" for p in PROCESSES) + "   tok/s  load 1/5/15"]
    for run in runs:
        cells = " ".join(f"{run['cpu_ms_per_token'].get(p, 0.0):12.3f}" for p in PROCESSES)
        lines.append(f"{run['tokens']:>6} tokens: {cells}  {run['tokens_per_second']:6.1f}  {run['load']}")
    for key, name in (("cpu_ms_per_token", "median"), ("net_cpu_ms_per_token", "median net")):
        medians = {p: statistics.median(r[key].get(p, 0.0) for r in runs) for p in PROCESSES}
        rate = statistics.median(r["tokens_per_second"] for r in runs)
        cells = " ".join(f"{medians[p]:12.3f}" for p in PROCESSES)
        lines.append(f"{name:>13}: {cells}  {rate:6.1f}")
    counted = runs[0]["wakeups_per_token"]  # the lanes, the supervisor and the clients: no `others`
    woken = {p: statistics.median(r["wakeups_per_token"][p] for r in runs) for p in counted}
    cells = " ".join(f"{woken[p]:12.3f}" if p in woken else f"{'':12}" for p in PROCESSES)
    lines.append(f"{'wakeups/token':>13}: {cells}")
    cells = " ".join(f"{1000.0 * idle.get(p, 0.0):12.3f}" for p in PROCESSES)
    lines.append(f"{'idle ms/s':>13}: {cells}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="new tokens per stream (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=3, help="streams, each measured on its own")
    parser.add_argument("--workload", default="chat", choices=sorted(WORKLOADS))
    parser.add_argument("--clients", type=int, default=1, help="concurrent streams (distinct prompts)")
    parser.add_argument("--idle-seconds", type=float, default=3.0, help="idle CPU measured first (0: none)")
    parser.add_argument("--http", type=int, default=0, metavar="PORT", help="through the gateway on PORT")
    parser.add_argument("--set", action="append", default=[], help="SECTION.KEY=VALUE for the pipeline")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    runs = []
    texts = [WORKLOADS[args.workload], *LOAD_PROMPTS][: args.clients]
    settings = [*args.set, "gateway.enabled=true", f"gateway.port={args.http}"] if args.http else args.set
    with running_pipeline(settings) as config, Client(config.addresses.client, timeout=60.0) as client:
        via_pipeline(client, "Hello.", SamplingParams(max_tokens=16, ignore_eos=True), "none")  # warm
        pids = lane_pids(client.status())
        pids["supervisor"] = parent_pid(pids["orchestrator"])
        time.sleep(0.5)  # the warm-up's tail (audit acks, heartbeats) settles
        idle = idle_rates(pids, args.idle_seconds)
        for _ in range(args.repeats):
            time.sleep(0.2)
            runs.append(one_stream(config.addresses.client, pids, texts, args.tokens, idle, args.http))
    outputs = {tuple(map(tuple, r.pop("output"))) for r in runs}  # each repeat's, all clients'

    if args.json:
        print(json.dumps({"runs": runs, "idle": idle, "identical": len(outputs) == 1, "root": os.getcwd()}))
    else:
        print(render(runs, idle))
        print(f"outputs identical across repeats: {len(outputs) == 1}")
    return 0 if len(outputs) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())

"""How much of the pipeline's gap to its engine the per-step record keeping can explain: a bound.

Issue 25 asks for a single stream at 0.95x of in-process and 8 clients at 0.9 of the model's ceiling.
Every decided step costs the pipeline's processes some record keeping: its journal row, its audit
event (outbox row, the audit lane's row), two step metrics and its entry in the verify lane's run
span. This script measures the pipeline with all of that left out, which the guarantees forbid, so
whatever batching or trimming that work could win is at most what it shows.

It checks out HEAD into a temporary git worktree, applies `per_step_bound.patch` there (which adds a
switch that leaves the record keeping out while a file says "lean") and runs itself inside it with
that tree first on PYTHONPATH, so one pipeline serves both modes and the mode changes between
requests, in a rotating order:

- single stream: each round decodes the request in process, then through the pipeline in each mode;
  each mode's median ratio to in-process (`--gateway`: through the HTTP gateway instead, SSE);
- N clients: each round runs the 8 load prompts from one client and from N, in each mode; each mode's
  median scaling (N clients over one) against `bench pipeline`'s ceiling, measured here before and after.

    .venv/bin/python ops/bench/per_step_bound.py --rounds 12 --load-rounds 8
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PATCH = Path(__file__).with_suffix(".patch")
MODES = ("normal", "lean")
TEXT = "Write a long story about a dragon who learns to bake bread."
PORT = 18777


@contextlib.contextmanager
def patched_worktree() -> Iterator[Path]:
    """HEAD with the patch applied, in a temporary directory, removed on the way out."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    with tempfile.TemporaryDirectory(prefix="speclanes-bound-") as parent:
        where = Path(parent) / "tree"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(where), "HEAD"], check=True
        )
        try:
            subprocess.run(["git", "-C", str(where), "apply", str(PATCH)], check=True)
            yield where
        finally:
            remove = ["git", "-C", str(root), "worktree", "remove", "--force", str(where)]
            subprocess.run(remove, check=False)


def rounds_of(count: int, measure: Callable[[str], float], before: Callable[[], None] = lambda: None) -> dict:
    """`count` rounds of every mode, the order reversed every other round; `measure(mode)` after the
    mode file says it (each process reads it at most every 50 ms)."""
    found: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(count):
        before()
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            Path(os.environ["BOUND_MODE_FILE"]).write_text(mode)
            time.sleep(0.15)
            found[mode].append(measure(mode))
        print(f"round {i + 1}:", {m: round(v[-1], 3) for m, v in found.items()}, flush=True)
    return found


def measure(args: argparse.Namespace) -> None:
    """Inside the patched tree: the two parts, and their medians."""
    import httpx

    from pipeline.bench.common import (
        chat_prompt,
        machine_header,
        render_header,
        running_pipeline,
        via_pipeline,
    )
    from pipeline.bench.http_peers import gateway_settings
    from pipeline.bench.pipeline_bench import batch_ceiling, drive_clients, load_prompts, via_gateway
    from pipeline.decoding.drafters.registry import make_draft_source
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.speculative import decode
    from pipeline.model import load_model
    from pipeline.model.default import model_path
    from pipeline.protocol.client import Client

    settings = gateway_settings(PORT) if args.gateway else []
    params, warm = SamplingParams(max_tokens=args.tokens, ignore_eos=True), SamplingParams(max_tokens=4)
    with (
        running_pipeline(settings) as config,
        Client(config.addresses.client, timeout=60) as client,
        httpx.Client(timeout=60) as http,
    ):
        model = load_model(model_path(config.model.path), config.model.backend)
        print(render_header(machine_header(model)), flush=True)
        prompt, source = chat_prompt(model, TEXT), make_draft_source("none", model, None, None)
        here: list[float] = []

        def in_process() -> None:
            start = time.perf_counter()
            decode(model, prompt, params, source, k=0)
            here.append(args.tokens / (time.perf_counter() - start))

        def piped(mode: str) -> float:
            via_pipeline(client, "Hi.", warm, "none")  # the mode's first request is not the timed one
            if args.gateway:
                got = via_gateway(http, f"http://127.0.0.1:{PORT}", TEXT, params, "none")
            else:
                got = via_pipeline(client, TEXT, params, "none")
            return got["tokens_per_second"] / here[-1]

        in_process()
        piped("normal")
        path = "gateway" if args.gateway else "socket"
        single = rounds_of(args.rounds, piped, in_process)
        prompts, load = load_prompts(args.clients), SamplingParams(max_tokens=80, ignore_eos=True)
        ceilings = [batch_ceiling(model, prompts, 80)["ceiling_with_prefill"]]

        def scaling(mode: str) -> float:
            rates = []
            for n in (1, args.clients):
                outputs, wall = drive_clients(config.addresses.client, prompts, n, load, "none")
                rates.append(sum(len(o["tokens"]) for o in outputs) / wall)
            return rates[1] / rates[0]

        scaled = rounds_of(args.load_rounds, scaling)
        ceilings.append(batch_ceiling(model, prompts, 80)["ceiling_with_prefill"])
    ceiling = statistics.mean(ceilings)
    print(f"single stream through the {path}, median ratio to in-process over {args.rounds} rounds:")
    print("  " + ", ".join(f"{m} {statistics.median(v):.3f}" for m, v in single.items()))
    print(f"{args.clients} clients, median scaling over {args.load_rounds} rounds, against a ceiling of "
          f"{ceiling:.2f} ({' and '.join(f'{c:.2f}' for c in ceilings)}):")  # fmt: skip
    print("  " + ", ".join(f"{m} {statistics.median(v):.2f} ({statistics.median(v) / ceiling:.3f} of it)"
                           for m, v in scaled.items()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="single-stream rounds")
    parser.add_argument("--load-rounds", type=int, default=8, help="N-client rounds")
    parser.add_argument("--tokens", type=int, default=256, help="single-stream tokens (EOS ignored)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--gateway", action="store_true", help="single streams through the HTTP gateway")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # run in the patched tree
    args = parser.parse_args()
    if args.inside:
        measure(args)
        return
    with patched_worktree() as tree, tempfile.NamedTemporaryFile("w", suffix=".mode") as mode:
        env = {**os.environ, "PYTHONPATH": str(tree), "BOUND_MODE_FILE": mode.name}
        command = [sys.executable, str(tree / "ops/bench/per_step_bound.py"), "--inside", *sys.argv[1:]]
        sys.exit(subprocess.run(command, cwd=tree, env=env, check=False).returncode)


if __name__ == "__main__":
    main()

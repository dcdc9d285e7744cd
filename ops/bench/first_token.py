"""What a request's first token costs through the pipeline, beside the same prompt's prefill in-process.

`bench pipeline` times a request from submit to result, so every fixed cost of a request (admission,
the prompt's prefill, the first token's trip back) counts against the pipeline's ratio. This splits
that cost for each workload's chat prompt, each request 4 tokens long, greedy:

- in-process prefill: the prompt's forward in this process, as `generate --json` reports it;
- submit: the client's Submit until its `Submitted` reply (tokenizing, admission, the journal);
- first chunk: the Submit until the first token reaches the client;
- prefill (pipeline): admission to the first token, as the orchestrator reports it.

It starts a private pipeline (`running_pipeline`: a temporary run directory, no gateway), and the
two sides take turns, each request after a pause of 0.1 s; the first round is left out (warm-up).
Medians in milliseconds, with the machine's load. Run from the repository's root:

    .venv/bin/python ops/bench/first_token.py [--repeats 8] [--set K=V]

To compare two commits, run the script of each from its own worktree, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.bench.common import WORKLOADS, chat_prompt, load_note, running_pipeline
from pipeline.decoding.drafters import NoDraftSource
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import load_model
from pipeline.model.default import model_path
from pipeline.protocol.client import Client
from pipeline.protocol.messages import Chunk, Result

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
COLUMNS = ("in-process prefill", "submit", "first chunk", "prefill (pipeline)")


def through_pipeline(client: Client, text: str) -> tuple[float, float, float]:
    """Seconds to the Submitted reply, to the first token, and the orchestrator's own prefill figure."""
    start = time.perf_counter()
    request_id = client.submit(text, chat=True, params=PARAMS, drafter="none").request_id
    submitted, first, done = time.perf_counter() - start, None, None
    for done in client.chunks(request_id):
        if first is None and isinstance(done, Chunk) and done.tokens:
            first = time.perf_counter() - start
    assert isinstance(done, Result) and done.error is None and first is not None
    return submitted, first, done.stats.prefill_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], metavar="K=V")
    args = parser.parse_args()
    model = load_model(model_path(None), "auto")
    rows: dict[str, list[tuple[float, ...]]] = {w: [] for w in WORKLOADS}
    with running_pipeline(args.set) as config, Client(config.addresses.client, timeout=60.0) as client:
        for _ in range(args.repeats + 1):
            for workload, text in WORKLOADS.items():
                time.sleep(0.1)
                here = decode(model, chat_prompt(model, text), PARAMS, NoDraftSource(), k=0)
                time.sleep(0.1)
                rows[workload].append((here.stats.prefill_seconds, *through_pipeline(client, text)))
    print(f"ms, medians of {args.repeats} (after one warm-up round); {load_note()}")
    print(f"{'workload':<9}" + "".join(f"{c:>20}" for c in COLUMNS))
    for workload, runs in rows.items():
        medians = [1000 * statistics.median(run[i] for run in runs[1:]) for i in range(len(COLUMNS))]
        print(f"{workload:<9}" + "".join(f"{m:>20.1f}" for m in medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How much any token tree could gain over a chain on a workload's greedy answer: an upper bound.

A tree keeps at most what the best of its candidate continuations keeps, so a clairvoyant that
verifies, at every step, exactly the tokens the best candidate would keep (no wasted rows, no
hedging) is faster than any tree the drafter can build from those candidates. This walks the
greedy answer step by step three ways, each verifying exactly what it keeps (at most `--depth`):

- `chain`: the drafter's own chain (`propose(..., tree=False)`), as the `/linear` rows draft;
- `tree`: the best path of the drafter's tree over all its candidates (`--nodes`, no floor);
- `any pair`: every token whose pair (previous token, token) occurs in the context: no n-gram or
  suffix candidate (the cross-request cache is empty, as in `bench speculative`) holds more.

Each walk's cost is its verify forwards on the runtime's calibrated t(rows) curve plus the measured
prefill; the bound is the chain walk's cost over the other's. Run from the repository's root:

    .venv/bin/python ops/bench/tree_bound.py --workload code --drafters ngram,suffix,auto
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.bench.common import WORKLOADS
from pipeline.decoding.adaptive import RowCosts
from pipeline.decoding.drafters import Proposal
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Runtime, default_model_path, load_model
from pipeline.model.calibration import row_seconds
from pipeline.model.cpu import cpu_name, kernel_flags


def kept(proposal: Proposal, truth: Sequence[int]) -> int:
    """How many of `truth`'s tokens the proposal's best path (chain or tree) holds in a row."""
    parents = proposal.parents if proposal.parents is not None else list(range(-1, len(proposal.tokens) - 1))
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    node, depth = -1, 0
    while depth < len(truth):
        node = next((c for c in children.get(node, []) if proposal.tokens[c] == truth[depth]), -2)
        if node == -2:
            break
        depth += 1
    return depth


def any_pair(context: Sequence[int], truth: Sequence[int]) -> int:
    """The most of `truth` an n-gram or suffix candidate could hold: every such candidate token
    followed its predecessor somewhere in `context` (an n-gram match ends in a 1-gram match, and
    a suffix-table walk may splice occurrences but steps only along pairs it has seen), so this
    counts the tokens in a row whose pair (previous token, token) occurs in `context`."""
    pairs = set(itertools.pairwise(context))
    run, previous = 0, context[-1]
    while run < len(truth) and (previous, truth[run]) in pairs:
        previous, run = truth[run], run + 1
    return run


def walk(prompt: list[int], answer: list[int], keeps: Callable[[list[int], list[int]], int], depth: int):
    """(steps, verify rows per step) of a clairvoyant that verifies exactly what `keeps` keeps."""
    full, at, rows = prompt + answer, len(prompt) + 1, []  # the prefill emitted the first token
    while at < len(full):
        n = min(depth, keeps(full[:at], full[at : at + depth]))
        rows.append(1 + n)
        at += n + 1
    return len(rows), rows


def drafted(
    model: Runtime, name: str, prompt: list[int], params: SamplingParams, tree: bool, size: int
) -> Callable[[list[int], list[int]], int]:
    """What a fresh request's drafter `name` keeps at each step, told the context as it grows."""
    drafter = make_draft_source(name, model).start(prompt, params, 0)

    def keeps(context: list[int], truth: list[int]) -> int:
        drafter.accept(context)
        return kept(drafter.propose(context, size, tree), truth)

    return keeps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="code", choices=sorted(WORKLOADS))
    parser.add_argument("--drafters", default="ngram,suffix,auto")
    parser.add_argument("--depth", type=int, default=16, help="most draft tokens a step keeps")
    parser.add_argument("--nodes", type=int, default=64, help="the tree's node budget")
    args = parser.parse_args()

    model = load_model(default_model_path(), "native")
    assert model.tokenizer is not None
    prompt = model.tokenizer.encode(
        model.tokenizer.render_chat([{"role": "user", "content": WORKLOADS[args.workload]}])
    )
    params = SamplingParams(max_tokens=128)
    prefills = []
    for _ in range(5):
        t0 = time.perf_counter()
        model.forward(model.new_cache(capacity=len(prompt) + 1), prompt, all_logits=False)
        prefills.append(time.perf_counter() - t0)
    prefill = statistics.median(prefills)
    answer = decode(model, prompt, params, make_draft_source("none", model)).tokens
    costs = RowCosts()  # the calibrated curve, read as the controller reads it
    costs.calibrate(row_seconds(model))
    one = costs.seconds[1]

    def cost(rows: list[int]) -> float:
        return prefill + one * sum(costs.ratio(r) for r in rows)

    print(f"{args.workload}: {len(answer)} answer tokens, CPU {cpu_name()} ({', '.join(kernel_flags())}),")
    print(f"prefill {prefill * 1e3:.1f} ms, t(1) {one * 1e3:.2f} ms,", end=" ")
    print(f"depth {args.depth}, tree {args.nodes} nodes")
    print(f"{'drafter':8} {'walk':10} {'steps':>5} {'ms':>7} {'chain / this':>12}")
    for name in args.drafters.split(","):
        walks = {
            "chain": drafted(model, name, prompt, params, False, args.depth),
            "tree": drafted(model, name, prompt, params, True, args.nodes),
            "any pair": any_pair,
        }
        chain = 0.0
        for label, keeps in walks.items():
            steps, rows = walk(prompt, answer, keeps, args.depth)
            chain = chain or cost(rows)  # the chain walks first
            print(f"{name:8} {label:10} {steps:5d} {cost(rows) * 1e3:7.1f} {chain / cost(rows):11.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

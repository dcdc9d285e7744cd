"""What a draft head of this size can give greedy or seeded decoding on this machine: a measured bound.

From measured parts only, the best speed-up a chain of the head's drafts can reach, whatever
controller picks its length:
- a[d]: the share of positions whose first d drafts all match the target's greedy answer, on
  held-out prompts (`training.evaluate`, the head file run as the draft lane runs it, no MIN_PATH);
  with `--sampled`, its answers drawn at temperature 0.8 instead. Seeded decoding keeps a
  deterministic draft where it equals the token the target draws there, which happens with the
  target's probability of it, as often as it equals the token of an answer drawn alike: so a[d]
  measured on drawn answers is the seeded bound's, and the same formula gives it;
- h: the head's seconds per draft token, quiet, median of the same run;
- t(r)/t(1): the target's verify forward of r rows over one row (`model.calibration`).

A step of n drafts costs t(n + 1) + n h and yields 1 + a[1] + ... + a[n] tokens, against t(1) a token
for plain decoding. The bound leaves out every per-step cost outside the forward and the head
(the loop, the sampling, the bookkeeping), so real runs land below it. Beside it: the same with a
perfect head (a[d] = 1) of the same cost, the ceiling a better-trained head of this size can hope for.

    .venv/bin/python ops/bench/learned_bound.py [--model PATH] [--head PATH] [--prompts N] [--sampled]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.bench.common import load_note
from pipeline.decoding.adaptive import Controller
from pipeline.decoding.drafters import learned
from pipeline.model import default_model_path, load_model
from pipeline.model.calibration import row_seconds
from pipeline.model.cpu import cpu_name
from pipeline.model.draft_head import find_head, head_name, load_head, trained_heads_directory
from pipeline.training.distill import TEMPERATURE, greedy_answers, load_shards, sampled_answers
from pipeline.training.evaluate import acceptance_by_depth


def best(a: list[float], ratio: list[float], head: float) -> tuple[int, float]:
    """The chain length n (0: plain) with the most tokens per plain-step time, and that speed-up."""
    options = [(n, (1 + sum(a[:n])) / (ratio[n] + n * head)) for n in range(len(a) + 1)]
    return max(options, key=lambda o: o[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the target (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--head", help="the head (default: the one found for the model)")
    parser.add_argument("--prompts", type=int, default=60, help="held-out answers to measure on")
    parser.add_argument(
        "--sampled", action="store_true", help="on the held-out answers drawn at 0.8: the seeded bound"
    )
    parser.add_argument("--depth", type=int, default=6)
    args = parser.parse_args()
    model_path = Path(args.model) if args.model else default_model_path()
    model = load_model(model_path)
    head_path = Path(args.head) if args.head else find_head(model_path)
    assert head_path is not None, "no head: run speclanes drafter train"
    head = load_head(head_path, model.cfg, model.embed, model_path)
    work = trained_heads_directory() / (head_name(model_path).removesuffix(".npz") + ".work")
    answers = sampled_answers if args.sampled else greedy_answers
    held = answers(load_shards(work / "held-out"))[: args.prompts]
    learned.MIN_PATH = 0.0  # every depth drafted: the bound picks the length
    measured = acceptance_by_depth(head, held, k=args.depth, stride=5)
    costs = Controller().costs
    costs.calibrate(row_seconds(model))  # measured at some row counts, interpolated between them
    t1 = costs.seconds[1]
    ratio = [costs.ratio(n + 1) for n in range(args.depth + 1)]  # ratio[n]: t(n + 1) / t(1)
    h = measured["head_seconds_per_draft_token"] / t1
    a = measured["accepted_by_depth"]
    n, bound = best(a, ratio, h)
    n_perfect, perfect = best([1.0] * args.depth, ratio, h)
    print(json.dumps({
        "cpu": cpu_name(), "load": load_note(), "head": str(head_path), "answers": len(held),
        "drawn_at": TEMPERATURE if args.sampled else 0.0, "t1_ms": round(1e3 * t1, 3),
        "head_ms_per_draft": round(1e3 * measured["head_seconds_per_draft_token"], 3),
        "t(n+1)/t(1)": [round(r, 3) for r in ratio], "accepted_by_depth": a, "chains": measured["chains"],
        "bound": {"drafts": n, "speedup": round(bound, 3)},
        "perfect_head_same_cost": {"drafts": n_perfect, "speedup": round(perfect, 3)},
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

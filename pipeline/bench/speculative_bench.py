"""Every drafter against plain decoding on three workloads, side by side in one run.

Runs are interleaved (each repeat goes through every drafter in turn) so drift on a
shared machine hits all of them alike; figures are medians. Each run gets a fresh
draft source, so the cross-request cache starts empty: speed-ups here come from within
a request, and the check column says whether every output equals plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics

from pipeline.bench.common import WORKLOADS, result_decode_rate
from pipeline.bench.flags import add_backend_flag
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Runtime as Model
from pipeline.model import default_model_path, load_model


def run(model: Model, drafters: list[str], draft_model: Model | None, repeats: int, max_tokens: int) -> dict:
    assert model.tokenizer is not None
    params = SamplingParams(max_tokens=max_tokens)
    results: dict = {}
    for workload, text in WORKLOADS.items():
        prompt = model.tokenizer.encode(model.tokenizer.render_chat([{"role": "user", "content": text}]))
        runs: dict[str, list] = {d: [] for d in drafters}
        for _ in range(repeats):
            for name in drafters:
                source = make_draft_source(
                    name, model, draft_model or model if name == "model" else draft_model
                )
                runs[name].append(decode(model, prompt, params, source, k=0 if name == "none" else None))
        reference = runs["none"][0].tokens
        base = statistics.median(r.stats.tokens_per_second for r in runs["none"])
        base_decode = statistics.median(result_decode_rate(r) for r in runs["none"])
        results[workload] = {"prompt_tokens": len(prompt), "drafters": {}}
        for name, completions in runs.items():
            tps = statistics.median(r.stats.tokens_per_second for r in completions)
            last = completions[-1].stats
            results[workload]["drafters"][name] = {
                "tokens": len(completions[-1].tokens),
                "tokens_per_second": tps,
                "speedup": tps / base,
                "decode_speedup": statistics.median(result_decode_rate(r) for r in completions) / base_decode,
                "acceptance_rate": last["acceptance_rate"],
                "mean_accepted_length": last["mean_accepted_length"],
                "identical_to_none": all(r.tokens == reference for r in completions),
            }
    return results


def render(results: dict) -> str:
    lines = [
        f"{'workload':<8} {'drafter':<8} {'tokens':>6} {'tok/s':>7} {'speed-up':>8} {'accept':>7} "
        f"{'mean len':>8} {'decode':>7}  same as none",
    ]
    for workload, data in results.items():
        for name, r in data["drafters"].items():
            lines.append(
                f"{workload:<8} {name:<8} {r['tokens']:>6} {r['tokens_per_second']:>7.1f} "
                f"{r['speedup']:>7.2f}x "
                f"{r['acceptance_rate']:>7.2f} {r['mean_accepted_length']:>8.2f} {r['decode_speedup']:>6.2f}x"
                f"  {r['identical_to_none']}"
            )
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`speclanes bench speculative` and its flags."""
    parser = sub.add_parser("speculative", help="every drafter vs plain decoding on three workloads")
    parser.add_argument("--model", metavar="PATH")
    add_backend_flag(parser)
    parser.add_argument("--draft-model", metavar="PATH", help="for the model drafter (default: the target)")
    parser.add_argument("--drafters", default="none,ngram,suffix,auto,model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    model = load_model(args.model or default_model_path(), args.backend)
    draft_model = load_model(args.draft_model, args.backend) if args.draft_model else None
    results = run(model, args.drafters.split(","), draft_model, args.repeats, args.max_tokens)
    print(json.dumps(results, indent=2) if args.json else render(results))
    identical = all(r["identical_to_none"] for w in results.values() for r in w["drafters"].values())
    return 0 if identical else 1

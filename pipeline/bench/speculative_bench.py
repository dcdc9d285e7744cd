"""Every drafter against plain decoding on three workloads, side by side in one run.

Runs are interleaved (each repeat goes through every drafter in turn) so drift on a
shared machine hits all of them alike; figures are medians. Each run gets a fresh
draft source, so the cross-request cache starts empty: speed-ups here come from within
a request, and the check column says whether every output equals plain decoding's.

With `--temperature T --seed S` the runs sample: every deterministic drafter (and `auto` without
a draft model) must then give exactly plain seeded decoding's tokens (position-keyed numbers,
`decoding/noise.py`); the model drafter follows the distribution but is not expected to match.
The header names the runtime, its kernel path and the CPU, as every benchmark's does.
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
from pipeline.model import backend_key, default_model_path, load_model
from pipeline.model.cpu import cpu_name, kernel_flags


def identity_expected(name: str, params: SamplingParams, draft_model: Model | None) -> bool:
    """Whether `name`'s output must equal plain decoding's token for token."""
    return params.greedy or name in ("none", "ngram", "suffix") or (name == "auto" and draft_model is None)


def run(
    model: Model, drafters: list[str], draft_model: Model | None, repeats: int, params: SamplingParams
) -> dict:
    assert model.tokenizer is not None
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
                "acceptance_rate": last.acceptance_rate,
                "mean_accepted_length": last.mean_accepted_length,
                "identical_to_none": all(r.tokens == reference for r in completions),
                "identity_expected": identity_expected(name, params, draft_model),
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
                f"  {r['identical_to_none'] if r['identity_expected'] else 'n/a (sampled drafts)'}"
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
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--seed", type=int, default=1234, help="for sampled runs (default 1234)")
    parser.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    model = load_model(args.model or default_model_path(), args.backend)
    draft_model = load_model(args.draft_model, args.backend) if args.draft_model else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    results = run(model, args.drafters.split(","), draft_model, args.repeats, params)
    header = {
        "runtime": backend_key(model), "kernel_path": model.describe(), "cpu": cpu_name(),
        "cpu_flags": kernel_flags(), "temperature": params.temperature, "seed": params.seed,
    }  # fmt: skip
    if args.json:
        print(json.dumps({"machine": header, "workloads": results}, indent=2))
    else:
        print(" ".join(f"{key}={value}" for key, value in header.items()))
        print(render(results))
    rows = [r for w in results.values() for r in w["drafters"].values() if r["identity_expected"]]
    return 0 if all(r["identical_to_none"] for r in rows) else 1

"""Every drafter against plain decoding on three workloads, side by side in one run.

Runs are interleaved (each repeat goes through every drafter in turn) so drift on a
shared machine hits all of them alike; tok/s are medians, and each speed-up is the median over
the repeats of that repeat's ratio (`paired`). Each run gets a fresh
draft source, so the cross-request cache starts empty: speed-ups here come from within
a request, and the check column says whether every output equals plain decoding's.

A drafter name with "/linear" (`ngram/linear`) drafts one chain a step instead of a token tree,
so trees and linear drafts are compared in the same run (`vs chain`: the tree rows' end-to-end
rate over their linear twin's); `nodes` is the draft nodes verified per step, `mean len` the tokens
emitted per step.

Two sections: greedy, then seeded sampling (`--temperature T --seed S`; `--temperature 0` leaves
it out). In the sampled one every deterministic drafter (and `auto` without a draft model) must
give exactly plain seeded decoding's tokens (position-keyed numbers, `decoding/noise.py`); the
model drafter follows the distribution but is not expected to match. The exit status is 1 if
any expected identity fails. The header names the runtime, its kernel path and the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics

from pipeline.bench.common import (
    WORKLOADS,
    machine_header,
    paired,
    render_header,
    result_decode_rate,
    workload_prompt,
)
from pipeline.bench.flags import add_backend_flag, add_common_flags
from pipeline.decoding.drafters.kinds import needs_draft_model, needs_head, parts, samples
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Runtime as Model
from pipeline.model import load_model
from pipeline.model.calibration import row_seconds
from pipeline.model.default import model_path
from pipeline.model.draft_head import DraftHead, head_for


def identity_expected(name: str, params: SamplingParams, draft_model: Model | None) -> bool:
    """Whether `name`'s output must equal plain decoding's token for token: under greedy, or when
    none of the drafters it runs samples (sampled drafts draw the target's tokens differently)."""
    drafting = parts(name.removesuffix("/linear"), draft_model=draft_model is not None, head=True)
    return params.greedy or not any(samples(d) for d in drafting)


def run_one(
    model: Model, prompt: list[int], params: SamplingParams, name: str, draft_model: Model | None,
    head: DraftHead | None = None,
):  # fmt: skip
    drafter, linear = name.removesuffix("/linear"), name.endswith("/linear")
    # A drafter that needs a draft model drafts with the target itself when none is given.
    source = make_draft_source(
        drafter, model, draft_model or model if needs_draft_model(drafter) else draft_model, head
    )
    return decode(model, prompt, params, source, k=0 if drafter == "none" else None, tree=not linear)


def end_to_end_rate(result: Result) -> float:
    return result.stats.tokens_per_second


def workloads(held_out: int) -> dict[str, str]:
    """The three workloads, plus `held_out` chat prompts whose subjects no draft head trained on
    (`training.prompts`: the chat workload's own subject is held out too). A base model gets each
    workload's completion form (`common.workload_prompt`), and no held-out prompts (they are chat)."""
    from pipeline.training.prompts import prompts

    test = prompts("test")
    picks = [test[(i * 7919) % len(test)] for i in range(held_out)]  # spread over the templates
    return {**WORKLOADS, **{f"held{i + 1}": text for i, text in enumerate(picks)}}


def run(
    model: Model, drafters: list[str], draft_model: Model | None, repeats: int, params: SamplingParams,
    head: DraftHead | None = None, held_out: int = 0,
) -> dict:  # fmt: skip
    assert model.tokenizer is not None
    results: dict = {}
    for workload, text in workloads(held_out if model.tokenizer.chat_template else 0).items():
        prompt = workload_prompt(model, workload, text)
        runs: dict[str, list] = {d: [] for d in drafters}
        for _ in range(repeats):
            for name in drafters:
                runs[name].append(run_one(model, prompt, params, name, draft_model, head))
        reference = runs["none"][0].tokens
        results[workload] = {"prompt_tokens": len(prompt), "drafters": {}}
        for name, completions in runs.items():
            last = completions[-1].stats
            linear = runs.get(f"{name}/linear")
            results[workload]["drafters"][name] = {
                "tokens": len(completions[-1].tokens),
                "tokens_per_second": statistics.median(r.stats.tokens_per_second for r in completions),
                "speedup": paired(completions, runs["none"], end_to_end_rate),
                "decode_speedup": paired(completions, runs["none"], result_decode_rate),
                "tree_vs_linear": None if linear is None else paired(completions, linear, end_to_end_rate),
                "acceptance_rate": last.acceptance_rate,
                "mean_accepted_length": last.mean_accepted_length,
                "nodes_per_step": last.nodes_per_step,
                "draft_ms_per_node": 1e3 * last.draft_seconds / max(last.drafted, 1),
                "per_depth_acceptance": last.per_position_acceptance,
                "identical_to_none": all(r.tokens == reference for r in completions),
                "identity_expected": identity_expected(name, params, draft_model),
            }
    return results


def vs_chain(row: dict) -> str:
    return "" if row.get("tree_vs_linear") is None else f"{row['tree_vs_linear']:.2f}x"


def render(results: dict) -> str:
    lines = [
        f"{'workload':<8} {'drafter':<13} {'tokens':>6} {'tok/s':>7} {'speed-up':>8} {'accept':>7} "
        f"{'mean len':>8} {'nodes':>6} {'ms/node':>7} {'decode':>7} {'vs chain':>8}  same as none",
    ]
    for workload, data in results.items():
        for name, r in data["drafters"].items():
            lines.append(
                f"{workload:<8} {name:<13} {r['tokens']:>6} {r['tokens_per_second']:>7.1f} "
                f"{r['speedup']:>7.2f}x {r['acceptance_rate']:>7.2f} {r['mean_accepted_length']:>8.2f} "
                f"{r['nodes_per_step']:>6.2f} {r['draft_ms_per_node']:>7.3f} {r['decode_speedup']:>6.2f}x "
                f"{vs_chain(r):>8}"
                f"  {r['identical_to_none'] if r['identity_expected'] else 'n/a (sampled drafts)'}"
            )
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`speclanes bench speculative` and its flags."""
    parser = sub.add_parser("speculative", help="every drafter vs plain decoding on three workloads")
    add_common_flags(parser, repeats=3)
    add_backend_flag(parser)
    parser.add_argument("--draft-model", metavar="PATH", help="for the model drafter (default: the target)")
    parser.add_argument(
        "--drafters",
        default="none,ngram,ngram/linear,suffix,suffix/linear,learned,auto,auto/linear,model",
        help="comma-separated; NAME/linear drafts one chain a step instead of a tree",
    )
    parser.add_argument(
        "--draft-head", metavar="PATH", help="for the learned drafter (default: the head found for the model)"
    )
    parser.add_argument(
        "--held-out", type=int, default=4, help="chat prompts on subjects no head trained on (default 4)"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per run")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="the seeded section's temperature (0: leave it out)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="the seeded section's seed (default 1234)")


def main(args: argparse.Namespace) -> int:
    model_file = model_path(args.model)
    model = load_model(model_file, args.backend)
    draft_model = load_model(args.draft_model, args.backend) if args.draft_model else None
    head = head_for(model_file, model.cfg, model.embed, args.draft_head)
    drafters = [d for d in args.drafters.split(",") if head or not needs_head(d.removesuffix("/linear"))]
    sections = {"greedy": SamplingParams(max_tokens=args.max_tokens)}
    if args.temperature > 0:
        sections["seeded"] = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
    curve = row_seconds(model)  # calibrated before any timed run, as a lane does at start
    header = machine_header(model, curve)
    header["draft_head"] = "none (learned left out)" if head is None else head.meta.get("made", "?")
    results = {name: run(model, drafters, draft_model, args.repeats, params, head, args.held_out)
               for name, params in sections.items()}  # fmt: skip
    if args.json:
        print(json.dumps({"machine": header, "sections": results}, indent=2))
    else:
        print(render_header(header))
        for name, params in sections.items():
            print(f"\n{name}: temperature={params.temperature} seed={params.seed}")
            print(render(results[name]))
    rows = [
        r
        for s in results.values()
        for w in s.values()
        for r in w["drafters"].values()
        if r["identity_expected"]
    ]
    return 0 if all(r["identical_to_none"] for r in rows) else 1

"""`speclanes drafter train`: distil a draft head for a model, on this machine.

Three resumable stages under a work directory: the target answers the training and held-out
prompts (`distill`), the head trains (`train`, from its checkpoint), and the head is written with
a record of its data, settings, steps, time and held-out acceptance (`evaluate`). Run it again
with the same arguments after an interruption and it goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipeline.training.settings import TrainSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    drafter = sub.add_parser("drafter", help="learned drafters: train a draft head for a model")
    drafter_sub = drafter.add_subparsers(dest="drafter_command", required=True)
    train = drafter_sub.add_parser("train", help="distil a draft head from the model's own answers")
    train.add_argument(
        "-m", "--model", metavar="PATH", help="the target GGUF (default: SmolLM2-135M-Instruct)"
    )
    train.add_argument(
        "--out", metavar="PATH",
        help="the head file (default: the cache's heads directory, where `learned` and `auto` find it)",
    )  # fmt: skip
    train.add_argument("--work", metavar="DIR", help="data and checkpoints (default: next to --out)")
    train.add_argument("--prompts", type=int, default=4096, help="training prompts answered (default 4096)")
    train.add_argument("--held-out", type=int, default=256, help="held-out prompts answered (default 256)")
    train.add_argument("--max-new", type=int, default=160, help="tokens per answer at most (default 160)")
    train.add_argument("--batch", type=int, default=24, help="answers decoded together (default 24)")
    train.add_argument("--samples", type=int, default=1,
                       help="answers per training prompt: the first greedy, the rest sampled "
                            "(default 1: every third prompt sampled)")  # fmt: skip
    train.add_argument("--data-backend", choices=("runtime", "torch"), default="runtime",
                       help="who answers: the served runtime (default), or the torch target, in batches of "
                            "--batch on a GPU where one is present")  # fmt: skip
    defaults = TrainSettings()
    train.add_argument("--epochs", type=int, default=defaults.epochs, help=f"(default {defaults.epochs})")
    train.add_argument("--vocab", type=int, default=defaults.vocab_size,
                       help=f"draft vocabulary size (default {defaults.vocab_size})")  # fmt: skip
    train.add_argument("--d-ff", type=int, default=defaults.d_ff, help="the head's feed-forward width")
    train.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate ({defaults.lr})")
    train.add_argument("--batch-rows", type=int, default=defaults.batch_rows,
                       help=f"positions per optimizer step (default {defaults.batch_rows})")  # fmt: skip
    train.add_argument("--seed", type=int, default=0, help="the prompts' order, sampling and initial weights")


def say(text: str) -> None:
    print(f"drafter train: {text}", file=sys.stderr, flush=True)


def data_answerers(args: argparse.Namespace, model_path: Path, eos: int | None) -> tuple[dict, dict]:
    """`distill`'s extra arguments for the training and the held-out data: none for the served
    runtime; with the torch target, its answerer and shards of one batch each."""
    if args.data_backend == "runtime":
        return {}, {}
    import torch

    from pipeline.model.store import load_prepared
    from pipeline.training.torch_target import TorchTarget, torch_answerer

    cfg, weights, _ = load_prepared(model_path)
    target = TorchTarget(cfg, weights, "cuda" if torch.cuda.is_available() else "cpu")
    say(f"data: answered by the torch target on {target.device}")
    common = {"max_new": args.max_new, "batch": args.batch, "eos": eos, "report": say}
    shard = max(1, args.batch // args.samples)
    return (
        {"answerer": torch_answerer(target, seed=args.seed, samples=args.samples, **common), "shard": shard},
        {"answerer": torch_answerer(target, seed=args.seed + 1, samples=1, **common), "shard": args.batch},
    )


def output_paths(args: argparse.Namespace, name: str, heads: Path) -> tuple[Path, Path]:
    """The head file (`--out`, else `name` in the heads directory, made) and the work directory
    (`--work`, else beside the head)."""
    out = Path(args.out) if args.out else heads / name
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, Path(args.work) if args.work else out.with_name(out.name.removesuffix(".npz") + ".work")


def main(args: argparse.Namespace) -> int:
    from pipeline.model import load_model
    from pipeline.model.default import model_path
    from pipeline.model.draft_head import (
        embedding_digest,
        head_name,
        load_head,
        output_rows,
        save_head,
        trained_heads_directory,
    )
    from pipeline.training.distill import distill, greedy_answers, load_shards
    from pipeline.training.evaluate import acceptance_by_depth
    from pipeline.training.prompts import prompts
    from pipeline.training.train import train

    if args.samples < 1:
        say(f"--samples must be at least 1, not {args.samples}")
        return 2
    model_path = model_path(args.model)
    out, work = output_paths(args, head_name(model_path), trained_heads_directory())
    start = time.perf_counter()
    model = load_model(model_path)
    assert model.tokenizer is not None
    say(f"target {model_path.name}: {model.describe()}")
    train_prompts, test_prompts = prompts("train", args.seed)[: args.prompts], prompts("test", args.seed)
    answerers = data_answerers(args, model_path, model.tokenizer.eos_id)
    data = distill(model, train_prompts, work / "train", max_new=args.max_new, batch=args.batch,
                   seed=args.seed, samples=args.samples, report=say, **answerers[0])  # fmt: skip
    distill(model, test_prompts[: args.held_out], work / "held-out", max_new=args.max_new, batch=args.batch,
            seed=args.seed + 1, report=say, **answerers[1])  # fmt: skip
    data_seconds = time.perf_counter() - start
    sequences, held_out = load_shards(work / "train"), load_shards(work / "held-out")
    settings = TrainSettings(
        epochs=args.epochs, vocab_size=args.vocab, d_ff=args.d_ff, lr=args.lr, seed=args.seed,
        batch_rows=args.batch_rows,
    )  # fmt: skip
    cfg, embed = model.cfg, model.embed

    def rows(ids):
        return output_rows(model_path, cfg, embed, ids)

    head, vocab, record = train(sequences, held_out, cfg, embed, rows, model.tokenizer.eos_id, work,
                                settings, report=say)  # fmt: skip
    meta = {
        "target": {"name": cfg.name, "file": model_path.name, "d_model": cfg.d_model,
                   "vocab_size": cfg.vocab_size, "embedding_sha256": embedding_digest(embed)},
        "data": {**data, "held_out_prompts": min(args.held_out, len(test_prompts)),
                 "prompt_set": "pipeline.training.prompts (generated; held out by subject)"},
        "training": record, "command": " ".join(["speclanes", *sys.argv[1:]]),
        "data_seconds": round(data_seconds, 1), "made": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    save_head(out, {**head.arrays(), "vocab": vocab}, meta)
    greedy = greedy_answers(held_out)
    meta["held_out_acceptance"] = acceptance_by_depth(load_head(out, cfg, embed, model_path), greedy)
    meta["total_seconds"] = round(time.perf_counter() - start, 1)
    save_head(out, {**head.arrays(), "vocab": vocab}, meta)
    say(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {meta['total_seconds']:.0f} s")
    print(json.dumps(meta["held_out_acceptance"] | {"head": str(out)}, indent=1))
    return 0

"""Distil and train draft heads on a machine with a GPU, for comparing head designs.

The same stages as `speclanes drafter train` (`pipeline.training`: the prompt set, the draft
vocabulary, the losses, the second-draft pass), with the data made by the torch target
(`pipeline.training.torch_target`) in large padded batches instead of the CPU runtime, so several
designs and much more data fit in minutes. Each variant's head is written as the arrays
`speclanes drafter train` saves, with its record; `ops/train/finish_head.py` turns one into a head
file and measures it on the CPU runtime's own held-out data.

Inputs: the GGUF (or its parts, concatenated in order) and the prompts already rendered and
tokenized (`ops/train/finish_head.py --prompts`), so the GPU machine needs no tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.model.gguf_file import read_gguf
from pipeline.training.distill import sampled
from pipeline.training.settings import TrainSettings
from pipeline.training.torch_target import TorchTarget, answer_all
from pipeline.training.train import train

VARIANTS = {"final": (), "taps": (2, 15)}  # residual taps after these layers, beside the final norm's output


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", required=True, help="the GGUF, or its parts in order")
    ap.add_argument("--prompts", required=True, help="npz of tokenized train/test prompts")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="final,taps")
    ap.add_argument(
        "--samples", type=int, default=2, help="answers per training prompt: 1 greedy + samples-1"
    )
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-rows", type=int, default=8192)
    ap.add_argument("--limit", type=int, default=0, help="train prompts used (0: all); for a smoke run")
    ap.add_argument("--work", default="/tmp/gpu_head_work", help="checkpoints (kept out of --out)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    machine = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    say(f"device {device}: {machine}, torch {torch.__version__}")
    model = Path("/tmp/target.gguf")
    with model.open("wb") as whole:
        for part in args.model:
            whole.write(Path(part).read_bytes())
    cfg, weights, _ = read_gguf(model)
    with np.load(args.prompts, allow_pickle=False) as z:
        flat, cuts, eos = z["train_tokens"], z["train_offsets"], int(z["eos"])
        train_prompts = [flat[cuts[i] : cuts[i + 1]].tolist() for i in range(len(cuts) - 1)]
        flat, cuts = z["test_tokens"], z["test_offsets"]
        test_prompts = [flat[cuts[i] : cuts[i + 1]].tolist() for i in range(len(cuts) - 1)]
    if args.limit:
        train_prompts, test_prompts = train_prompts[: args.limit], test_prompts[: max(8, args.limit // 8)]
    taps = sorted({t for name in args.variants.split(",") for t in VARIANTS[name]})
    target = TorchTarget(cfg, weights, device, taps=taps)
    say(f"target {cfg.name}: taps {taps}, {len(train_prompts)} train prompts x {args.samples}, "
        f"{len(test_prompts)} held-out")  # fmt: skip
    t0 = time.perf_counter()
    repeated = [p for p in train_prompts for _ in range(args.samples)]
    data = answer_all(target, repeated, lambda i: sampled(i, args.samples), max_new=args.max_new,
                      batch=args.batch, eos=eos, seed=0, report=say)  # fmt: skip
    held = answer_all(target, test_prompts, sampled, max_new=args.max_new, batch=args.batch, eos=eos, seed=1,
                      report=say)  # fmt: skip
    data_seconds = time.perf_counter() - t0
    del target
    if device == "cuda":  # data made in float32; the head trains with TF32 products, as training may
        torch.cuda.empty_cache()
        torch.backends.cuda.matmul.allow_tf32 = True
    embed = weights["embed"]
    width = cfg.d_model
    record = {"answers": len(data), "held_out": len(held), "max_new": args.max_new, "samples": args.samples,
              "rows": int(sum(len(t) - 2 for t, _, _ in data)), "data_seconds": round(data_seconds, 1),
              "device": machine}  # fmt: skip
    say(f"data: {record}")
    (out / "data.json").write_text(json.dumps(record, indent=1))
    index = {t: i for i, t in enumerate(taps)}
    for name in args.variants.split(","):
        keep = [c for t in VARIANTS[name] for c in range(index[t] * width, (index[t] + 1) * width)]
        keep += list(range(len(taps) * width, (len(taps) + 1) * width))

        def narrowed(seqs, keep=keep):
            return [(t, p, f[:, keep]) for t, p, f in seqs]

        settings = replace(TrainSettings(), epochs=args.epochs, batch_rows=args.batch_rows)
        work = Path(args.work) / name
        work.mkdir(parents=True, exist_ok=True)
        head, vocab, rec = train(narrowed(data), narrowed(held), cfg, embed, lambda ids: embed[ids], eos,
                                 work, settings, report=say)  # fmt: skip
        arrays = {**head.arrays(), "vocab": vocab}
        np.savez(
            out / f"head-{name}.npz",
            **{k: v.astype(np.float16) if k != "vocab" else v for k, v in arrays.items()},
        )
        rec |= {"taps": list(VARIANTS[name]), "data": record, "command": " ".join(["python", *sys.argv])}
        (out / f"head-{name}.json").write_text(json.dumps(rec, indent=1))
        say(f"variant {name}: {rec}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

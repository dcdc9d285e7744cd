"""The CPU side of `gpu_head.py`: tokenized prompts for it, and its heads measured here.

`--prompts FILE` writes the training and held-out prompts, rendered through the target's chat
template and tokenized, for the GPU machine (which then needs no tokenizer). `--head ARRAYS`
turns one of its heads into a head file (`draft_head.save_head`) and measures its held-out
acceptance by depth on the CPU runtime's own held-out data (`speclanes drafter train`'s work
directory), exactly as the command's record stage does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# The product command that runs the same stages with the same settings (on a GPU, the data too).
EQUIVALENT = (
    "speclanes drafter train --data-backend torch --prompts {prompts} --samples {samples} "
    "--max-new {max_new} "
    "--held-out {held_out} --epochs {epochs} --batch-rows {batch_rows} --d-ff {d_ff} --vocab {vocab_size}"
)


def write_prompts(path: Path, model_path: Path) -> None:
    from pipeline.model.store import load_prepared
    from pipeline.training.prompts import prompts

    _, _, tok = load_prepared(model_path)
    arrays = {}
    for split in ("train", "test"):
        encoded = [tok.encode(tok.render_chat([{"role": "user", "content": t}])) for t in prompts(split, 0)]
        arrays[f"{split}_tokens"] = np.concatenate([np.asarray(e, np.int32) for e in encoded])
        arrays[f"{split}_offsets"] = np.cumsum([0, *(len(e) for e in encoded)]).astype(np.int64)
    np.savez(path, eos=np.int64(tok.eos_id), **arrays)
    counts = [len(arrays[f"{split}_offsets"]) - 1 for split in ("train", "test")]
    print(f"wrote {path}: {counts[0]} train, {counts[1]} test prompts")


def finish(arrays_path: Path, record_path: Path, model_path: Path, work: Path, out: Path, limit: int) -> None:
    from pipeline.model import load_model
    from pipeline.model.draft_head import embedding_digest, load_head, save_head
    from pipeline.training.distill import greedy_answers, load_shards
    from pipeline.training.evaluate import acceptance_by_depth

    model = load_model(model_path)
    cfg, embed = model.cfg, model.embed
    with np.load(arrays_path) as z:
        arrays = {k: z[k] for k in z.files}
    record = json.loads(record_path.read_text())
    data = record.pop("data")
    meta = {
        "target": {"name": cfg.name, "file": model_path.name, "d_model": cfg.d_model,
                   "vocab_size": cfg.vocab_size, "embedding_sha256": embedding_digest(embed)},
        "data": {**data, "prompt_set": "pipeline.training.prompts (generated; held out by subject)"},
        "training": record, "command": record.pop("command"),
        "equivalent_command": EQUIVALENT.format(prompts=data["answers"] // data["samples"], **data,
                                                **record["settings"]),
        "held_out_measured_on": "the served runtime's greedy answers to held-out prompts",
        "made": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    save_head(out, arrays, meta)
    greedy = greedy_answers(load_shards(work / "held-out"))[: limit or None]
    meta["held_out_acceptance"] = acceptance_by_depth(load_head(out, cfg, embed, model_path), greedy)
    save_head(out, arrays, meta)
    print(json.dumps(meta["held_out_acceptance"], indent=1))


def main() -> int:
    from pipeline.model.default import model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=Path, help="write the tokenized prompts here")
    ap.add_argument("--head", type=Path, help="a head's arrays from gpu_head.py (its .json beside it)")
    ap.add_argument("--work", type=Path, help="`speclanes drafter train`'s work directory (held-out data)")
    ap.add_argument("--out", type=Path, help="the head file to write")
    ap.add_argument("--limit", type=int, default=0, help="held-out answers measured (0: all)")
    args = ap.parse_args()
    path = model_path(args.model)
    if args.prompts:
        write_prompts(args.prompts, path)
    if args.head:
        finish(args.head, args.head.with_suffix(".json"), path, args.work, args.out, args.limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

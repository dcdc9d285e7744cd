"""A tiny draft head for a tiny model, made the way `speclanes drafter train` makes one: the model
answers a few generated prompts (`distill`), the head trains on them (`train`), and the file is
written and loaded (`draft_head`). Seconds, on a tiny model."""

from __future__ import annotations

from pathlib import Path

from pipeline.model import Runtime
from pipeline.model.draft_head import DraftHead, embedding_digest, load_head, save_head
from pipeline.training.distill import distill, load_shards
from pipeline.training.prompts import prompts
from pipeline.training.settings import TrainSettings
from pipeline.training.train import train


def tiny_settings(**overrides) -> TrainSettings:
    base = {"d_ff": 64, "vocab_size": 256, "epochs": 3, "batch_rows": 512, "warmup_steps": 2, "lr": 3e-3}
    return TrainSettings(**{**base, **overrides})


def make_tiny_head(model: Runtime, model_path: Path, root: Path, prompt_count: int = 24) -> tuple[Path, dict]:
    """Distil and train a head for `model`; returns its file and the training record."""
    assert model.tokenizer is not None
    quiet = {"max_new": 24, "batch": 8, "report": lambda _: None}
    distill(model, prompts("train")[:prompt_count], root / "train", **quiet)
    distill(model, prompts("test")[:8], root / "held-out", **quiet)
    sequences, held_out = load_shards(root / "train"), load_shards(root / "held-out")
    head, vocab, record = train(
        sequences, held_out, model.cfg, model.embed, lambda ids: model.embed[ids], model.tokenizer.eos_id,
        root, tiny_settings(), report=lambda _: None,
    )  # fmt: skip
    path = root / (model_path.name + ".head.npz")
    cfg = model.cfg
    meta = {"target": {"name": cfg.name, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
                       "embedding_sha256": embedding_digest(model.embed)}, "training": record}  # fmt: skip
    save_head(path, {**head.arrays(), "vocab": vocab}, meta)
    return path, record


def tiny_head(model: Runtime, model_path: Path, root: Path) -> DraftHead:
    path, _ = make_tiny_head(model, model_path, root)
    return load_head(path, model.cfg, model.embed, model_path)

"""The head's training settings: their own module, so the CLI reads the defaults without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSettings:
    d_ff: int = 1024  # narrower than the target's layer: the head runs once per draft token
    vocab_size: int = 6144  # ~97% of the default model's answer tokens
    epochs: int = 4
    batch_rows: int = 4096  # rows (positions) per optimizer step, padding excluded
    lr: float = 2e-3
    warmup_steps: int = 50
    feature_weight: float = 1.0
    token_weight: float = 0.1
    noise: float = 0.1  # uniform noise on input features, times each row's RMS
    second_step: float = 1.0  # weight of the second draft's losses (rows reading predicted features)
    seed: int = 0
    threads: int = 0  # torch threads (0: torch's default)
    checkpoint_every: int = 200  # steps between checkpoints (and one at the end)

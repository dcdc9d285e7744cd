"""Training the draft head on self-distillation data (`distill`), with torch, resumable.

Each training row p of a sequence reads the embedding of token p + 1 and the target's feature at
p (with a little noise, as EAGLE adds, so the head tolerates its own imperfect predictions when it
drafts several tokens deep), and learns
- the target's feature at p + 1 (smooth L1), and
- the target's next-token distribution there, restricted to the draft vocabulary (cross-entropy
  against the softmax of the true feature times the output rows: the target's own logits).
Only rows that predict answer tokens count; prompt rows are context for the head's attention.

The draft vocabulary is the `vocab_size` tokens the target emits most in the training answers
(FR-Spec), plus end-of-sequence.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.model.config import ModelConfig
from pipeline.training.head import TorchHead
from pipeline.training.settings import TrainSettings

Sequences = list[tuple[np.ndarray, int, np.ndarray]]  # (tokens, prompt length, features), as `distill` writes


def draft_vocabulary(sequences: Sequences, size: int, eos: int | None) -> np.ndarray:
    counts = Counter()
    for tokens, prompt_length, _ in sequences:
        counts.update(tokens[prompt_length:].tolist())
    top = [t for t, _ in counts.most_common(size)]
    if eos is not None and eos not in top:
        top = [*top[: size - 1], eos]
    return np.asarray(sorted(top), np.int64)


def batches(lengths: list[int], batch_rows: int, rng: np.random.Generator) -> list[list[int]]:
    """Sequence indices grouped by similar length (little padding), about batch_rows rows each."""
    order = np.argsort(lengths, kind="stable")
    out, current, rows = [], [], 0
    for i in order:
        current.append(int(i))
        rows += lengths[i]
        if rows >= batch_rows:
            out.append(current)
            current, rows = [], 0
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def collate(sequences, indices: list[int], embed: np.ndarray, device: str):
    """(embedded, features, target features, loss mask) padded to the longest sequence. A feature
    may be wider than the model (earlier layers' taps beside the final norm's output, which is
    always last); the target is the final norm's output."""
    rows = max(len(sequences[i][0]) - 2 for i in indices)
    d = embed.shape[1]
    emb = np.zeros((len(indices), rows, d), np.float32)
    feat = np.zeros((len(indices), rows, sequences[indices[0]][2].shape[1]), np.float32)
    goal = np.zeros_like(emb)
    mask = np.zeros((len(indices), rows), np.float32)
    for b, i in enumerate(indices):
        tokens, prompt_length, features = sequences[i]
        n = len(tokens) - 2  # rows p = 0 .. n-1: token p+1, feature p -> feature p+1
        emb[b, :n] = embed[tokens[1 : n + 1]]
        feat[b, :n] = features[:n]
        goal[b, :n] = features[1 : n + 1, -d:]
        mask[b, max(0, prompt_length - 2) : n] = 1.0
    return tuple(torch.from_numpy(a).to(device) for a in (emb, feat, goal, mask))


def row_losses(pred: torch.Tensor, goal: torch.Tensor, mask: torch.Tensor, out_rows: torch.Tensor):
    """(feature loss, token loss, top-1 agreement), each averaged over the rows `mask` keeps."""
    weight = mask.sum().clamp(min=1)
    feature_loss = (F.smooth_l1_loss(pred, goal, reduction="none").mean(-1) * mask).sum() / weight
    target_logits, logits = goal @ out_rows.T, pred @ out_rows.T
    token_loss = (-(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1) * mask).sum()
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).float()
    return feature_loss, token_loss / weight, (agree * mask).sum() / weight


def loss_of(head: TorchHead, batch, out_rows: torch.Tensor, s: TrainSettings, train: bool):
    """The first draft's losses, and with `s.second_step` the second's: rows that read the feature
    the first pass predicted, attending to the true rows before them (as the head drafts). Returns
    (loss, feature loss, token loss, top-1 agreement of the first draft, of the second)."""
    emb, feat, goal, mask = batch
    if train and s.noise > 0:
        scale = feat.pow(2).mean(-1, keepdim=True).sqrt()
        feat = feat + (torch.rand_like(feat) - 0.5) * 2 * s.noise * scale
    feat = head.fused(feat)
    pred, context = head.run(emb, feat)
    feature_loss, token_loss, accuracy = row_losses(pred, goal, mask, out_rows)
    loss = s.feature_weight * feature_loss + s.token_weight * token_loss
    second_accuracy = torch.zeros(())
    if s.second_step > 0:
        drafted = torch.cat([feat[:, :1], pred.detach()[:, :-1]], dim=1)  # row p reads pred row p - 1
        second, _ = head.run(emb, drafted, context=tuple(c.detach() for c in context))
        later = mask.clone()
        later[:, 0] = 0
        f2, t2, second_accuracy = row_losses(second, goal, later, out_rows)
        loss = loss + s.second_step * (s.feature_weight * f2 + s.token_weight * t2)
    return loss, feature_loss, token_loss, accuracy, second_accuracy


class Batches:
    """Training batches by their sequences' indices: collated once and kept on a GPU (every epoch
    groups the same sequences; only the order of the groups changes), afresh each time on a CPU,
    where memory is the scarcer."""

    def __init__(self, sequences: Sequences, embed: np.ndarray, device: str) -> None:
        self.sequences, self.embed, self.device = sequences, embed, device
        self.kept: dict[tuple[int, ...], tuple] = {}

    def __call__(self, indices: list[int]) -> tuple:
        if self.device == "cpu":
            return collate(self.sequences, indices, self.embed, self.device)
        key = tuple(indices)
        if key not in self.kept:
            found = collate(self.sequences, indices, self.embed, self.device)
            self.kept[key] = tuple(t.half() if t.dim() == 3 else t for t in found)
        return tuple(t.float() for t in self.kept[key])


def held_out_top1(
    head: TorchHead, held_out: Sequences, embed: np.ndarray, out_rows: torch.Tensor, settings: TrainSettings,
    rng: np.random.Generator, device: str,
) -> dict[str, float | None]:  # fmt: skip
    """Teacher-forced top-1 agreement on held-out data, of the first draft and of the second."""
    with torch.no_grad():
        groups = batches([len(t) - 2 for t, _, _ in held_out], settings.batch_rows, rng)
        found = [loss_of(head, collate(held_out, b, embed, device), out_rows, settings, False)[3:]
                 for b in groups]  # fmt: skip
    if not found:
        return {"held_out_top1": None, "held_out_second_top1": None}
    first, second = (round(float(np.mean([pair[i].item() for pair in found])), 4) for i in (0, 1))
    return {"held_out_top1": first, "held_out_second_top1": second}


def resume(checkpoint: Path, head: TorchHead, opt, settings: TrainSettings, device: str) -> tuple[int, float]:
    """Load `checkpoint` into the head and the optimizer if it was made with these settings; the
    step it had reached and the seconds it had trained (0, 0.0: start over)."""
    state = torch.load(checkpoint, map_location=device) if checkpoint.exists() else None
    if state is None or state.get("settings") != asdict(settings):
        return 0, 0.0
    head.load_state_dict(state["head"])
    opt.load_state_dict(state["opt"])
    return state["step"], state["seconds"]


def train(
    sequences: Sequences, held_out: Sequences, cfg: ModelConfig, embed: np.ndarray,
    output_rows: Callable[[np.ndarray], np.ndarray], eos: int | None, out: Path, settings: TrainSettings,
    report: Callable[[str], None] = print,
) -> tuple[TorchHead, np.ndarray, dict]:  # fmt: skip
    """Train (or resume from `out/checkpoint.pt`); returns the head, its draft vocabulary and the record."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if settings.threads:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    vocab = draft_vocabulary(sequences, settings.vocab_size, eos)
    out_rows = torch.from_numpy(np.ascontiguousarray(output_rows(vocab), np.float32)).to(device)
    head = TorchHead(cfg, settings.d_ff, sequences[0][2].shape[1]).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0)
    lengths = [len(t) - 2 for t, _, _ in sequences]
    plan = [batches(lengths, settings.batch_rows, rng) for _ in range(settings.epochs)]
    total = sum(len(p) for p in plan)
    checkpoint = out / "checkpoint.pt"
    step, seconds = resume(checkpoint, head, opt, settings, device)
    if step:
        report(f"train: resumed at step {step}/{total}")

    def lr_at(i: int) -> float:
        warm = min(1.0, (i + 1) / settings.warmup_steps)
        return settings.lr * warm * 0.5 * (1 + math.cos(math.pi * i / total))

    start = time.perf_counter() - seconds
    flat = [b for p in plan for b in p]
    collated = Batches(sequences, embed, device)
    for i in range(step, total):
        for group in opt.param_groups:
            group["lr"] = lr_at(i)
        batch = collated(flat[i])
        loss, feature_loss, token_loss, acc, _ = loss_of(head, batch, out_rows, settings, train=True)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if (i + 1) % 25 == 0 or i + 1 == total:
            elapsed = time.perf_counter() - start
            report(f"train: step {i + 1}/{total} loss {loss.item():.4f} (feature {feature_loss.item():.4f}, "
                   f"token {token_loss.item():.3f}) top-1 {acc.item():.3f}, {elapsed:.0f} s")  # fmt: skip
        if (i + 1) % settings.checkpoint_every == 0 or i + 1 == total:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": i + 1,
                        "seconds": time.perf_counter() - start, "settings": asdict(settings)},
                       checkpoint)  # fmt: skip
    elapsed = time.perf_counter() - start
    del collated
    record = {"settings": asdict(settings), "steps": total, "train_seconds": round(elapsed, 1),
              "device": device, "train_sequences": len(sequences), "held_out_sequences": len(held_out),
              "train_rows": int(sum(lengths)),
              **held_out_top1(head, held_out, embed, out_rows, settings, rng, device)}  # fmt: skip
    report(
        f"train: done in {elapsed:.0f} s; held-out top-1 (teacher-forced) {record['held_out_top1']}, "
        f"second draft {record['held_out_second_top1']}"
    )
    return head, vocab, record

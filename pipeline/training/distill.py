"""Self-distillation data: the target answers the prompt set, and every position's feature is kept.

A head learns to predict the target's own next feature and token, so its data is the target's
own output (greedy, and a share sampled at temperature 0.8, as users run it) with the feature the
target computed at each position: the final norm's output, what the drafter reads when serving.
The runtime is row-invariant, so a feature computed here in a batch of unrelated sequences has the
same bits the verify lane computes for the same prefix one step at a time.

Sequences are decoded in a continuous batch (a finished slot takes the next prompt) and written in
shards of SHARD sequences; a shard already on disk is skipped, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.model import Runtime

SHARD = 64
SAMPLED_EVERY = 3  # every third prompt is answered at temperature 0.8, the rest greedily
TEMPERATURE = 0.8


def sampled(index: int) -> bool:
    """Whether prompt `index` of a data set is answered at TEMPERATURE (else greedily)."""
    return index % SAMPLED_EVERY == SAMPLED_EVERY - 1


@dataclass
class Answer:
    """One prompt being answered: its tokens so far and a feature for each but the newest."""

    index: int
    tokens: list[int]
    prompt_length: int
    cache: object
    features: list[np.ndarray] = field(default_factory=list)
    rng: np.random.Generator | None = None


def answer_shard(
    model: Runtime, prompt_tokens: Sequence[list[int]], first_index: int, *, max_new: int, batch: int,
    seed: int,
) -> list[Answer]:  # fmt: skip
    """Every prompt of a shard answered, `batch` sequences decoding together."""
    eos = model.tokenizer.eos_id if model.tokenizer is not None else None
    waiting = list(enumerate(prompt_tokens, first_index))
    active: list[Answer] = []
    done: list[Answer] = []
    while waiting or active:
        while waiting and len(active) < batch:
            index, prompt = waiting.pop(0)
            cache = model.new_cache(capacity=len(prompt) + max_new + 1)
            rng = np.random.default_rng([seed, index]) if sampled(index) else None
            seq = Answer(index, list(prompt), len(prompt), cache, rng=rng)
            logits, feats = model.forward_features([(cache, prompt)], all_logits=False)
            seq.features.append(feats[0])
            seq.tokens.append(choose(logits[0][-1], rng))
            active.append(seq)
        logits, feats = model.forward_features([(s.cache, s.tokens[-1:]) for s in active])
        still = []
        for seq, row, feat in zip(active, logits, feats, strict=True):
            seq.features.append(feat)
            seq.tokens.append(choose(row[-1], seq.rng))
            finished = seq.tokens[-1] == eos or len(seq.tokens) - seq.prompt_length >= max_new
            (done if finished else still).append(seq)
        active = still
    return sorted(done, key=lambda s: s.index)


def choose(logits: np.ndarray, rng: np.random.Generator | None) -> int:
    if rng is None:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / TEMPERATURE
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def write_shard(path: Path, sequences: list[Answer]) -> int:
    """tokens (all sequences, concatenated), offsets, prompt lengths and float16 features: a
    sequence of n tokens has n - 1 features (its newest token was never fed)."""
    tokens = np.concatenate([np.asarray(s.tokens, np.int32) for s in sequences])
    features = np.concatenate([np.concatenate(s.features)[: len(s.tokens) - 1] for s in sequences])
    offsets = np.cumsum([0, *(len(s.tokens) for s in sequences)]).astype(np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp, tokens=tokens, offsets=offsets, prompt_lengths=np.asarray([s.prompt_length for s in sequences]),
        features=features.astype(np.float16),
    )  # fmt: skip
    tmp.replace(path)
    return int(sum(len(s.tokens) - s.prompt_length for s in sequences))


def distill(
    model: Runtime, prompts: Sequence[str], out: Path, *, max_new: int = 192, batch: int = 16, seed: int = 0,
    report: Callable[[str], None] = print,
) -> dict:  # fmt: skip
    """Answer `prompts` into shards under `out`; returns the data's record (also `out/data.json`)."""
    assert model.tokenizer is not None
    out.mkdir(parents=True, exist_ok=True)
    tok = model.tokenizer
    start, made = time.perf_counter(), 0
    n_shards = -(-len(prompts) // SHARD)
    for shard in range(n_shards):
        path = out / f"shard-{shard:05d}.npz"
        if path.exists():
            continue
        texts = prompts[shard * SHARD : (shard + 1) * SHARD]
        # A base model (no chat template) is served plain text to continue, so it is distilled on that.
        shown = [tok.render_chat([{"role": "user", "content": t}]) if tok.chat_template else t for t in texts]
        encoded = [tok.encode(t) for t in shown]
        made += write_shard(path, answer_shard(model, encoded, shard * SHARD, max_new=max_new, batch=batch,
                                               seed=seed))  # fmt: skip
        rate = made / (time.perf_counter() - start)
        report(f"data: shard {shard + 1}/{n_shards}, {made} answer tokens this run, {rate:.0f} tok/s")
    record = {"prompts": len(prompts), "shards": n_shards, "max_new": max_new, "seed": seed,
              "sampled_every": SAMPLED_EVERY, "temperature": TEMPERATURE, "model": model.cfg.name,
              "backend": model.describe()}  # fmt: skip
    (out / "data.json").write_text(json.dumps(record, indent=1))
    return record


def load_shards(out: Path) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """Every sequence on disk: (tokens, prompt length, features)."""
    found = []
    for path in sorted(out.glob("shard-*.npz")):
        with np.load(path) as z:
            tokens, offsets, lengths, feats = z["tokens"], z["offsets"], z["prompt_lengths"], z["features"]
        f0 = 0
        for i, p in enumerate(lengths):
            t = tokens[offsets[i] : offsets[i + 1]]
            found.append((t, int(p), feats[f0 : f0 + len(t) - 1]))
            f0 += len(t) - 1
    return found

"""Self-distillation data: the target answers the prompt set, and every position's feature is kept.

A head learns to predict the target's own next feature and token, so its data is the target's
own output (greedy, and a share sampled at temperature 0.8, as users run it) with the feature the
target computed at each position: the final norm's output, what the drafter reads when serving.
The runtime is row-invariant, so a feature computed here in a batch of unrelated sequences has the
same bits the verify lane computes for the same prefix one step at a time.

Sequences are decoded in a continuous batch (a finished slot takes the next prompt) and written in
shards of SHARD prompts; a shard already on disk is skipped, so an interrupted run resumes. On a
machine with a GPU the torch target (`torch_target`) can answer instead, a whole shard as one
padded batch: the same data rule, features equal up to rounding.

A prompt may be answered more than once (`samples`): its first answer greedy, the others sampled,
which multiplies the data without new prompts. With one answer each, every SAMPLED_EVERY-th prompt
is sampled.
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


def sampled(index: int, samples: int = 1) -> bool:
    """Whether answer `index` of a data set (prompt index // samples) is drawn at TEMPERATURE."""
    if samples > 1:
        return index % samples != 0
    return index % SAMPLED_EVERY == SAMPLED_EVERY - 1


Triple = tuple[np.ndarray, int, np.ndarray]  # tokens, prompt length, features (one per token but the newest)
Answerer = Callable[[list[list[int]], int], list[Triple]]  # a shard's prompts, its first answer index


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
    seed: int, samples: int = 1,
) -> list[Triple]:  # fmt: skip
    """Every prompt of a shard answered on the served runtime, `batch` sequences decoding together."""
    eos = model.tokenizer.eos_id if model.tokenizer is not None else None
    waiting = list(enumerate(prompt_tokens, first_index))
    active: list[Answer] = []
    done: list[Answer] = []
    while waiting or active:
        while waiting and len(active) < batch:
            index, prompt = waiting.pop(0)
            cache = model.new_cache(capacity=len(prompt) + max_new + 1)
            rng = np.random.default_rng([seed, index]) if sampled(index, samples) else None
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
    ordered = sorted(done, key=lambda s: s.index)
    return [(np.asarray(s.tokens, np.int32), s.prompt_length, np.concatenate(s.features)[: len(s.tokens) - 1])
            for s in ordered]  # fmt: skip


def choose(logits: np.ndarray, rng: np.random.Generator | None) -> int:
    if rng is None:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / TEMPERATURE
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def write_shard(path: Path, sequences: list[Triple]) -> int:
    """tokens (all sequences, concatenated), offsets, prompt lengths and float16 features: a
    sequence of n tokens has n - 1 features (its newest token was never fed)."""
    tokens = np.concatenate([t for t, _, _ in sequences])
    features = np.concatenate([f[: len(t) - 1] for t, _, f in sequences])
    offsets = np.cumsum([0, *(len(t) for t, _, _ in sequences)]).astype(np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp, tokens=tokens, offsets=offsets, prompt_lengths=np.asarray([p for _, p, _ in sequences]),
        features=features.astype(np.float16),
    )  # fmt: skip
    tmp.replace(path)
    return int(sum(len(t) - p for t, p, _ in sequences))


def runtime_answerer(model: Runtime, *, max_new: int, batch: int, seed: int, samples: int = 1) -> Answerer:
    def answer(prompt_tokens: list[list[int]], first_index: int) -> list[Triple]:
        return answer_shard(model, prompt_tokens, first_index, max_new=max_new, batch=batch, seed=seed,
                            samples=samples)  # fmt: skip

    return answer


def distill(
    model: Runtime, prompts: Sequence[str], out: Path, *, max_new: int = 192, batch: int = 16, seed: int = 0,
    samples: int = 1, answerer: Answerer | None = None, shard: int = SHARD,
    report: Callable[[str], None] = print,
) -> dict:  # fmt: skip
    """Answer `prompts` (`samples` times each) into shards of `shard` prompts under `out`, on the
    served runtime unless `answerer` is given; returns the data's record (also `out/data.json`)."""
    assert model.tokenizer is not None
    out.mkdir(parents=True, exist_ok=True)
    tok = model.tokenizer
    answer = answerer or runtime_answerer(model, max_new=max_new, batch=batch, seed=seed, samples=samples)
    start, made = time.perf_counter(), 0
    n_shards = -(-len(prompts) // shard)
    for number in range(n_shards):
        path = out / f"shard-{number:05d}.npz"
        if path.exists():
            continue
        texts = prompts[number * shard : (number + 1) * shard]
        # A base model (no chat template) is served plain text to continue, so it is distilled on that.
        shown = [tok.render_chat([{"role": "user", "content": t}]) if tok.chat_template else t for t in texts]
        encoded = [tok.encode(t) for t in shown for _ in range(samples)]
        made += write_shard(path, answer(encoded, number * shard * samples))
        rate = made / (time.perf_counter() - start)
        report(f"data: shard {number + 1}/{n_shards}, {made} answer tokens this run, {rate:.0f} tok/s")
    record = {"prompts": len(prompts), "shards": n_shards, "shard_prompts": shard, "samples": samples,
              "max_new": max_new, "seed": seed, "sampled_every": SAMPLED_EVERY, "temperature": TEMPERATURE,
              "model": model.cfg.name,
              "answered_by": "the torch target" if answerer else model.describe()}  # fmt: skip
    (out / "data.json").write_text(json.dumps(record, indent=1))
    return record


def greedy_answers(found: list[Triple]) -> list[Triple]:
    """The greedy answers among a held-out set's sequences, as `load_shards` returns them (in the
    answers' order, so `sampled` tells which were drawn at TEMPERATURE): what held-out acceptance is
    measured on."""
    return [s for i, s in enumerate(found) if not sampled(i)]


def sampled_answers(found: list[Triple]) -> list[Triple]:
    """The answers drawn at TEMPERATURE among a held-out set's sequences: where a deterministic
    drafter's drafts match the token drawn, as seeded decoding keeps them (`ops/bench/learned_bound.py`)."""
    return [s for i, s in enumerate(found) if sampled(i)]


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

"""Would a coupled model drafter pay? Its acceptance against the min(1, q/p) rule's, measured.

A coupled drafter samples its draft at position i with the number the target will sample position
i with (`noise.uniform(seed, i, SAMPLE)`, an inverse-CDF draw in vocabulary order) and the target
keeps it while the two samples agree. Seeded output would then equal plain seeded decoding even
with a draft model. But the two draws agree only where the same u lands in the same token's
interval of both CDFs, and every difference between p and q in the tokens before it shifts those
intervals; the min(1, q/p) rule keeps a draft with probability sum(min(p, q)) = 1 - TV(p, q).

For every position of a seeded answer (temperature 0.8) on the chat and code workloads this
computes both acceptance probabilities exactly (interval overlaps, not samples), with draft rows
from the float32 numpy reference runtime (nearly the target's own distribution) and from the
target's logits plus Gaussian noise of growing scale (weaker drafts). Run from the repository's root:

    .venv/bin/python ops/bench/coupling.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.bench.common import WORKLOADS
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.sampling import SamplingParams, target_probs
from pipeline.decoding.speculative import decode
from pipeline.model import default_model_path, load_model


def rule_acceptance(p: np.ndarray, q: np.ndarray) -> float:
    """P(keep) under min(1, q/p) with x ~ p: sum(min(p, q))."""
    return float(np.minimum(p, q).sum())


def coupled_acceptance(p: np.ndarray, q: np.ndarray) -> float:
    """P(inverse-CDF draws of p and q with one shared u pick the same token)."""
    high_p, high_q = np.cumsum(p), np.cumsum(q)
    low_p, low_q = high_p - p, high_q - q
    return float(np.clip(np.minimum(high_p, high_q) - np.maximum(low_p, low_q), 0.0, None).sum())


def main() -> int:
    target = load_model(default_model_path(), "native")
    reference = load_model(default_model_path(), "numpy")
    assert target.tokenizer is not None
    params = SamplingParams(max_tokens=100, temperature=0.8, seed=7)
    noise = np.random.default_rng(0)
    print(f"{'workload':8} {'draft rows':22} {'min(1, q/p)':>11} {'coupled':>8}")
    for workload in ("chat", "code"):
        prompt = target.tokenizer.encode(
            target.tokenizer.render_chat([{"role": "user", "content": WORKLOADS[workload]}])
        )
        answer = decode(target, prompt, params, make_draft_source("none", target)).tokens
        full, rows = prompt + answer, slice(len(prompt) - 1, -1)
        logits = target.forward(target.new_cache(), full, all_logits=True)[rows]
        q = target_probs(logits, params)
        drafts = {"numpy float32 runtime": reference.forward(reference.new_cache(), full, all_logits=True)}
        drafts["numpy float32 runtime"] = drafts["numpy float32 runtime"][rows]
        for sigma in (0.25, 0.5, 1.0):
            drafts[f"target + N(0, {sigma}^2)"] = logits + sigma * noise.standard_normal(logits.shape)
        for label, draft_logits in drafts.items():
            p = target_probs(draft_logits, params)
            rule = np.mean([rule_acceptance(a, b) for a, b in zip(p, q, strict=True)])
            coupled = np.mean([coupled_acceptance(a, b) for a, b in zip(p, q, strict=True)])
            print(f"{workload:8} {label:22} {rule:11.3f} {coupled:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

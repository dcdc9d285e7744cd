"""How two runtimes' logits for the same tokens are compared: the measures shared by the llama.cpp
agreement scripts (ops/bench/llama_cpp_agreement.py, families_agreement.py) and the tests that check
the fixtures those scripts write (tests/test_gemma3_llama_cpp.py).

A runtime here is anything with `new_cache` and `forward` (`pipeline.model.Runtime`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Perplexity's forward block: 128 rows of a 262,144-token vocabulary's logits are 128 MiB.
PERPLEXITY_CHUNK = 128


def margin(logits: np.ndarray) -> float:
    """The top-2 gap: how far a greedy choice is from a tie."""
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float], np.ndarray]:
    """n greedy tokens decoded one at a time, as a user's request is, each step's margin, and the
    first generated position's logits."""
    cache = model.new_cache(capacity=len(prompt) + n)
    logits = model.forward(cache, prompt, all_logits=False)[-1]
    first, tokens, margins = logits.copy(), [], []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        margins.append(margin(logits))
        logits = model.forward(cache, [tokens[-1]])[-1]
    return tokens, margins, first


def teacher_forced(model: Any, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits that choose each of `tokens` after `prompt`, in one block: (len(tokens), vocab)."""
    cache = model.new_cache(capacity=len(prompt) + len(tokens))
    return model.forward(cache, [*prompt, *tokens[:-1]])[len(prompt) - 1 :]


def parting(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two token sequences differ (None: they agree throughout)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def perplexity(model: Any, tokens: list[int], chunk: int = PERPLEXITY_CHUNK) -> float:
    """exp of the mean negative log-likelihood of tokens[1:], the logits taken `chunk` rows at a time."""
    cache, nll = model.new_cache(capacity=len(tokens)), 0.0
    for start in range(0, len(tokens) - 1, chunk):
        block = tokens[start : min(start + chunk, len(tokens) - 1)]
        z = model.forward(cache, block).astype(np.float64)
        z -= z.max(axis=-1, keepdims=True)
        log_probs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        nll -= log_probs[np.arange(len(block)), tokens[start + 1 : start + 1 + len(block)]].sum()
    return float(np.exp(nll / (len(tokens) - 1)))

"""Held-out acceptance of a draft head, depth by depth, as it drafts when serving.

For greedy answers the target's next token is the answer's next token, so a chain drafted at
position s is accepted up to its first disagreement with the answer. The head runs as the draft
lane runs it (`LearnedDrafter`, Q8_0 weights, its KV cache kept across positions), so the figures
are those of the head file, not of its float training copy.
"""

from __future__ import annotations

import time

import numpy as np

from pipeline.decoding.drafters.learned import LearnedDrafter
from pipeline.model.draft_head import DraftHead
from pipeline.training.train import Sequences


def acceptance_by_depth(head: DraftHead, sequences: Sequences, k: int = 6, stride: int = 3) -> dict:
    """Per depth d: the share of chains whose first d drafts all match; the mean accepted length a
    chain of k gives (accepted + 1, the token the target adds); the head's seconds per draft token."""
    reached = np.zeros(k + 1, np.int64)  # reached[d]: chains whose first d drafts matched
    chains, seconds, drafted = 0, 0.0, 0
    for tokens, prompt_length, features in sequences:
        drafter = LearnedDrafter(head)
        fed = 0
        for s in range(prompt_length, len(tokens) - 1, stride):  # the pending token sits at s
            drafter.observe(fed, features[fed:s])
            fed = s
            t0 = time.perf_counter()
            proposal = drafter.propose(list(tokens[: s + 1]), k)
            seconds += time.perf_counter() - t0
            drafted += len(proposal.tokens)
            truth = tokens[s + 1 : s + 1 + k].tolist()
            matched = 0
            limit = min(len(truth), len(proposal.tokens))
            while matched < limit and proposal.tokens[matched] == truth[matched]:
                matched += 1
            reached[: matched + 1] += 1
            chains += 1
    share = reached / max(chains, 1)
    return {
        "chains": chains, "k": k,
        "accepted_by_depth": [round(float(x), 4) for x in share[1:]],
        "mean_accepted_length": round(float(share[1:].sum() + 1), 3),
        "head_seconds_per_draft_token": round(seconds / max(drafted, 1), 6),
    }  # fmt: skip

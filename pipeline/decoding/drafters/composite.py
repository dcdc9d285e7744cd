"""Try drafters in order, cheapest first; the first with a proposal wins the step. Asked for a
tree, the deterministic drafters' candidates are merged into one tree instead (`prioritised`),
and the others (a draft model, which has no candidates; the learned head, whose kind is not
`merged`) are asked in order, each for a proposal of its own, only when they have none."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.drafters import (
    EMPTY,
    Candidates,
    Drafter,
    DraftSource,
    Proposal,
    observe,
    tree_proposal,
)
from pipeline.decoding.drafters.kinds import merged
from pipeline.decoding.sampling import SamplingParams

LATER_SHARE = 0.25  # the least weight a later drafter's candidates keep under a confident earlier one


def prioritised(found: list[Candidates]) -> Candidates:
    """Each drafter's candidates, in order, get the weight the earlier ones left (at least
    LATER_SHARE of it), as the chain mode takes the first drafter with a proposal."""
    out: Candidates = []
    left = 1.0
    for candidates in found:
        total = sum(w for _, w in candidates)
        scale = left if not out else max(left, LATER_SHARE)
        out += [(tokens, w * scale) for tokens, w in candidates]
        left = max(0.0, left - total * scale)
    return out


class CompositeDrafter:
    def __init__(self, name: str, drafters: list[Drafter]) -> None:
        self.name, self.drafters = name, drafters

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        free = [d for d in self.drafters if hasattr(d, "candidates") and merged(d.name)] if tree else []
        if free and k > 0:
            # Each drafter may drop candidates under its share of the floor, so the tree of those it
            # kept need only reach what the others' could have added to one node to go under it.
            share = floor / len(free)
            found = [c for d in free if (c := d.candidates(context, k, share))]
            if found:
                left = floor - share * (len(free) - len(found))
                return tree_proposal(self.name, prioritised(found), k, left)
        for drafter in self.drafters:
            if drafter in free:
                continue  # asked above, with nothing to offer
            proposal = drafter.propose(context, k, tree and not merged(drafter.name))
            if proposal.tokens:
                return proposal
        return EMPTY

    def accept(self, context: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.accept(context)

    def observe(self, position: int, features: np.ndarray) -> None:
        for drafter in self.drafters:
            observe(drafter, position, features)

    def finish(self, context: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.finish(context)


class CompositeSource:
    def __init__(self, sources: list[DraftSource], name: str = "auto") -> None:
        self.sources, self.name = sources, name
        self.needs_features = any(getattr(s, "needs_features", False) for s in sources)

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> CompositeDrafter:
        return CompositeDrafter(self.name, [s.start(prompt, params, seed) for s in self.sources])

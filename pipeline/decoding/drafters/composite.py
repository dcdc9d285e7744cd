"""Try drafters in order, cheapest first; the first with a proposal wins the step."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.decoding.drafters import EMPTY, Drafter, DraftSource, Proposal
from pipeline.decoding.sampling import SamplingParams


class CompositeDrafter:
    def __init__(self, name: str, drafters: list[Drafter]) -> None:
        self.name, self.drafters = name, drafters

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        for drafter in self.drafters:
            proposal = drafter.propose(context, k)
            if proposal.tokens:
                return proposal
        return EMPTY

    def accept(self, context: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.accept(context)

    def finish(self, context: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.finish(context)


class CompositeSource:
    def __init__(self, sources: list[DraftSource], name: str = "auto") -> None:
        self.sources, self.name = sources, name

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> CompositeDrafter:
        return CompositeDrafter(self.name, [s.start(prompt, params, seed) for s in self.sources])

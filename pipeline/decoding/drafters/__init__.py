"""Drafters: cheap guesses at the target's next tokens.

A `DraftSource` is shared across requests (a model, a cross-request cache) and starts
one `Drafter` per request. A drafter proposes up to k tokens for the accepted context
(with the probability rows it drew them from, or None when it is deterministic) and
is told the accepted context after each step, so it can roll back what was rejected.
Proposals only change speed: the acceptance rule keeps the output exact whatever a
drafter says, so a drafter that fails is simply skipped for that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from pipeline.decoding.sampling import SamplingParams


class Proposal(msgspec.Struct):
    tokens: list[int]
    probs: np.ndarray | None = None  # (len(tokens), vocab) rows the tokens were drawn from
    drafter: str = ""


EMPTY = Proposal([])


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int) -> Proposal: ...

    def accept(self, context: Sequence[int]) -> None:
        """The accepted context after a step (drafts beyond it were rejected)."""

    def finish(self, context: Sequence[int]) -> None:
        """The request is over; `context` is its prompt and output."""


class DraftSource(Protocol):
    name: str

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Drafter: ...


class NoDrafter:
    """Plain decoding: every step verifies zero drafts and samples one token."""

    name = "none"

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        return EMPTY

    def accept(self, context: Sequence[int]) -> None:
        pass

    def finish(self, context: Sequence[int]) -> None:
        pass


class NoDraftSource:
    name = "none"

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Drafter:
        return NoDrafter()

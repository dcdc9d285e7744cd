"""Drafters: cheap guesses at the target's next tokens.

A `DraftSource` is shared across requests (a model, a cross-request cache) and starts
one `Drafter` per request. A drafter proposes up to k tokens for the accepted context
(with the probability rows it drew them from, or None when it is deterministic) and
is told the accepted context after each step, so it can roll back what was rejected.
Asked for a tree, a deterministic drafter may propose up to k nodes of a token tree
(`tree.py`): every candidate continuation it knows, merged by common prefix.
Proposals only change speed: the acceptance rule keeps the output exact whatever a
drafter says, so a drafter that fails is simply skipped for that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.tree import merge


class Proposal(msgspec.Struct):
    tokens: list[int]
    probs: np.ndarray | None = None  # (len(tokens), vocab) rows the tokens were drawn from
    drafter: str = ""
    parents: list[int] | None = None  # a token tree's shape (`tree.py`); None: a chain
    shares: list[float] | None = None  # each node's share of its parent's candidates (None: all 1)


EMPTY = Proposal([])

Candidates = list[tuple[list[int], float]]  # continuations with weights that sum to at most 1


def tree_proposal(drafter: str, candidates: Candidates, k: int) -> Proposal:
    """Candidate continuations merged into a token tree of at most k nodes and k levels."""
    tokens, parents, shares = merge(candidates, max_nodes=k, max_depth=k)
    return Proposal(tokens, None, drafter, parents, shares) if tokens else EMPTY


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int, tree: bool = False) -> Proposal: ...

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

    def propose(self, context: Sequence[int], k: int, tree: bool = False) -> Proposal:
        return EMPTY

    def accept(self, context: Sequence[int]) -> None:
        pass

    def finish(self, context: Sequence[int]) -> None:
        pass


class NoDraftSource:
    name = "none"

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Drafter:
        return NoDrafter()

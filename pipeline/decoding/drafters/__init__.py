"""Drafters: cheap guesses at the target's next tokens.

A `DraftSource` is shared across requests (a model, a cross-request cache) and starts
one `Drafter` per request. A drafter proposes up to k tokens for the accepted context
(with the probability rows it drew them from, or None when it is deterministic) and
is told the accepted context after each step, so it can roll back what was rejected.
Asked for a tree, a deterministic drafter may propose up to k nodes of a token tree
(`tree.py`): every candidate continuation it knows, merged by common prefix, unless its likeliest
first node would have less than `floor` of the candidates' weight (the controller's
`Controller.floor`: below it no part of the tree pays, so it is not worth building).
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


def tree_proposal(drafter: str, candidates: Candidates, k: int, floor: float = 0.0) -> Proposal:
    """Candidate continuations merged into a token tree of at most k nodes and k levels, or nothing
    when the likeliest first node has less than `floor` of their weight."""
    if floor > 0 and first_share(candidates) < floor:
        return EMPTY
    tokens, parents, shares = merge(candidates, max_nodes=k, max_depth=k)
    return Proposal(tokens, None, drafter, parents, shares) if tokens else EMPTY


def first_share(candidates: Candidates) -> float:
    """The most weight one first token gets, over the candidates' weight (at least 1, as in `merge`)."""
    by_first: dict[int, float] = {}
    for tokens, weight in candidates:
        if tokens and weight > 0:
            by_first[tokens[0]] = by_first.get(tokens[0], 0.0) + weight
    return max(by_first.values(), default=0.0) / max(1.0, sum(by_first.values()))


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal: ...

    def accept(self, context: Sequence[int]) -> None:
        """The accepted context after a step (drafts beyond it were rejected)."""

    def finish(self, context: Sequence[int]) -> None:
        """The request is over; `context` is its prompt and output."""


def observe(drafter: object, position: int, features: np.ndarray) -> None:
    """Hand the target's features at positions [position, ...) to a drafter that reads them (one with
    an `observe` method: a learned drafter, or a wrapper around one); others need nothing."""
    method = getattr(drafter, "observe", None)
    if method is not None:
        method(position, features)


class DraftSource(Protocol):
    name: str

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Drafter: ...


class NoDrafter:
    """Plain decoding: every step verifies zero drafts and samples one token."""

    name = "none"

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        return EMPTY

    def accept(self, context: Sequence[int]) -> None:
        pass

    def finish(self, context: Sequence[int]) -> None:
        pass


class NoDraftSource:
    name = "none"

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Drafter:
        return NoDrafter()

"""Drafts the grammar gives for free: the tokens it forces next come first in every proposal.

JSON is full of them (after `{"name` the schema may force `":`), and the target accepts a forced
token whenever it would produce the same tokenization of those bytes, which it nearly always does.
The forced tokens are a chain from the root; the drafter's own proposal (chain or tree) hangs below
the last of them. A deterministic drafter's rows are one-hot anyway; in front of a sampling drafter
the forced rows are one-hot too, so the acceptance rule stays exact.

In-process the drafter shares the verifier's matcher. A draft lane has no verifier: it keeps a
matcher of its own per request (`following`), moved along the accepted context each step brings.
The verify lane stays the authority either way: its cut drops whatever the grammar forbids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.drafters import EMPTY, Drafter, Proposal, observe
from pipeline.decoding.grammar.matcher import GrammarMatcher
from pipeline.decoding.grammar.rows import Constraint
from pipeline.decoding.tree import chain
from pipeline.model.tokenizer import Tokenizer


def after_forced(forced: list[int], rest: Proposal) -> Proposal:
    """`rest` (proposed for the context plus `forced`) hung below the chain of forced tokens."""
    tokens, n = [*forced, *rest.tokens], len(forced)
    parents = None
    if rest.parents is not None:
        parents = [*chain(n), *(n - 1 if parent < 0 else parent + n for parent in rest.parents)]
    shares = None if rest.shares is None else [*[1.0] * n, *rest.shares]
    if rest.probs is None:
        return Proposal(tokens, None, rest.drafter or "grammar", parents, shares)
    one_hot = np.zeros((n, rest.probs.shape[1]), rest.probs.dtype)
    one_hot[np.arange(n), forced] = 1.0
    probs = np.concatenate([one_hot, rest.probs[: len(rest.tokens)]])
    return Proposal(tokens, probs, rest.drafter, parents, shares)


class ForcedFirst:
    """`inner` drafts after the forced tokens. The matcher must stand after the accepted context
    when `propose` is called (the verifier's own does: `Constraint`)."""

    def __init__(self, inner: Drafter, matcher: GrammarMatcher) -> None:
        self.inner, self.matcher, self.name = inner, matcher, inner.name

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        forced = self.matcher.forced_tokens()[: max(k, 0)]
        if not forced:
            return self.inner.propose(context, k, tree, floor)
        # Below forced tokens (each kept for certain) any guess is worth its tree: no floor.
        rest = self.inner.propose([*context, *forced], k - len(forced), tree) if k > len(forced) else EMPTY
        return after_forced(forced, rest)

    def accept(self, context: Sequence[int]) -> None:
        self.inner.accept(context)

    def observe(self, position: int, features: np.ndarray) -> None:
        observe(self.inner, position, features)

    def finish(self, context: Sequence[int]) -> None:
        self.inner.finish(context)


def forced_first(drafter: Drafter, grammar: Constraint | None) -> Drafter:
    """`drafter` with the grammar's forced tokens ahead of its proposals (itself without a grammar)."""
    return drafter if grammar is None else ForcedFirst(drafter, grammar.matcher)


class FollowingDrafter:
    """`ForcedFirst` with its own matcher, which follows the output in the context of each call (the
    context past the prompt: the accepted tokens, the pending one included). A context that is not
    an extension of the last one (a step replayed after an orchestrator restart) rolls it back first."""

    def __init__(self, inner: Drafter, matcher: GrammarMatcher, prompt_length: int) -> None:
        self.forced = ForcedFirst(inner, matcher)
        self.matcher, self.prompt_length, self.name = matcher, prompt_length, inner.name
        self.output: list[int] = []  # what the matcher has consumed

    def follow(self, context: Sequence[int]) -> None:
        output = list(context[self.prompt_length :])
        common = 0
        while common < min(len(output), len(self.output)) and output[common] == self.output[common]:
            common += 1
        self.matcher.rollback(len(self.output) - common)
        del self.output[common:]
        for token in output[common:]:
            self.matcher.advance(token)  # GrammarViolation: the drafter fails, the step decodes plainly
            self.output.append(token)

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        self.follow(context)
        return self.forced.propose(context, k, tree, floor)

    def accept(self, context: Sequence[int]) -> None:
        self.forced.accept(context)

    def observe(self, position: int, features: np.ndarray) -> None:
        self.forced.observe(position, features)

    def finish(self, context: Sequence[int]) -> None:
        self.forced.finish(context)


def following(
    drafter: Drafter, response_format: str | None, tokenizer: Tokenizer, vocab_size: int, prompt_length: int
) -> Drafter:
    """A draft lane's drafter for a request with `SamplingParams.response_format`: the grammar's forced
    tokens first, from a matcher of its own (`drafter` itself without a format)."""
    if response_format is None:
        return drafter
    from pipeline.decoding.grammar.compiler import compile_format  # llguidance loads only when used

    matcher = compile_format(tokenizer, response_format, vocab_size).matcher()
    return FollowingDrafter(drafter, matcher, prompt_length)

"""`audit verify` for requests with a response_format: the grammar's masks, re-derived along the
served output, as the verify lane applied them.

The masks depend only on the output before each row, so walking one matcher along the emitted
tokens gives every row's mask: a step's rows decide the tokens after its kept drafts, whose
masks are the matcher's state after each of them. The check then masks the recomputed target rows
(and the draft model's) exactly where the verifier did, and reports any emitted token the grammar
forbids. The draft model's rows for the grammar's forced tokens were one-hot (they were proposed
by the grammar, ahead of the model's own drafts: `grammar.drafting`), and are rebuilt so here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.grammar.format import ResponseFormatError
from pipeline.decoding.grammar.matcher import GrammarMatcher, GrammarViolation
from pipeline.decoding.grammar.rows import mask_logits, mask_probs, mask_rows
from pipeline.model import Runtime


def format_problem(model: Runtime, response_format: str | None) -> str | None:
    """Why the recorded format cannot be replayed on this model, if it cannot."""
    try:
        replay_matcher(model, response_format)
    except ResponseFormatError as exc:
        return f"the recorded settings are unusable: {exc}"
    return None


def replay_matcher(model: Runtime, response_format: str | None) -> GrammarMatcher | None:
    if response_format is None:
        return None
    from pipeline.decoding.grammar.compiler import compile_format  # llguidance loads only when used

    assert model.tokenizer is not None
    return compile_format(model.tokenizer, response_format, model.cfg.vocab_size).matcher()


class GrammarReplay:
    """One request's grammar, standing after the output of the steps checked so far."""

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher
        self.masks: np.ndarray | None = None  # the current step's rows
        self.forced: list[int] = []  # what the grammar forced at the step's start

    def start(self, kept: Sequence[int]) -> str | None:
        """A step whose kept drafts are `kept`: the masks of its rows, or why a kept draft breaks
        the grammar (the verifier would have cut it)."""
        self.forced = self.matcher.forced_tokens()
        self.masks, allowed = mask_rows(self.matcher, kept)
        if allowed < len(kept):
            return f"kept draft {kept[allowed]} is not allowed by the response_format there"
        return None

    def target(self, logits: np.ndarray) -> np.ndarray:
        assert self.masks is not None
        return mask_logits(logits, self.masks[: len(logits)])

    def draft(self, probs: np.ndarray, drafted: Sequence[int]) -> np.ndarray:
        """The draft model's rows as the verifier used them: forced tokens one-hot, then masked."""
        assert self.masks is not None
        probs = probs.copy()
        forced = 0  # the leading drafts the grammar forced (all of them, or as many as were drafted)
        limit = min(len(self.forced), len(drafted), len(probs))
        while forced < limit and drafted[forced] == self.forced[forced]:
            forced += 1
        probs[:forced] = 0.0
        probs[np.arange(forced), self.forced[:forced]] = 1.0
        return mask_probs(probs, self.masks[: len(probs)])

    def finish(self, emitted: Sequence[int]) -> str | None:
        """The matcher moves past the step's emitted tokens; why not, if the grammar forbids one."""
        for token in emitted:
            try:
                self.matcher.advance(token)
            except GrammarViolation:
                return f"emitted token {token} is not allowed by the response_format there"
        return None

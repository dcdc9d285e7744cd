"""One request's state on the side that holds the target model: its KV cache, its seed (every
number it uses is keyed by the seed and the position it decides: `noise`) and the tokens its
cache holds, which the context-reading controls (`controls`) condition on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.acceptance import Verdict, verify, verify_tree
from pipeline.decoding.controls import row_paths, shaped_logits, shaped_probs, uses_context
from pipeline.decoding.drafters import Proposal
from pipeline.decoding.grammar.rows import constraint_for
from pipeline.decoding.logprobs import TokenLogprobs, entries
from pipeline.decoding.sampling import ProbabilityRows, SamplingParams, TargetRows, target_probs
from pipeline.decoding.tree import chain, rows_parents
from pipeline.model import Runtime


class TargetState:
    """`draws` counts the numbers used so far (for the audit trail); nothing depends on it, so a
    re-primed verifier starts wherever the accepted prefix ends.

    `context` mirrors the KV cache: the prompt, then the output except its newest (pending) token,
    which each step feeds. `prompt_length` says where the prompt ends in it; None: everything
    prefilled before the first token is prompt (a re-prime names it, as its prefix holds output).

    `logprobs`: the entries of the tokens the last `first_token` or `conclude` emitted, one per
    token, when the params ask for them (`decoding.logprobs`); empty otherwise."""

    def __init__(
        self, model: Runtime, params: SamplingParams, seed: int, *, draws: int = 0, capacity: int,
        prompt_length: int | None = None, keep_features: bool = False,
    ) -> None:  # fmt: skip
        self.model, self.params, self.seed, self.draws = model, params, seed, draws
        self.cache = model.new_cache(capacity=capacity)
        self.context: list[int] = []
        self.prompt_length = prompt_length
        # Structured output: the grammar's masks on every row this state samples from (`grammar.rows`).
        self.grammar = constraint_for(model, params.response_format)
        self.logprobs: list[TokenLogprobs] = []
        # A learned drafter's input: the features of the positions the last prefill or step kept.
        self.keep_features = keep_features
        self.features: np.ndarray | None = None
        self.features_at = 0  # the position of features[0]

    def prefill(self, tokens: Sequence[int], *, sample: bool = True) -> tuple[int | None, float | None]:
        """Feed `tokens`; sample the next token from the last position if asked."""
        start = self.cache.length
        logits, features = self.model.forward_features(
            [(self.cache, tokens)], all_logits=False, features=self.keep_features
        )
        self.keep(start, features[0] if features else None)
        self.prefilled(tokens)
        return self.first_token(logits[0][-1]) if sample else (None, None)

    def keep(self, position: int, features: np.ndarray | None) -> None:
        """Hold the features of positions [position, ...) for the drafter, when it reads them."""
        if self.keep_features and features is not None:
            self.features, self.features_at = features, position

    def prefilled(self, tokens: Sequence[int]) -> None:
        """The cache now holds `tokens` (a caller that feeds a prompt in chunks says so once it is in)."""
        self.context = list(tokens)
        if self.prompt_length is None:
            self.prompt_length = len(self.context)

    def first_token(self, last_logits: np.ndarray) -> tuple[int, float | None]:
        """The token after the prompt, from the prompt's last logits row (fed whole or in chunks)."""
        if self.grammar is not None:
            last_logits = self.grammar.next_row(last_logits)
        token, u = self.rows(last_logits[None], [], [[]]).sample(0, self.seed, self.cache.length)
        self.logprobs = self.logprobs_of(last_logits[None], [], [[]], [token])
        self.draws += u is not None
        if self.grammar is not None:
            self.grammar.commit([token])
        return token, u

    def distributions(
        self, logits: np.ndarray, fed: Sequence[int], paths: Sequence[Sequence[int]]
    ) -> np.ndarray:
        """The target rows q for `logits`, where row i follows the cached context, then `fed` (the
        tokens this forward fed before its first row: the pending token), then `paths[i]`."""
        if not uses_context(self.params):
            return target_probs(logits, self.params)
        return shaped_probs(logits, self.params, [*self.context, *fed], self.prompt_end(), paths)

    def prompt_end(self) -> int:
        return len(self.context) if self.prompt_length is None else self.prompt_length

    def logprobs_of(
        self, logits: np.ndarray, fed: Sequence[int], paths: Sequence[Sequence[int]], tokens: Sequence[int]
    ) -> list[TokenLogprobs]:
        """The log-probabilities of `tokens`, row i's from row i of `logits` (rows as `distributions`
        reads them); none unless the params ask. Shaped again here rather than kept from the rule:
        the rule's rows are after temperature and may never have been computed (greedy, `TargetRows`)."""
        if self.params.logprobs is None:
            return []
        assert self.model.tokenizer is not None
        shaped = shaped_logits(logits, self.params, [*self.context, *fed], self.prompt_end(), paths)
        return entries(shaped, tokens, self.params.logprobs, self.model.tokenizer.token_bytes)

    def rows(self, logits: np.ndarray, fed: Sequence[int], paths: Sequence[Sequence[int]]) -> TargetRows:
        """`distributions` for the deterministic rule: computed lazily, row by row down the kept
        path, unless the controls shape them (then all at once, each with its own history)."""
        if not uses_context(self.params):
            return TargetRows(logits, self.params)
        return ProbabilityRows(self.distributions(logits, fed, paths))

    def constrain(self, draft: Proposal) -> Proposal:
        """The draft worth a forward: without the nodes the grammar forbids and their descendants
        (the target would reject them anyway). Call before the forward over [pending, *tokens]."""
        return draft if self.grammar is None else self.grammar.cut(draft)

    def narrow(self, draft: Proposal) -> tuple[Proposal, list[int] | None]:
        """`constrain`, and the indices in `draft` of the nodes it kept (None: all of them). The verify
        lane reports them, so the side that sent the draft books only what was verified."""
        if self.grammar is None:
            return draft, None
        cut, keep = self.grammar.cut_nodes(draft)
        return cut, None if len(keep) == len(draft.tokens) else keep

    def resume(self, output: Sequence[int]) -> None:
        """A re-primed state (its cache rebuilt from the accepted prefix, nothing sampled): the grammar
        moves past the output so far, the pending token included, where the lost state stood. Raises
        `GrammarViolation` if the grammar forbids a token of it."""
        if self.grammar is not None:
            self.grammar.commit(output)

    def step(self, pending: int, draft: Proposal) -> Verdict:
        """One verify step on its own: the forward over [pending, *draft] (a chain or a tree), then
        `conclude` (the verify lane batches forwards and calls `conclude` itself)."""
        parents = None if draft.parents is None else rows_parents(draft.parents)
        batch = [(self.cache, [pending, *draft.tokens], parents)]
        logits, features = self.model.forward_features(batch, features=self.keep_features)
        return self.conclude(
            logits[0], draft.tokens, draft.probs, draft.parents, pending=pending,
            features=features[0] if features else None,
        )  # fmt: skip

    def conclude(
        self, logits: np.ndarray, drafts: list[int], draft_probs: np.ndarray | None,
        parents: list[int] | None = None, *, pending: int, features: np.ndarray | None = None,
    ) -> Verdict:  # fmt: skip
        """Apply the acceptance rule to a forward over [pending, *drafts] (a chain, or the token
        tree whose node i continues node parents[i], run as `tree.rows_parents(parents)`) and keep
        only the accepted tokens' K/V (and, given the forward's `features`, the kept rows' features)."""
        start = self.cache.length - len(drafts)  # the position row 0 decides: right after `pending`
        if self.grammar is not None:
            logits, draft_probs = self.grammar.constrain(logits, drafts, draft_probs, parents)
        paths = row_paths(drafts, parents)
        if draft_probs is not None:  # sampled drafts: the min(1, q/p) rule on whole rows
            q = self.distributions(logits, [pending], paths)
            verdict = verify(drafts, draft_probs, q, self.seed, start)
        else:  # a chain is a tree too: only the rows down the kept path are computed
            shape = chain(len(drafts)) if parents is None else parents
            verdict = verify_tree(drafts, shape, self.rows(logits, [pending], paths), self.seed, start)
        if self.params.logprobs is not None:  # the rows that decided the emitted tokens: the kept path's
            kept = [0, *(node + 1 for node in verdict.path)]
            kept_paths = [paths[row] for row in kept]
            self.logprobs = self.logprobs_of(logits[kept], [pending], kept_paths, verdict.tokens)
        if features is not None:
            self.keep(start - 1, features[[0, *(node + 1 for node in verdict.path)]])
        if parents is None:
            self.cache.truncate(start + verdict.accepted)
        else:
            self.cache.keep(start - 1, [0, *(node + 1 for node in verdict.path)])
        self.context += [pending, *verdict.tokens[: verdict.accepted]]
        if self.grammar is not None:
            self.grammar.commit(verdict.tokens)
        # A rejected deterministic draft's number also chose its replacement: count it once.
        self.draws += len({*(d.u for d in verdict.decisions), verdict.final_u} - {None})
        return verdict

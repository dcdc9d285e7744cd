"""Grammar masks for a verify block, and the target-side state that applies them.

A verify block is the target's forward over [pending, *nodes]: row 0 decides the token after
pending, row i + 1 the token after node i (a chain's node i continues node i - 1; a token tree's
continues parents[i]). A row's mask is the grammar's state after the tokens on its path, so the masks
come from walking the matcher through the draft. A node the grammar forbids under its parent would
get q = 0 and be rejected, so it and everything below it are cut before the forward and cost no
target compute.

The mask applies to q and p alike. q (the target's rows) is masked before `target_probs`, so
temperature, top-k and top-p act on the allowed tokens only, exactly as in plain constrained
decoding. A sampling drafter's p rows (chains only) are masked and renormalised: a draft that
survives the cut was in effect drawn from p restricted to the allowed tokens, and the acceptance rule
is exact only with the rows the drafts were really drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.decoding.drafters import Proposal
from pipeline.decoding.grammar.matcher import GrammarMatcher
from pipeline.decoding.tree import chain, path, select
from pipeline.model import Runtime


def mask_tree(
    matcher: GrammarMatcher, tokens: Sequence[int], parents: Sequence[int]
) -> tuple[np.ndarray, list[int]]:
    """(masks, keep): `keep` lists the nodes the grammar allows under their (kept) parents, in order;
    masks[0] is the root's row (after pending) and masks[j + 1] the row of node keep[j]. The matcher
    is where it was on return. Siblings are reached by rolling back to their common ancestor."""
    start = matcher.position
    rows, keep = [matcher.allowed_mask()], []
    row_of = {-1: 0}  # node -> its row in `rows`
    at: list[int] = []  # the nodes the matcher has advanced through, root first
    try:
        for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
            above = rows[row_of[parent]] if parent in row_of else None
            if above is None or not 0 <= token < above.size or not above[token]:
                continue
            route = path(parents, node)
            common = _shared(at, route)
            matcher.rollback(len(at) - common)
            for step in route[common:]:
                matcher.advance(tokens[step])
            at = route
            row_of[node] = len(rows)
            rows.append(matcher.allowed_mask())
            keep.append(node)
    finally:
        matcher.rollback_to(start)
    return np.stack(rows), keep


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of two paths."""
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return common


def mask_rows(matcher: GrammarMatcher, drafts: Sequence[int]) -> tuple[np.ndarray, int]:
    """A chain's (masks, allowed): `allowed` counts the drafts before the first one the grammar
    forbids, and there is a mask for each of the allowed + 1 verify rows of [pending, *drafts[:allowed]].
    The matcher is where it was on return."""
    masks, keep = mask_tree(matcher, drafts, chain(len(drafts)))
    return masks, len(keep)


def mask_logits(logits: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """-inf where the grammar forbids the token; the rows `target_probs` sees."""
    out = np.full_like(logits, -np.inf)
    np.copyto(out, logits, where=masks)  # a third faster than np.where on a (9, 49152) block
    return out


def mask_probs(probs: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Draft rows restricted to the allowed tokens and renormalised (a row with no allowed mass, which
    only a forbidden draft can have, stays zero: its draft is rejected whatever the row says)."""
    kept = np.where(masks, probs, 0.0)
    total = kept.sum(axis=-1, keepdims=True)
    return np.divide(kept, total, out=np.zeros_like(kept), where=total > 0)


def full_masks(masks: np.ndarray, keep: Sequence[int], parents: Sequence[int]) -> np.ndarray:
    """A mask for every row of an uncut block: a node the grammar forbids (or one below it) takes its
    nearest kept ancestor's row. Such a row is never read (the target cannot sample the forbidden
    token, so verification never moves into it), but it must not be all -inf."""
    row_of = {-1: 0, **{node: j + 1 for j, node in enumerate(keep)}}
    for node, parent in enumerate(parents):
        row_of.setdefault(node, row_of[parent])
    return masks[[row_of[node] for node in range(-1, len(parents))]]


class Constraint:
    """The grammar side of one request's verifier. Its matcher always stands after the output emitted
    so far: `cut` walks the draft and comes back, `commit` moves on by the emitted tokens."""

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher
        self._block: tuple[list[int], list[int] | None, np.ndarray] | None = None  # the last cut's

    def next_row(self, logits: np.ndarray) -> np.ndarray:
        """One (vocab,) logits row for the next token, with the grammar applied (the prefill's row)."""
        return mask_logits(logits, self.matcher.allowed_mask())

    def cut(self, draft: Proposal) -> Proposal:
        """The draft without the nodes the grammar forbids and their descendants; the masks of what
        is left are kept for `constrain`."""
        return self.cut_nodes(draft)[0]

    def cut_nodes(self, draft: Proposal) -> tuple[Proposal, list[int]]:
        """`cut`, and the indices in `draft` of the nodes it keeps (ascending): whoever sent the
        draft learns from them which of its nodes were verified."""
        parents = chain(len(draft.tokens)) if draft.parents is None else draft.parents
        masks, keep = mask_tree(self.matcher, draft.tokens, parents)
        kept_parents = select(parents, keep)
        tokens = [draft.tokens[i] for i in keep]
        shape = None if kept_parents == chain(len(keep)) else kept_parents
        self._block = (tokens, shape, masks)
        if len(keep) == len(draft.tokens):
            return draft, keep
        probs = None if draft.probs is None else draft.probs[: len(keep)]  # sampled drafts are chains
        shares = None if draft.shares is None else [draft.shares[i] for i in keep]
        return Proposal(tokens, probs, draft.drafter, shape, shares), keep

    def masks(self, drafts: Sequence[int], parents: Sequence[int] | None = None) -> np.ndarray:
        """(len(drafts) + 1, vocab) masks for a block, from the last `cut` when it was this block."""
        block, self._block = self._block, None
        shape = None if parents is None or list(parents) == chain(len(drafts)) else list(parents)
        if block is not None and block[0] == list(drafts) and block[1] == shape:
            return block[2]
        tree = chain(len(drafts)) if shape is None else shape
        masks, keep = mask_tree(self.matcher, drafts, tree)
        return masks if len(keep) == len(drafts) else full_masks(masks, keep, tree)

    def constrain(
        self, logits: np.ndarray, drafts: Sequence[int], draft_probs: np.ndarray | None,
        parents: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
        """A block's target logits and draft rows with the grammar applied."""
        masks = self.masks(drafts, parents)
        probs = None if draft_probs is None else mask_probs(draft_probs, masks[: len(drafts)])
        return mask_logits(logits, masks), probs

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens the verifier emitted: the matcher moves past them."""
        for token in tokens:
            self.matcher.advance(token)


def constraint_for(model: Runtime, response_format: str | None) -> Constraint | None:
    """The verifier-side grammar of a request with `SamplingParams.response_format`, else None."""
    if response_format is None:
        return None
    from pipeline.decoding.grammar.compiler import compile_format  # llguidance loads only when used

    assert model.tokenizer is not None
    return Constraint(compile_format(model.tokenizer, response_format, model.cfg.vocab_size).matcher())

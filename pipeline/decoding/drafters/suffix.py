"""A cross-request n-gram cache in the spirit of SuffixDecoding.

Every finished request's tokens (prompt and output) feed one table mapping an n-gram to
counts of the token that followed it; a draft walks the table from the longest
matching suffix of the context, taking the most frequent continuation while it is
frequent enough. Agent-like traffic that repeats tool calls, templates and answers
across requests is drafted from what other requests produced. Memory is bounded:
the least recently used n-grams are evicted past `max_entries`.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Sequence

from pipeline.decoding.drafters import EMPTY, Candidates, Proposal, tree_proposal
from pipeline.decoding.drafters.ngram import SHORTER_WEIGHT
from pipeline.decoding.sampling import SamplingParams

BRANCHES = 3  # continuations a tree follows from one node, most frequent first
BRANCH_SHARE = 0.1  # the least share of a node's continuations a branch needs
SHORT_MATCH = 3  # a known suffix shorter than this drafts with less weight (as `ngram` does)


class SuffixTable:
    def __init__(self, max_n: int = 6, max_entries: int = 200_000, min_share: float = 0.3) -> None:
        self.max_n, self.max_entries, self.min_share = max_n, max_entries, min_share
        self._next: OrderedDict[tuple[int, ...], Counter[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: Sequence[int], first: int = 1) -> None:
        """Count what follows each n-gram, for next-token positions `first` onwards."""
        tokens = list(tokens)
        for end in range(max(1, first), len(tokens)):
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                counts = self._next.get(key)
                if counts is None:
                    counts = self._next[key] = Counter()
                else:
                    self._next.move_to_end(key)
                counts[tokens[end]] += 1
        while len(self._next) > self.max_entries:
            self._next.popitem(last=False)

    def next_counts(self, context: Sequence[int]) -> Counter[int] | None:
        """What followed the longest known suffix of `context`, with counts."""
        return self.matched(context)[1]

    def matched(self, context: Sequence[int]) -> tuple[int, Counter[int] | None]:
        """(n, what followed) for the longest suffix of `context` the table knows, n tokens long."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            counts = self._next.get(tuple(context[len(context) - n :]))
            if counts:
                return n, counts
        return 0, None

    def continuation(self, context: Sequence[int]) -> int | None:
        """The most frequent next token after the longest known suffix of `context`."""
        counts = self.next_counts(context)
        if not counts:
            return None
        token, count = counts.most_common(1)[0]
        return token if count / counts.total() >= self.min_share else None

    def candidates(self, context: Sequence[int], k: int, max_nodes: int, floor: float = 0.0) -> Candidates:
        """The table's likeliest continuations, up to k tokens, expanded best first by the
        product of shares (branches of at least BRANCH_SHARE) over at most `max_nodes` nodes.
        Each expanded node leaves as a candidate the share of its mass no branch took, so the
        candidates' weights are the table's path probabilities and sum to 1, or, when the context's
        known suffix is shorter than `SHORT_MATCH` tokens, to SHORTER_WEIGHT less a missing token:
        what followed one earlier newline is weak evidence of what follows this one. Nothing when
        that sum would be under `floor` (`tree_proposal` would not build their tree)."""
        out: Candidates = []
        matched, root = self.matched(context[-self.max_n :])
        evidence = SHORTER_WEIGHT ** max(0, min(SHORT_MATCH, self.max_n) - matched)
        if matched == 0 or evidence < floor:
            return out
        frontier: list[tuple[float, int, list[int]]] = [(-1.0, 0, [])]
        counter = expanded = 0
        while frontier:
            neg_prob, _, path = heapq.heappop(frontier)
            if len(path) >= k:
                counts = None
            else:  # the root's counts are the context's own, found above
                counts = self.next_counts([*context[-self.max_n :], *path]) if path else root
            taken = 0.0
            if counts and expanded < max_nodes:
                total = counts.total()
                for token, count in counts.most_common(BRANCHES):
                    if count / total < BRANCH_SHARE or (not path and count / total < self.min_share / 2):
                        break
                    counter += 1
                    expanded += 1
                    taken += count / total
                    heapq.heappush(frontier, (neg_prob * count / total, counter, [*path, token]))
            if path and 1.0 - taken > 1e-9:
                out.append((path, -neg_prob * (1.0 - taken) * evidence))
        return out

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        walk = list(context[-self.max_n :])
        out: list[int] = []
        while len(out) < k and (token := self.continuation(walk)) is not None:
            out.append(token)
            walk = [*walk[1:], token] if len(walk) >= self.max_n else [*walk, token]
        return out


class SuffixDrafter:
    name = "suffix"

    def __init__(self, table: SuffixTable, prompt: Sequence[int]) -> None:
        self.table = table
        # The request's own prompt drafts too, in a private table the request owns.
        self.own = SuffixTable(table.max_n, max_entries=50_000, min_share=table.min_share)
        self.own.add(prompt)
        self._seen = len(prompt)

    def propose(self, context: Sequence[int], k: int, tree: bool = False, floor: float = 0.0) -> Proposal:
        if k <= 0:
            return EMPTY
        if tree:
            return tree_proposal(self.name, self.candidates(context, k, floor), k, floor)
        tokens = self.own.draft(context, k) or self.table.draft(context, k)
        return Proposal(tokens, None, self.name) if tokens else EMPTY

    def candidates(self, context: Sequence[int], k: int, floor: float = 0.0) -> Candidates:
        """The request's own table and the shared one, each weighing half (the whole, when the other
        has nothing worth `floor`)."""
        both = [self.own.candidates(context, k, k, floor), self.table.candidates(context, k, k, floor)]
        found = [c for c in both if c]
        return [(path, w / len(found)) for c in found for path, w in c]

    def accept(self, context: Sequence[int]) -> None:
        # Index only the newly accepted tokens, with left context for every n-gram size.
        start = max(0, self._seen - self.table.max_n)
        self.own.add(context[start:], first=self._seen - start)
        self._seen = len(context)

    def finish(self, context: Sequence[int]) -> None:
        self.table.add(context)


class SuffixSource:
    name = "suffix"

    def __init__(self, table: SuffixTable | None = None) -> None:
        self.table = table or SuffixTable()

    def start(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> SuffixDrafter:
        return SuffixDrafter(self.table, prompt)

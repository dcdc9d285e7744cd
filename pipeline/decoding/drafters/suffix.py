"""A cross-request n-gram cache in the spirit of SuffixDecoding.

Every finished request's tokens (prompt and output) feed one table mapping an n-gram to
counts of the token that followed it; a draft walks the table from the longest
matching suffix of the context, taking the most frequent continuation while it is
frequent enough. Agent-like traffic that repeats tool calls, templates and answers
across requests is drafted from what other requests produced. Memory is bounded:
the least recently used n-grams are evicted past `max_entries`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from pipeline.decoding.drafters import EMPTY, Proposal
from pipeline.decoding.sampling import SamplingParams


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

    def continuation(self, context: Sequence[int]) -> int | None:
        """The most frequent next token after the longest known suffix of `context`."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            counts = self._next.get(tuple(context[len(context) - n :]))
            if counts:
                token, count = counts.most_common(1)[0]
                return token if count / counts.total() >= self.min_share else None
        return None

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

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if k <= 0:
            return EMPTY
        tokens = self.own.draft(context, k) or self.table.draft(context, k)
        return Proposal(tokens, None, self.name) if tokens else EMPTY

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

"""Token trees: several candidate continuations merged by common prefix, verified in one forward.

A draft tree is `tokens` with `parents` (parents[i] is the node that node i continues; -1: the
pending token, the root) in parent-before-child order, and `shares`: each node's share of its
parent's candidates (how often the drafter saw this continuation there), the drafter's own
guess of how likely the target is to continue that way. A chain is the tree whose node i
continues node i - 1.

The verify forward carries [pending, *tokens] as rows; `rows_parents` gives that block's shape
for `Runtime.forward_batch`. Everything here is a pure function of lists.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

DEPTH_DISCOUNT = 0.8


def chain(count: int) -> list[int]:
    """The parents of a linear draft of `count` tokens."""
    return list(range(-1, count - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


def rows_parents(parents: Sequence[int]) -> list[int]:
    """The verify block's tree: row 0 is the pending token, row i + 1 is node i."""
    return [-1, *(parent + 1 for parent in parents)]


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for the pending token's children."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def check(tokens: Sequence[int], parents: Sequence[int] | None) -> str | None:
    """Why (tokens, parents) is not a draft tree, or None."""
    if parents is None:
        return None
    if len(parents) != len(tokens):
        return f"{len(parents)} parents for {len(tokens)} draft tokens"
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            return f"draft node {i} has parent {parent}: it must be -1 or an earlier node"
    seen = set()
    for parent, token in zip(parents, tokens, strict=True):
        if (parent, token) in seen:
            return f"token {token} appears twice under the same parent"
        seen.add((parent, token))
    return None


def merge(candidates: Sequence[tuple[Sequence[int], float]], max_nodes: int, max_depth: int) -> tuple[
    list[int], list[int], list[float]
]:  # fmt: skip
    """Candidate continuations (tokens, weight) merged into a prefix tree of at most `max_nodes`
    nodes and `max_depth` levels: (tokens, parents, shares).

    A node's weight is the sum of the weights of the candidates through it, its share that weight
    over its parent's; the nodes kept are the best by the product of shares along their path,
    discounted by DEPTH_DISCOUNT a level (a guess is less likely kept the deeper it is: the
    controller learns by how much, but only among the nodes proposed). A parent always comes
    before its children, and a tree of one candidate is that candidate's chain.
    """
    children: list[dict[int, int]] = [{}]  # trie node -> {token: trie node}; trie node 0 is the root
    weight, token_of = [0.0], [-1]
    for tokens, w in candidates:
        if w <= 0:
            continue
        node = 0
        weight[0] += w
        for token in list(tokens)[:max_depth]:
            nxt = children[node].get(token)
            if nxt is None:
                nxt = children[node][token] = len(weight)
                children.append({})
                weight.append(0.0)
                token_of.append(token)
            weight[nxt] += w
            node = nxt
    out_tokens: list[int] = []
    out_parents: list[int] = []
    out_shares: list[float] = []
    # Best first by path probability; the counter keeps insertion order among equals.
    frontier = [
        (-DEPTH_DISCOUNT * weight[c] / weight[0], n, c, -1, 0) for n, c in enumerate(children[0].values())
    ]
    heapq.heapify(frontier)
    counter = len(frontier)
    while frontier and len(out_tokens) < max_nodes:
        neg_prob, _, node, parent, above = heapq.heappop(frontier)
        index = len(out_tokens)
        out_tokens.append(token_of[node])
        out_parents.append(parent)
        out_shares.append(weight[node] / weight[above])
        for child in children[node].values():
            priority = neg_prob * DEPTH_DISCOUNT * weight[child] / weight[node]
            heapq.heappush(frontier, (priority, counter, child, index, node))
            counter += 1
    return out_tokens, out_parents, out_shares


def path(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for node -1)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def select(parents: Sequence[int], keep: Sequence[int]) -> list[int]:
    """The parents of the sub-tree made of the nodes `keep` (ascending, closed under parents),
    renumbered in that order."""
    index = {node: i for i, node in enumerate(keep)}
    return [-1 if parents[node] < 0 else index[parents[node]] for node in keep]


def offered(parents: Sequence[int], shares: Sequence[float], kept: Sequence[int]) -> list[float]:
    """For each level the target reached (below the root, then below each kept node), the sum of
    the shares of the children offered there; a level with no children ends the list. This is
    what the controller learns its per-depth calibration from (`adaptive.DepthAcceptance`)."""
    below: dict[int, float] = {}
    for parent, share in zip(parents, shares, strict=True):
        below[parent] = below.get(parent, 0.0) + share
    out = []
    for node in [-1, *kept]:
        if node not in below:
            break
        out.append(below[node])
    return out


def step_shape(
    parents: Sequence[int] | None, shares: Sequence[float] | None, count: int, kept: Sequence[int]
) -> tuple[int, list[float]]:
    """A verified step's depth and `offered` shares, for the stats and the controller (a chain
    when `parents` is None, shares 1 when `shares` is None)."""
    shape = chain(count) if parents is None else parents
    return max(depths(shape), default=0), offered(shape, shares or [1.0] * count, kept)

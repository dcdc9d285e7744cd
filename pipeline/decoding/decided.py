"""How each served token was decided, one letter per token, for clients that show it (the web page).

A step that drafted nothing serves a plain token. A step that verified a draft serves the draft
tokens the target accepted, then one token of the target's own: a correction where it rejected a
draft node, a bonus where the accepted path reached a leaf of the draft.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.decoding.tree import chain

ACCEPTED, CORRECTED, BONUS, PLAIN = "a", "c", "b", "p"
MEANING = {ACCEPTED: "accepted draft", CORRECTED: "corrected", BONUS: "bonus", PLAIN: "plain"}


def ends_in_bonus(parents: Sequence[int] | None, count: int, kept: Sequence[int]) -> bool:
    """Whether a verified step's last token is a bonus: the kept path's last node has no child (a chain:
    every node kept). Nothing kept, or a node with children kept, means the target corrected a draft."""
    if count == 0 or not kept:
        return False
    last = kept[-1]
    return all(parent != last for parent in (chain(count) if parents is None else parents))


def letters(drafted: int, accepted: int, bonus: bool, count: int) -> str:
    """The letters of a step's first `count` served tokens (fewer than emitted where a stop cut them)."""
    if drafted == 0:
        return PLAIN * count
    return (ACCEPTED * accepted + (BONUS if bonus else CORRECTED))[:count]

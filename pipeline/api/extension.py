"""The request extension `speclanes`: what a client that shows speculation at work (the web page at
`/`, api/web.py) asks the stream for, beyond OpenAI's chunks.

`"speclanes": {"decided": true}` with `"stream": true` adds to every streamed text chunk
`"speclanes": {"decided": "aac"}`: one letter per token the chunk's pipeline step served, saying how
it was decided (`decoding.decided`: a drafted token the target accepted, the target's correction, its
bonus after a fully kept draft, or a plain step's token). The letters follow the chunk's tokens, not
its text (text that might start a stop string is held back to a later chunk), so a client pairs them
with the tokens' bytes, which `logprobs: true` gives per chunk in the same order. A request that does
not ask sees nothing new: OpenAI's clients get exactly OpenAI's chunks.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.api.errors import ApiError


class SpeclanesOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The extension field `speclanes` of a completion or chat request."""

    decided: bool = False  # each streamed chunk says how its tokens were decided


def asks_decided(options: SpeclanesOptions | None, stream: bool | None) -> bool:
    """Whether the stream carries the letters; a 400 naming the field where it cannot (no stream:
    a whole response has no chunks to carry them, and saying nothing would hide the mistake)."""
    if options is None or not options.decided:
        return False
    if not stream:
        raise ApiError(400, "speclanes.decided is only allowed with stream: true", param="speclanes.decided")
    return True


def decided_field(letters: str) -> dict[str, Any]:
    """What a chunk gains when its request asked for the letters."""
    return {"speclanes": {"decided": letters}}

"""How people name a request to `speclanes trace` and `speclanes audit`: its request id, the id an
HTTP response carried (`chatcmpl-<request id>`, `cmpl-<request id>`), or a unique prefix of either.

Request ids are 32 hex digits (a choice of a request with n > 1 adds `-<index>`), so a prefix is
what people type; one that fits several requests is
an error listing them, never a silent pick of one. Lives at the bottom layer because the audit
store and the telemetry files both resolve ids with it, and the HTTP API builds its ids from
`RESPONSE_PREFIXES`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# OpenAI's id forms, as the gateway answers (chat and text completions, the Responses API).
RESPONSE_PREFIXES = {"chat": "chatcmpl-", "text": "cmpl-", "responses": "resp_"}
SHOWN_CANDIDATES = 10
# The choices of one OpenAI request with n > 1 are requests `<base>-<index>` (api/choices.py): the
# response's id `chatcmpl-<base>` is then a prefix of all of them, and naming it lists them.
CHOICE_ID = re.compile(r"[0-9a-f]{32}-[0-9]{1,3}")


def choice_id(base: str, index: int) -> str:
    return f"{base}-{index}"


class AmbiguousId(LookupError):
    """A prefix that fits several requests; the message lists them."""


def request_key(name: str) -> str:
    """The request-id part of what a person typed: a response id loses its `chatcmpl-`/`cmpl-`."""
    name = name.strip()
    for prefix in RESPONSE_PREFIXES.values():
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def resolve(name: str, known: Iterable[str], what: str = "request", where: str = "") -> str:
    """The one id in `known` that `name` (an id, a response id, a prefix of one) names.
    LookupError when none does; AmbiguousId, listing them, when several do. `where` ends the
    messages (" in the audit store")."""
    key = request_key(name)
    if not key:
        raise LookupError(f"{name!r} names no {what}{where}: give an id or a prefix of one")
    ids = set(known)
    if key in ids:
        return key
    found = sorted(i for i in ids if i.startswith(key))
    if not found:
        raise LookupError(f"no {what} with id {name!r}{where}")
    if len(found) > 1:
        raise ambiguous(name, found, what, where)
    return found[0]


def ambiguous(name: str, candidates: list[str], what: str, where: str = "") -> AmbiguousId:
    """The error for a prefix that fits several: the first candidates, one a line."""
    listed = "\n  ".join(candidates[:SHOWN_CANDIDATES])
    more = len(candidates) - SHOWN_CANDIDATES
    tail = f"\n  ... and {more} more" if more > 0 else ""
    return AmbiguousId(
        f"{name!r} fits {len(candidates)} {what}s{where}; give more of the id:\n  {listed}{tail}"
    )

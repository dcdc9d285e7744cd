"""The gateway's streams, pushed to its inbox as they are decided (`Watch.push`): the I/O-free core.

Why push: a long poll cost the orchestrator two wake-ups per burst of decided steps on top of the
burst's own, one for the next Watch arriving and one for its reply's send completing, at about half a
millisecond of CPU each on the cores the forward uses. A non-blocking send onto the gateway's inbox
costs neither.

The gateway's push watch subscribes: its cursors replace the last set and say how far it has each
stream. `Pushes` keeps how far it has pushed each one, and builds the next message of every stream
with news. The lane advances a cursor only when the socket took the message, so while the pipe lives
the pushes arrive in order and without gaps. A push lost with a pipe (a gateway that restarted, a
dropped connection) shows at the gateway as one that does not follow its cursor; it watches again,
and that resets the cursors here. A stream is forgotten once its end has been pushed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import msgspec

from pipeline.orchestration.front import ClientFront
from pipeline.protocol.messages import Chunks, Cursor, Pushed, PushedStream, encode


class Pushes:
    def __init__(self) -> None:
        self.watcher = ""
        self.cursors: dict[str, Cursor] = {}
        # The inbox refused a push: the watch answers with the news instead, until the next watch.
        self.blocked = False

    def subscribe(self, watcher: str, cursors: Iterable[Cursor]) -> None:
        """The watcher's streams from now on. A request read by two of its streams is pushed from the
        one further behind (each drops what it already has)."""
        lowest: dict[str, Cursor] = {}
        for cursor in cursors:
            seen = lowest.get(cursor.request_id)
            if seen is None or cursor.after < seen.after:
                lowest[cursor.request_id] = cursor
        self.watcher, self.cursors, self.blocked = watcher, lowest, False

    def news(self, front: ClientFront, request_ids: Iterable[str]) -> list[PushedStream]:
        """The chunks (or the end) past its cursor of each of `request_ids` that is subscribed and has
        some. One the front no longer knows is left to the watch, which says so."""
        streams = []
        for request_id in request_ids:
            cursor = self.cursors.get(request_id)
            if cursor is None or not front.has_news(request_id, cursor.after):
                continue
            reply = front.chunks(request_id, cursor.after, cursor.secret)
            if isinstance(reply, Chunks):
                streams.append(PushedStream(cursor.after, reply))
        return streams

    def pushed(self, streams: list[PushedStream]) -> None:
        """The socket took these: each stream's cursor moves past its chunks, or the stream is done."""
        for stream in streams:
            chunks = stream.chunks
            cursor = self.cursors.get(chunks.request_id)
            if cursor is None:
                continue
            if chunks.done is not None:
                del self.cursors[chunks.request_id]
            elif chunks.chunks:
                self.cursors[chunks.request_id] = Cursor(
                    cursor.request_id, cursor.secret, chunks.chunks[-1].seq
                )


def parts(
    watcher: str, streams: list[PushedStream], limit: int
) -> Iterator[tuple[list[PushedStream], bytes]]:
    """`streams` as encoded `Pushed` messages of at most `limit` bytes each (the inbox closes the pipe
    of a larger one, and the same push would follow the watch it causes), with the streams each holds.
    Halved by streams, then a lone stream's chunks (its end goes with the last part); a lone chunk or
    end too large goes as it is, and fails as a watch's reply would."""
    data = encode(Pushed(watcher=watcher, streams=streams))
    chunks = streams[0].chunks.chunks if len(streams) == 1 else []
    lone = streams[0].chunks if len(streams) == 1 else None
    if len(data) <= limit or (lone is not None and len(chunks) + (lone.done is not None) <= 1):
        yield streams, data
    elif lone is None:
        half = len(streams) // 2
        yield from parts(watcher, streams[:half], limit)
        yield from parts(watcher, streams[half:], limit)
    else:
        half = max(len(chunks) // 2, 1)
        first = msgspec.structs.replace(lone, chunks=chunks[:half], done=None)
        rest = msgspec.structs.replace(lone, chunks=chunks[half:])
        yield from parts(watcher, [PushedStream(streams[0].after, first)], limit)
        yield from parts(watcher, [PushedStream(chunks[half - 1].seq, rest)], limit)

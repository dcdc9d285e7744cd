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

from collections.abc import Iterable

from pipeline.orchestration.front import ClientFront
from pipeline.protocol.messages import Chunks, Cursor, Pushed


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

    def news(self, front: ClientFront, request_ids: Iterable[str]) -> list[Pushed]:
        """A message for each of `request_ids` that is subscribed and has chunks (or its end) past
        its cursor. One the front no longer knows is left to the watch, which says so."""
        messages = []
        for request_id in request_ids:
            cursor = self.cursors.get(request_id)
            if cursor is None or not front.has_news(request_id, cursor.after):
                continue
            reply = front.chunks(request_id, cursor.after, cursor.secret)
            if isinstance(reply, Chunks):
                messages.append(Pushed(watcher=self.watcher, after=cursor.after, chunks=reply))
        return messages

    def pushed(self, message: Pushed) -> None:
        """The socket took `message`: its stream's cursor moves past it, or the stream is done."""
        chunks = message.chunks
        cursor = self.cursors.get(chunks.request_id)
        if cursor is None:
            return
        if chunks.done is not None:
            del self.cursors[chunks.request_id]
        elif chunks.chunks:
            self.cursors[chunks.request_id] = Cursor(cursor.request_id, cursor.secret, chunks.chunks[-1].seq)

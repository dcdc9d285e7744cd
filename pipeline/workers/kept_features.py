"""The target's features a request keeps for its drafter while no DraftRequest takes them.

Each decided step brings the features of the positions it kept (`Verified.features`), and a step
that asks for no draft (the controller found none worth it, a crowded forward had no room, or the
draft lane is down) leaves them for the next DraftRequest, which takes them all at once. So the
history is kept as the chunks the steps sent and joined once, when taken: joining at every step
copied the whole history each time, up to MAX_KEPT_FEATURES rows of 2,304 bytes for the default
model, 4.7 MB a step for every request that had not drafted for 2,048 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.protocol.messages import Rows

# The latest rows kept: a bounded history for a learned drafter.
MAX_KEPT_FEATURES = 2048


@dataclass
class KeptFeatures:
    """Rows for positions [at, at + rows), `width` floats each, in the chunks the steps sent."""

    at: int
    width: int
    chunks: list[Rows] = field(default_factory=list)
    rows: int = 0

    def taken(self) -> tuple[int, Rows]:
        """(position, rows) as one message's rows."""
        data = b"".join(chunk.data for chunk in self.chunks)
        return self.at, Rows((self.rows, self.width), data)

    def keep_first(self, n: int) -> None:
        """Drop every row from position at + n on (a step sent again overwrites them)."""
        while self.chunks and self.rows - self.chunks[-1].shape[0] >= n:
            self.rows -= self.chunks.pop().shape[0]
        if self.rows > n:
            last = self.chunks.pop()
            self.chunks.append(Rows.of(last.array()[: last.shape[0] - (self.rows - n)]))
            self.rows = n

    def keep_last(self, n: int) -> None:
        """Drop the oldest rows beyond the latest n."""
        while self.chunks and self.rows - self.chunks[0].shape[0] >= n:
            dropped = self.chunks.pop(0).shape[0]
            self.rows, self.at = self.rows - dropped, self.at + dropped
        if self.rows > n:
            cut = self.rows - n
            self.chunks[0] = Rows.of(self.chunks[0].array()[cut:])
            self.rows, self.at = n, self.at + cut


def kept_features(
    kept: KeptFeatures | None, at: int, rows: Rows, limit: int = MAX_KEPT_FEATURES
) -> KeptFeatures | None:
    """`rows` (the target's features at positions [at, ...)) after those kept: added to them where
    they continue or overlap them (changing `kept` in place), else in their place (a gap, or another
    width: the drafter starts its history again there). At most `limit`, the latest; rows whose bytes
    do not fit their shape are none."""
    n, width = rows.shape
    if width <= 0 or at < 0 or rows.problem() is not None:
        return kept
    if kept is None or kept.width != width or not kept.at <= at <= kept.at + kept.rows:
        kept = KeptFeatures(at, width)
    else:
        kept.keep_first(at - kept.at)
    if n:
        kept.chunks.append(rows)
        kept.rows += n
    kept.keep_last(limit)
    return kept

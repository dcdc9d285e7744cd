"""A decided step into a `Session`: the one code that feeds a `StepRecord` to a session, whoever holds
it (the verify lane's driver, the orchestrator live and in a replay after a restart), so every
session fed the same records holds the same tokens and text, and agrees on the end."""

from __future__ import annotations

from pipeline.decoding.drafters.kinds import paid_per_draft
from pipeline.decoding.session import Session
from pipeline.protocol.messages import StepRecord


def apply(session: Session, record: StepRecord) -> str:
    """Feed `record` to `session`; returns the text it releases."""
    if record.step == 0:
        return session.start(record.tokens[0], record.logprobs)
    return session.record(
        record.drafted, record.tokens, record.accepted, record.draft_seconds, record.verify_seconds,
        depth=record.depth, offered=record.offered, drafter=record.drafter,
        paid_drafts=record.drafted if paid_per_draft(record.drafter) else 0, logprobs=record.logprobs,
    )  # fmt: skip

"""A decided step's times are its own: `verify_seconds` is the forward that verified it, and
`draft_seconds` the wait for its proposal, never the forward before it. The controller prices rows
with these times (`decoding/adaptive.py`), so a forward's time booked as drafting would have it
believe verification free and drafts dear."""

from __future__ import annotations

import pytest

from pipeline.decoding.sampling import SamplingParams
from pipeline.model import Model
from pipeline.protocol.messages import Decided, StepRecord

from .orchestration_harness import World
from .tinymodel import TinySpec, write_tiny_gguf

FORWARD = 0.005  # each forward, on the World's clock; a message takes 0.001 on its way


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("times") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=1.2))
    return Model.load(path)


@pytest.mark.parametrize(
    ("drafter", "in_verify_lane"),
    [("none", True), ("ngram", True), ("ngram", False)],
    ids=["none", "ngram-in-the-verify-lane", "ngram-in-the-draft-lane"],
)
def test_verify_time_is_the_forward_and_draft_time_the_wait_for_drafts(model, drafter, in_verify_lane):
    """Drafted in the verify lane, a proposal is ready on the lane's clock when asked for (the World's
    clock does not move while a drafter runs); from the draft lane, it waits for two messages."""
    world = (
        World(model, forward_seconds=FORWARD)
        if in_verify_lane
        else World.paced(model, forward_seconds=FORWARD)
    )
    world.up()
    records: list[StepRecord] = []
    on_burst = world.hub.on_burst

    def kept(messages, now):
        records.extend(m.record for m in messages if isinstance(m, Decided) and m.record is not None)
        return on_burst(messages, now)

    world.hub.on_burst = kept  # type: ignore[method-assign]
    request = world.submit("ab ab ab ab cd cd ab ab", params=SamplingParams(max_tokens=24, ignore_eos=True),
                           drafter=drafter)  # fmt: skip
    world.run()
    assert world.result(request) is not None
    steps = [r for r in records if r.step > 0]
    assert steps and all(r.verify_seconds == pytest.approx(FORWARD) for r in steps)
    # A proposal's wait is the messages' time to and from the draft lane (none for `none`), never a forward.
    assert all(r.draft_seconds < FORWARD for r in steps)
    if drafter == "ngram":
        assert any(r.drafted for r in steps)
        assert all((r.draft_seconds == 0) == in_verify_lane for r in steps if r.drafted)

"""The draft lane's telemetry: a "draft" span per run of up to STEPS_PER_SPAN of a request's draft
steps, an event per step, ended with the run's totals when full and when the request closes."""

from __future__ import annotations

import pytest

from pipeline.decoding.sampling import SamplingParams
from pipeline.model import Model
from pipeline.workers.step_spans import STEPS_PER_SPAN

from .orchestration_harness import World
from .tinymodel import TinySpec, write_tiny_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("draft-spans") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=1.2, context=2048))
    return Model.load(path)


def test_a_span_per_run_of_draft_steps_with_an_event_each(model):
    world = World(model)
    world.up()
    # k fixed: every step asks the draft lane (the controller would stop asking where the harness's
    # clock makes a proposal's wait look dear)
    request = world.submit("ab ab ab ab cd cd ab ab", params=SamplingParams(max_tokens=900, ignore_eos=True),
                           drafter="ngram", k=4)  # fmt: skip
    world.run()
    assert world.result(request) is not None
    server = world.drafter_server("ngram")  # the verify lane's own
    spans = server.lane.telemetry.spans("draft")  # type: ignore[attr-defined]
    events = [dict(e.attributes) for s in spans for e in s.events if e.name == "step"]
    steps = [int(e["speclanes.step"]) for e in events]
    assert len(steps) > STEPS_PER_SPAN and steps == sorted(set(steps))  # every step once, in order
    assert len(spans) == -(-len(steps) // STEPS_PER_SPAN)  # all ended: full, or at the request's close
    assert all(dict(s.attributes)["speclanes.request_id"] == request for s in spans)
    assert sum(int(dict(s.attributes)["speclanes.drafted"]) for s in spans) == sum(
        int(e.get("speclanes.drafted", 0)) for e in events
    )
    assert not server.spans.open

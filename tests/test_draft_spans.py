"""The draft lane's telemetry: a "draft" span per run of up to STEPS_PER_SPAN of a request's draft
steps, each step's figures in its columns, ended with the run's totals when full and when the request
closes."""

from __future__ import annotations

import pytest

from pipeline.decoding.sampling import SamplingParams
from pipeline.model import Model
from pipeline.workers.step_spans import STEPS_PER_SPAN

from .orchestration_harness import World
from .telemetry_harness import steps_of
from .tinymodel import TinySpec, write_tiny_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("draft-spans") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=1.2, context=2048))
    return Model.load(path)


def test_a_span_per_run_of_draft_steps_with_each_step_in_its_columns(model):
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
    rows = [row for s in spans for row in steps_of(s.attributes)]
    steps = [row["number"] for row in rows]
    assert len(steps) > STEPS_PER_SPAN and steps == sorted(set(steps))  # every step once, in order
    assert len(spans) == -(-len(steps) // STEPS_PER_SPAN)  # all ended: full, or at the request's close
    assert all(dict(s.attributes)["speclanes.request_id"] == request for s in spans)
    drafted = sum(row["drafted"] for row in rows)
    assert sum(int(dict(s.attributes)["speclanes.drafted"]) for s in spans) == drafted
    assert {row["drafter"] for row in rows} == {"ngram"} and {row["failed"] for row in rows} == {""}
    assert max(row["k"] for row in rows) == 4 and any(row["drafted"] for row in rows)
    for span in spans:  # each step's start, from the span's, in order
        starts = [row["start_us"] for row in steps_of(span.attributes)]
        assert starts[0] == 0 and starts == sorted(starts)
    assert not server.spans.open

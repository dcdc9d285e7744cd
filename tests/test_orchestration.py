"""The orchestrator's core, whole requests at a time, with no processes and no sockets
(tests/orchestration_harness.py): steps, faults, lane restarts, resume, cancel, the audit
outbox and admission. Outputs are compared with the in-process decoder, token for token."""

from __future__ import annotations

import math

import msgspec
import pytest

from pipeline.decoding.decided import ACCEPTED, PLAIN
from pipeline.decoding.drafters import NoDraftSource
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Model
from pipeline.model.prompts import prompt_tokens
from pipeline.orchestration.effects import Send
from pipeline.orchestration.front import unknown
from pipeline.protocol.config import Config
from pipeline.protocol.messages import (
    BadMessage,
    Chunks,
    ClientRequest,
    Close,
    Codec,
    Decided,
    Drafted,
    DraftRequest,
    ErrorReply,
    Open,
    RequestOpened,
    Rows,
    Shutdown,
    SpeculativeEvent,
    StepEvent,
    StepFailed,
    StepRecord,
    Submit,
)
from pipeline.workers.driver import DraftLane
from pipeline.workers.verifier import IDLE_SECONDS

from .orchestration_harness import World
from .tinymodel import TinySpec, write_tiny_gguf

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=77, max_tokens=24, ignore_eos=True)
PROMPT = "ab ab ab ab cd cd"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("orchestration") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=1.2))
    return Model.load(path)


@pytest.fixture
def world(model) -> World:
    w = World(model)
    w.up()
    return w


@pytest.fixture
def paced_world(model) -> World:
    """Drafting in the draft lane (`run.draft_in_verify_lane` false): each step's proposal is a
    delivery of its own, so a request has a middle to lose or time out a message in, and the
    draft lane's faults can be staged."""
    w = World.paced(model)
    w.up()
    return w


def reference(model: Model, params: SamplingParams, drafter: str = "none", k: int | None = 4) -> Result:
    assert model.tokenizer is not None
    source = NgramSource() if drafter == "ngram" else NoDraftSource()
    tokens = prompt_tokens(model.tokenizer, PROMPT, chat=False, messages=None)
    return decode(model, tokens, params, source, k=0 if drafter == "none" else k)


def finished(world: World, request_id: str) -> Result:
    world.run()
    result = world.result(request_id)
    assert result is not None, "the request did not finish"
    return result


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_a_request_gives_the_in_process_tokens(world, model, params, drafter):
    request_id = world.submit(PROMPT, params=params, drafter=drafter, k=4)
    result = finished(world, request_id)
    want = reference(model, params, drafter)
    assert result.tokens == want.tokens and result.text == want.text
    assert result.finish_reason == "length" and result.request_id == request_id
    assert result.stats.steps == want.stats.steps and result.stats.accepted == want.stats.accepted
    chunks = world.hub.front.chunks(request_id, -1, world.secrets[request_id])
    assert isinstance(chunks, Chunks) and [t for c in chunks.chunks for t in c.tokens] == want.tokens
    assert [c.seq for c in chunks.chunks] == list(range(len(chunks.chunks)))
    decided = "".join(c.decided for c in chunks.chunks)
    assert len(decided) == len(want.tokens) and decided[0] == PLAIN  # the prefill's token
    # Every step serves one token of the target's own (plain, corrected or bonus) after its accepted drafts.
    assert len(decided) - decided.count(ACCEPTED) == result.stats.steps + 1
    assert decided.count(ACCEPTED) == result.stats.accepted
    if drafter == "ngram":
        assert result.stats.drafted > 0
    else:
        assert decided == PLAIN * len(decided)


def test_every_step_and_the_summary_reach_the_audit_trail_once(world):
    request_id = world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4)
    result = finished(world, request_id)
    events = [e for e in world.audited.values() if e.request_id == request_id]
    steps = sorted(e.step for e in events if isinstance(e, StepEvent))
    assert steps == list(range(result.stats.steps + 1))  # the prefill is step 0
    assert sum(isinstance(e, RequestOpened) for e in events) == 1
    (summary,) = [e for e in events if isinstance(e, SpeculativeEvent)]
    assert summary.tokens == result.tokens and summary.iterations == result.stats.steps
    assert len(world.hub.ledger.outbox) == 0  # every event acknowledged


def test_a_draft_lane_that_dies_turns_steps_into_plain_decoding(world, model):
    request_id = world.submit(PROMPT, params=SEEDED, drafter="ngram", k=4)
    world.run(until=6)
    world.down("draft")
    result = finished(world, request_id)
    assert result.tokens == reference(model, SEEDED, "none").tokens  # seeded: the same stream either way
    assert "draft" in world.faults("lane_down")
    assert not any(isinstance(s.message, DraftRequest) for s in world.sent[len(world.sent) - 10 :])


def test_a_failed_draft_lane_leaves_plain_decoding_and_says_why_once(world, model):
    request_id = world.submit(PROMPT, params=SEEDED, drafter="ngram", k=4)
    world.run(until=6)
    world.fail("draft", "OSError: no such drafter file")
    world.fail("draft", "OSError: no such drafter file")  # announced again: nothing new happens
    assert finished(world, request_id).tokens == reference(model, SEEDED, "none").tokens
    draft = world.hub.status().lane("draft")
    assert (draft.state, draft.reason) == ("failed", "OSError: no such drafter file")
    assert world.faults("lane_failed") == ["draft"] and world.faults("lane_down") == []
    fault = next(f for f in world.hub.ledger.faults if f.kind == "lane_failed")
    assert (
        fault.message == f"pid {world.pids['draft']} exited with 1, 5 restarts: OSError: no such drafter file"
    )
    sent = len(world.sent)
    second = world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4)
    world.tick(1.0)
    assert finished(world, second).tokens == reference(model, GREEDY).tokens
    assert not any(isinstance(s.message, DraftRequest) for s in world.sent[sent:])


def test_a_failed_audit_lane_leaves_its_events_in_the_outbox_and_requests_serving(world, model):
    world.run()  # what was sent before the failure
    world.fail("audit")
    before, sent = len(world.hub.ledger.outbox), len(world.sent)
    request_id = world.submit(PROMPT, params=GREEDY)
    world.tick(world.config.audit.resend_after + 0.1)
    assert finished(world, request_id).tokens == reference(model, GREEDY).tokens
    world.tick(world.config.audit.resend_after + 0.1)
    world.run()
    report = world.hub.status()
    assert report.audit_pending == len(world.hub.ledger.outbox) > before  # held, never sent to a failed lane
    assert not any(s.lane == "audit" for s in world.sent[sent:])
    assert world.faults("lane_failed") == ["audit"]


def test_a_drafter_that_runs_no_draft_model_drafts_in_the_verify_lane(world, model):
    """With `run.draft_in_verify_lane` (the default), an n-gram request's proposals are made beside the
    target: no DraftRequest leaves the verify lane, its steps still draft, its tokens are plain
    decoding's, and its drafter there is closed with it."""
    request_id = world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4)
    result = finished(world, request_id)
    assert result.tokens == reference(model, GREEDY).tokens and result.stats.drafted > 0
    assert not any(isinstance(s.message, DraftRequest) for s in world.sent)
    assert world.core.local is not None and not world.core.local.active


@pytest.mark.parametrize("in_verify_lane", [True, False], ids=["verify-lane", "draft-lane"])
def test_a_draft_lane_that_is_down_costs_only_its_own_drafters_their_drafts(model, in_verify_lane):
    """Its socket not connected and its proposals late: steps that would ask it go plain, while a
    drafter the verify lane runs itself drafts on."""
    world = World(model) if in_verify_lane else World.paced(model)
    world.up()
    world.core.draft_lane.connected, world.core.draft_lane.slow_until = False, math.inf
    result = finished(world, world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4))
    assert result.tokens == reference(model, GREEDY).tokens
    assert (result.stats.drafted > 0) == in_verify_lane


class RaisingSource:
    """An n-gram source whose drafters raise when asked for a proposal."""

    name = "ngram"

    def start(self, prompt, params, seed):
        drafter = NgramSource().start(prompt, params, seed)
        drafter.propose = lambda *args, **kwargs: 1 / 0
        return drafter


@pytest.mark.parametrize("in_verify_lane", [True, False], ids=["verify-lane", "draft-lane"])
def test_a_drafter_that_raises_costs_its_steps_their_drafts_never_the_request(model, in_verify_lane):
    """Wherever it runs, a drafter that raises is reported, and each step it fails decodes plainly:
    the request ends with plain decoding's tokens and no error."""
    world = World(model, config=msgspec.convert({"run": {"draft_in_verify_lane": in_verify_lane}}, Config))
    world.up()
    server = world.core.local if in_verify_lane else world.drafts
    assert server is not None
    server.sources["ngram"] = RaisingSource()  # type: ignore[assignment]
    result = finished(world, world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4))
    assert result.tokens == reference(model, GREEDY).tokens and result.stats.drafted == 0
    assert {kind for kind, *_ in server.lane.faults} == {"draft_failed"}  # type: ignore[attr-defined]


def test_only_a_draft_s_failure_is_taken_from_the_verify_lane_s_socket(world, model):
    """A StepFailed there can only answer a draft: one for other work is refused and reported, and the
    request it names goes on undisturbed."""
    request_id = world.submit(PROMPT, params=GREEDY)
    forged = StepFailed(request_id=request_id, step=1, origin="verify", kind="draft_failed", message="no")
    world.feed([Send("verify", forged)])
    assert finished(world, request_id).tokens == reference(model, GREEDY).tokens
    assert [kind for kind, *_ in world.verifier.lane.faults] == ["bad_request"]


def test_a_draft_that_times_out_is_skipped_for_a_while(paced_world, model):
    world = paced_world
    world.lost.add("draft")
    request_id = world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4)
    world.run()
    assert world.result(request_id) is None  # waiting for a draft that will never come
    world.tick(world.config.timeouts.draft + 0.01)
    result = finished(world, request_id)
    assert result.tokens == reference(model, GREEDY).tokens
    assert [fault[0] for fault in world.verifier.lane.faults] == ["timeout"]  # the verify lane saw it
    drafts = [s for s in world.sent if isinstance(s.message, DraftRequest)]
    assert len(drafts) == 1  # slow: no more drafting for a while
    world.lost.clear()
    world.tick(DraftLane.SLOW_SECONDS)
    second = world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4)
    assert finished(world, second).stats.drafted > 0


def test_draft_rows_that_do_not_fit_their_shape_cost_that_step_its_drafts_only(paced_world, model):
    world = paced_world
    world.lost.add("draft")
    request_id = world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4)
    world.run()  # until the first draft request, which is lost
    world.lost.clear()
    pending = world.core.drivers[request_id].pending
    assert isinstance(pending, DraftRequest), pending
    torn = Rows((2, model.cfg.vocab_size), b"\x00" * 12)
    drafted = Drafted(
        request_id=request_id, step=pending.step, tokens=[5, 6], probs=torn, drafter="ng", seconds=0
    )
    world.feed([Send("verify", drafted)])
    assert finished(world, request_id).tokens == reference(model, GREEDY).tokens
    (event,) = [e for e in world.audited.values() if isinstance(e, StepEvent) and e.step == pending.step]
    assert event.drafted == [] and event.request_id == request_id
    assert [fault[0] for fault in world.verifier.lane.faults] == ["bad_request"]


def test_a_verify_lane_restart_reprimes_and_the_output_is_undisturbed(world, model):
    request_id = world.submit(PROMPT, params=SEEDED, drafter="ngram", k=4)
    world.run(until=12)
    world.down("verify")  # the new verifier knows nothing of the request
    world.run()
    assert world.result(request_id) is None  # waits for the lane
    world.up("verify")
    result = finished(world, request_id)
    assert result.tokens == reference(model, SEEDED, "ngram").tokens
    reprimes = [s.message for s in world.sent if isinstance(s.message, Open) and not s.message.sample]
    assert len(reprimes) == 1 and reprimes[0].draws > 0
    assert "verify" in world.faults("lane_down")


def test_a_lost_verify_step_is_sent_again_after_the_timeout(paced_world, model):
    world = paced_world
    request_id = world.submit(PROMPT, params=GREEDY)
    world.run(until=8)
    world.lost.add("verify")
    world.run()
    world.lost.clear()
    world.tick(world.config.timeouts.verify + 0.01)
    result = finished(world, request_id)
    assert result.tokens == reference(model, GREEDY).tokens
    assert world.faults("timeout") == ["verify"]


def test_the_verify_lane_runs_at_most_run_ahead_steps_past_the_journal(world, model):
    """With the orchestrator deaf (its inbox drops everything), the lane decides `run.run_ahead` steps
    past the last journaled one and holds there; once the journal catches up it goes on."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    request_id = world.submit(PROMPT, params=params)
    world.run(until=3)
    journaled = world.hub.front.machine(request_id).step
    world.orchestrator_dead = True
    world.run()
    driver = world.core.drivers[request_id]
    assert driver.held and driver.step - driver.journaled == world.config.run.run_ahead
    assert driver.journaled == journaled and world.hub.front.machine(request_id).step == journaled
    world.orchestrator_dead = False
    world.tick(2 * world.config.timeouts.verify)  # nothing came: the orchestrator re-primes
    result = finished(world, request_id)
    assert (
        result.tokens
        == decode(
            model,
            prompt_tokens(model.tokenizer, PROMPT, chat=False, messages=None),
            params,
            NoDraftSource(),
            k=0,
        ).tokens
    )


def test_a_request_nobody_hears_of_leaves_the_verify_lane_driver_and_all(world, model):
    request_id = world.submit(PROMPT, params=SamplingParams(max_tokens=40, ignore_eos=True))
    world.run(until=3)
    world.orchestrator_dead = True  # its driver holds at run_ahead, and nobody closes it
    world.run()
    assert world.core.drivers[request_id].held
    world.core.verifier.requests[request_id].seen -= IDLE_SECONDS + 1
    world.core.expire()
    assert request_id not in world.core.drivers and request_id not in world.core.verifier.requests


def test_steps_of_a_driver_started_from_an_earlier_open_are_ignored(world, model, tmp_path):
    """After an orchestrator restart, steps its predecessor's verify-lane driver decided may still
    arrive (they sat in a socket). They may cut the same tokens into other steps, so only steps of the
    driver started from the new orchestrator's Open count: here a forged one with other tokens."""
    world = World(model, journal_path=str(tmp_path / "journal.sqlite"))
    world.up()
    request_id = world.submit(PROMPT, params=SEEDED, drafter="ngram", k=4)
    world.run(until=6)
    world.orchestrator_killed(deliver_in_flight=False)
    machine = world.hub.front.machine(request_id)
    stale = Decided(
        request_id=request_id, step=machine.step + 1, epoch=machine.pending_epoch + 1,
        record=StepRecord(machine.step + 1, 0, [1, 2, 3], 0, 0.0, 0.0, machine.draws + 3),
    )  # fmt: skip
    world.reply(stale)
    assert world.hub.front.machine(request_id).step == machine.step  # ignored
    result = finished(world, request_id)
    assert result.tokens == reference(model, SEEDED, "ngram").tokens


def test_a_lost_decided_step_is_a_gap_the_orchestrator_reprimes_over(world, model):
    request_id = world.submit(PROMPT, params=SEEDED, drafter="ngram", k=4)
    original, seen = world.reply, []

    def lose_the_fourth(message):
        if isinstance(message, Decided):
            seen.append(message)
            if len(seen) == 4:
                return
        original(message)

    world.reply = lose_the_fourth
    result = finished(world, request_id)
    assert result.tokens == reference(model, SEEDED, "ngram").tokens
    assert world.faults("timeout") == ["verify"]  # the gap, noticed at the next step
    reprimes = [s.message for s in world.sent if isinstance(s.message, Open) and not s.message.sample]
    assert len(reprimes) == 1 and reprimes[0].history and reprimes[0].step == 2


def test_late_and_repeated_replies_change_nothing(world, model):
    request_id = world.submit(PROMPT, params=GREEDY)
    replies = []
    original = world.reply

    def record_and_repeat(message):
        replies.append(message)
        original(message)
        original(message)  # every reply arrives twice

    world.reply = record_and_repeat  # type: ignore[method-assign]
    result = finished(world, request_id)
    for reply in replies:  # and once more, after the end
        original(reply)
    world.run()
    assert result.tokens == reference(model, GREEDY).tokens
    assert world.result(request_id) == result


def test_a_verify_failure_ends_the_request_with_an_error_result(world):
    request_id = world.submit(PROMPT, params=GREEDY)
    world.run(until=2)
    world.lost.add("verify")
    world.run()
    step = world.hub.front.machine(request_id).step + 1
    world.reply(
        StepFailed(request_id=request_id, step=step, origin="verify", kind="bad_request", message="bad")
    )
    result = world.result(request_id)
    assert result is not None and result.finish_reason == "error"
    assert result.error is not None and (result.error.kind, result.error.message) == ("bad_request", "bad")
    closes = [s.lane for s in world.in_flight if isinstance(s.message, Close)]
    assert closes == ["verify"]  # the verify lane's driver frees the draft lane's state


def test_cancel_ends_the_request_frees_the_lanes_and_keeps_its_chunks(world):
    request_id = world.submit(PROMPT, params=SamplingParams(max_tokens=500, ignore_eos=True))
    world.run(until=10)
    reply, sends = world.hub.cancel(request_id, world.secrets[request_id], world.now)
    world.feed(sends)
    world.run()
    result = world.result(request_id)
    assert isinstance(reply, Chunks) and reply.done == result
    assert result is not None and result.finish_reason == "cancelled" and 0 < len(result.tokens) < 500
    assert request_id not in world.verifier.requests and request_id not in world.drafts.active
    again = world.hub.cancel(request_id, world.secrets[request_id], world.now)
    assert again[1] == []  # cancelling again does nothing


def test_a_client_resumes_after_any_chunk_until_the_retention_time(world):
    request_id = world.submit(PROMPT, params=GREEDY)
    result = finished(world, request_id)
    front = world.hub.front
    whole = front.chunks(request_id, -1, world.secrets[request_id])
    assert isinstance(whole, Chunks) and whole.done == result
    for after in range(len(whole.chunks)):
        rest = front.chunks(request_id, after, world.secrets[request_id])
        assert isinstance(rest, Chunks) and rest.chunks == whole.chunks[after + 1 :] and rest.done == result
    world.tick(world.config.timeouts.retain + 1)
    assert isinstance(front.chunks(request_id, -1, world.secrets[request_id]), ErrorReply)


def test_finished_requests_beyond_the_retention_cap_go_oldest_first(model, tmp_path):
    config = msgspec.structs.replace(
        Config(), admission=msgspec.structs.replace(Config().admission, max_retained=2)
    )
    world = World(model, config=config, journal_path=str(tmp_path / "journal.sqlite"))
    world.up()
    ids = []
    for _ in range(4):
        ids.append(world.submit(PROMPT, params=SamplingParams(max_tokens=3, ignore_eos=True)))
        finished(world, ids[-1])
        world.tick(0.1)
    assert sorted(world.hub.front.requests) == sorted(ids[2:])  # the two newest are kept
    assert [r.opened.request_id for r in world.hub.journal.recover().requests] == ids[2:]
    assert isinstance(world.hub.front.chunks(ids[0], -1, world.secrets[ids[0]]), ErrorReply)


def test_a_request_nobody_polls_is_cancelled(world):
    request_id = world.submit(PROMPT, params=SamplingParams(max_tokens=500, ignore_eos=True))
    world.run(until=6)
    world.hub.front.poll_begins(request_id)  # a long poll in progress keeps it alive
    world.tick(world.config.timeouts.client_idle + 1)
    assert world.result(request_id) is None
    world.hub.front.poll_ends(request_id, world.now)
    world.tick(world.config.timeouts.client_idle + 1)
    result = world.result(request_id)
    assert result is not None and result.finish_reason == "cancelled"


def test_a_request_waits_for_a_verify_lane_that_is_not_up_yet(model):
    world = World(model)
    world.up("draft", "audit", "orchestrator")
    request_id = world.submit(PROMPT, params=GREEDY)
    assert not world.in_flight or all(s.lane == "audit" for s in world.in_flight)
    world.run()
    world.up("verify")
    assert finished(world, request_id).tokens == reference(model, GREEDY).tokens
    assert len(world.telemetry.spans("queue")) == 1


def test_audit_events_wait_for_the_audit_lane_and_unacknowledged_ones_are_sent_again(model):
    world = World(model, msgspec.convert({"audit": {"snapshot_seconds": 0}}, Config))  # no lane snapshots
    world.up("verify", "draft", "orchestrator")
    request_id = world.submit(PROMPT, params=GREEDY)
    finished(world, request_id)
    held = len(world.hub.ledger.outbox)
    assert held > 0 and not world.audited
    world.lost.add("audit")
    world.up("audit")
    world.run()
    assert len(world.hub.ledger.outbox) == held  # sent, lost, not acknowledged
    world.lost.clear()
    world.tick(world.config.audit.resend_after + 0.01)
    world.run()
    assert len(world.hub.ledger.outbox) == 0 and len(world.audited) == held
    world.down("audit")  # a restarted audit lane gets nothing twice: all was acknowledged
    world.up("audit")
    world.run()
    assert len(world.audited) == held + 1  # only the audit lane's own lane_down fault


def test_max_iterations_ends_the_request_with_that_fault(world):
    # Plain steps: with drafts, three steps may already reach max_tokens (the shared suffix cache
    # has learnt this prompt from the module's earlier requests), and the request ends on `length`.
    request_id = world.submit(PROMPT, params=GREEDY, max_iterations=3, drafter="none")
    result = finished(world, request_id)
    assert result.finish_reason == "max_iterations_exceeded" and result.stats.steps == 3
    assert world.faults("max_iterations_exceeded") == ["orchestrator"]


@pytest.mark.parametrize(
    ("fields", "kind", "words"),
    [
        ({"drafter": "oracle"}, "bad_request", "drafter 'oracle'"),
        ({"k": 33}, "bad_request", "k must be 0..32"),
        ({"max_iterations": 0}, "bad_request", "max_iterations must be >= 1"),
        ({"drafter": "model"}, "bad_request", "model.draft_path"),
        ({"drafter": "learned"}, "bad_request", "model.draft_head"),
        ({"prompt": ""}, "bad_request", "empty"),
        ({"prompt": "ab " * 400}, "prompt_too_long", "context"),
        ({"messages": [{"role": "user"}]}, "bad_request", "cannot build the prompt"),
    ],
)
def test_admission_refuses_with_the_rule_that_failed(world, fields, kind, words):
    submit = msgspec.structs.replace(Submit(prompt=PROMPT), **fields)
    reply, sends = world.hub.submit(submit, world.now)
    assert isinstance(reply, ErrorReply) and reply.kind == kind and words in reply.message, reply
    assert sends == [] and not world.hub.front.requests


def test_after_a_shutdown_notice_nothing_new_is_admitted(world):
    running = world.submit(PROMPT, params=GREEDY)
    world.feed(world.hub.on_control(Shutdown(reason="SIGTERM"), world.now))
    reply, _ = world.hub.submit(Submit(prompt=PROMPT), world.now)
    assert isinstance(reply, ErrorReply) and reply.kind == "draining" and "SIGTERM" in reply.message
    assert finished(world, running).finish_reason == "length"  # what was admitted still finishes


def test_when_the_drain_window_ends_the_unfinished_end_with_server_shutdown_and_are_not_resumed(world):
    """SIGTERM with a window: what finishes in time finishes; when the window ends, the rest end
    with a server_shutdown error their clients receive, counted in the status, and journaled as
    finished, so a restarted orchestrator (the next start) resumes none of them."""
    short = world.submit(PROMPT, params=GREEDY)
    long = world.submit(PROMPT, params=SamplingParams(max_tokens=5000, ignore_eos=True))
    world.feed(world.hub.on_control(Shutdown(reason="SIGTERM", drain_seconds=2.0), world.now))
    for _ in range(10_000):  # deliveries, until the short one is done (the long one goes on)
        if world.result(short) is not None:
            break
        world.run(until=1)
    assert world.result(short).finish_reason == "length" and world.result(long) is None
    world.run(until=20)  # the long one decodes on
    world.tick(1.0)
    assert world.result(long) is None  # the window is still open
    world.tick(1.5)
    ended = world.result(long)
    assert ended.finish_reason == "server_shutdown" and ended.tokens  # what it had, with its usage
    report = world.hub.status()
    assert (report.active_requests, report.ended_at_shutdown, report.closing) == (0, 1, "SIGTERM")
    recovered = world.hub.journal.recover()
    finished_in_journal = {r.opened.request_id: r.result is not None for r in recovered.requests}
    assert finished_in_journal == {short: True, long: True}


def test_status_reports_lanes_requests_and_faults(world):
    world.submit(PROMPT, params=SamplingParams(max_tokens=500, ignore_eos=True))
    world.run(until=5)
    world.down("draft")
    report = world.hub.status()
    states = {lane.name: lane.state for lane in report.lanes}
    assert states == {"verify": "up", "draft": "down", "audit": "up", "orchestrator": "up"}
    assert report.active_requests == 1 and [f.kind for f in report.faults] == ["lane_down"]


def test_the_config_default_speculation_applies_when_a_request_names_none(model):
    world = World(model, msgspec.convert({"speculation": {"drafter": "none"}}, Config))
    world.up()
    request_id = world.submit(PROMPT, params=GREEDY)
    result = finished(world, request_id)
    assert result.stats.drafter == "none" and result.stats.drafted == 0


def test_a_huge_max_tokens_reserves_only_a_bounded_cache_up_front(world):
    request_id = world.submit(PROMPT, params=SamplingParams(max_tokens=10**9, ignore_eos=True))
    machine = world.hub.front.machine(request_id)
    opening = next(s.message for s in world.in_flight if isinstance(s.message, Open))
    assert opening.capacity <= len(machine.session.prompt_tokens) + 256 + 17
    world.run(until=40)
    world.feed(world.hub.cancel(request_id, world.secrets[request_id], world.now)[1])
    world.run()
    assert world.result(request_id).finish_reason == "cancelled"


def test_a_lane_that_stops_beating_is_not_counted_as_up_until_it_beats_again(world, model):
    request_id = world.submit(PROMPT, params=SamplingParams(max_tokens=500, ignore_eos=True))
    world.run(until=10)
    world.beating.discard("verify")  # SIGSTOPped: it neither beats nor answers
    world.lost.add("verify")
    world.run()
    world.tick(world.config.restart.hang_seconds + 0.1)
    states = {lane.name: lane.state for lane in world.hub.status().lanes}
    assert states["verify"] == "stalled" and states["draft"] == "up"
    assert world.faults("timeout") == ["verify"]
    world.down("verify")  # the supervisor kills it; a new one comes up and is re-primed
    world.lost.clear()
    world.up("verify")
    world.run(until=200)
    world.feed(world.hub.cancel(request_id, world.secrets[request_id], world.now)[1])
    world.run()
    result = world.result(request_id)
    assert (
        result is not None
        and result.tokens
        == reference(model, SamplingParams(max_tokens=500, ignore_eos=True)).tokens[: len(result.tokens)]
    )


# --- the orchestrator's own death: the journal ---------------------------------------------


def read_all(world: World, request_id: str, after: int = -1) -> tuple[list, Result | None]:
    reply = world.hub.front.chunks(request_id, after, world.secrets[request_id])
    assert isinstance(reply, Chunks), reply
    return list(reply.chunks), reply.done


@pytest.mark.parametrize("deliver_in_flight", [True, False], ids=["sent", "lost"])
@pytest.mark.parametrize("deliveries", [1, 7, 40])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_restarted_orchestrator_carries_on_every_request_from_its_journal(
    model, tmp_path, params, deliveries, deliver_in_flight
):
    """Killed anywhere (before the first token, mid-stream; with its last messages delivered to
    the lanes or not): the clients' streams continue from the last chunk they saw, with nothing
    lost or repeated, and every request ends as an undisturbed run does."""
    world = World(model, journal_path=str(tmp_path / "journal.sqlite"))
    world.up()
    ids = [world.submit(PROMPT, params=params, drafter=drafter, k=4) for drafter in ("ngram", "none")]
    world.run(until=deliveries)
    seen = {request_id: read_all(world, request_id)[0] for request_id in ids}
    world.orchestrator_killed(deliver_in_flight)
    world.run()
    for request_id, drafter in zip(ids, ("ngram", "none"), strict=True):
        after = seen[request_id][-1].seq if seen[request_id] else -1
        rest, done = read_all(world, request_id, after)
        chunks = seen[request_id] + rest
        want = reference(model, params, drafter)
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert [t for c in chunks for t in c.tokens] == want.tokens
        assert "".join(c.text for c in chunks) == want.text
        assert done is not None and done.tokens == want.tokens and done.finish_reason == "length"
        # The whole audit trail: every step once, whoever recorded it.
        steps = sorted(
            e.step for e in world.audited.values() if isinstance(e, StepEvent) and e.request_id == request_id
        )
        assert steps == list(range(done.stats.steps + 1))


def test_a_finished_request_stays_resumable_and_faults_and_totals_survive_a_restart(model, tmp_path):
    world = World(model, journal_path=str(tmp_path / "journal.sqlite"))
    world.up()
    request_id = world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4)
    world.down("draft")
    world.up("draft")
    before = finished(world, request_id)
    faults, totals = list(world.hub.ledger.faults), world.hub.ledger.totals
    world.orchestrator_killed(deliver_in_flight=True)
    chunks, done = read_all(world, request_id)
    assert done == before and [t for c in chunks for t in c.tokens] == before.tokens
    assert list(world.hub.ledger.faults) == faults and world.hub.ledger.totals == totals and totals.runs == 1
    world.run()  # the recovered finished request only frees the lanes (again)
    assert request_id not in world.verifier.requests


def test_audit_events_not_yet_acknowledged_survive_the_orchestrator(model, tmp_path):
    world = World(model, journal_path=str(tmp_path / "journal.sqlite"))
    world.up()
    world.lost.add("audit")  # the audit lane takes nothing: every event stays in the outbox
    request_id = world.submit(PROMPT, params=GREEDY, drafter="ngram", k=4)
    done = finished(world, request_id)
    pending = set(world.hub.ledger.outbox.pending)
    assert len(pending) >= done.stats.steps + 3 and not world.audited
    world.orchestrator_killed(deliver_in_flight=False)
    world.lost.discard("audit")
    assert pending <= set(world.hub.ledger.outbox.pending)  # with the new process's lane snapshots
    world.tick(world.config.audit.resend_after + 0.1)
    world.run()
    assert len(world.hub.ledger.outbox) == 0
    steps = sorted(e.step for e in world.audited.values() if isinstance(e, StepEvent))
    assert steps == list(range(done.stats.steps + 1))


def test_the_audit_outbox_is_bounded_by_refusing_new_requests(model):
    # Room for the lanes' first snapshots and one request's opening; not for its steps.
    config = msgspec.structs.replace(Config(), audit=msgspec.structs.replace(Config().audit, max_pending=8))
    world = World(model, config=config)
    world.up()
    world.lost.add("audit")
    request_id = world.submit(PROMPT, params=GREEDY, drafter="none")
    finished(world, request_id)  # a running request's events still wait in the outbox: none dropped
    reply, sends = world.hub.submit(Submit(prompt=PROMPT, params=GREEDY), world.now)
    assert (
        isinstance(reply, ErrorReply) and reply.kind == "overloaded" and "audit.max_pending" in reply.message
    )
    assert sends == [] and len(world.hub.ledger.outbox) > 8


def test_only_the_submitter_reads_or_cancels_a_request(world):
    request_id = world.submit(PROMPT, params=GREEDY)
    for secret in ("", "0" * 32, world.secrets[request_id][:-1]):
        refused = world.hub.front.chunks(request_id, -1, secret)
        assert isinstance(refused, ErrorReply) and refused.kind == "unknown_request"
        assert refused == unknown(request_id)  # the answer for an id never issued: nothing told
        reply, sends = world.hub.cancel(request_id, secret, world.now)
        assert isinstance(reply, ErrorReply) and sends == []
    assert finished(world, request_id).finish_reason == "length"


def test_a_repeated_submit_with_the_same_key_gets_the_same_request(world):
    submit = Submit(prompt=PROMPT, params=GREEDY, idempotency_key="k1")
    first, sends = world.hub.submit(submit, world.now)
    again, more = world.hub.submit(submit, world.now)
    assert first == again and more == [] and len(world.hub.front.requests) == 1
    world.feed(sends)
    other, _ = world.hub.submit(msgspec.structs.replace(submit, idempotency_key="k2"), world.now)
    assert isinstance(other, type(first)) and other.request_id != first.request_id


def test_a_submit_may_ask_for_a_choice_s_id_once(world, model):
    """The gateway's n choices are requests `<base>-<i>` (api/choices.py): the id asked for is the
    request's, in the journal too; one taken, or not of that form, is refused."""
    base = "0123456789abcdef0123456789abcdef"
    request_id = world.submit(PROMPT, params=SEEDED, request_id=f"{base}-1")
    assert request_id == f"{base}-1" and [
        r.opened.request_id for r in world.hub.journal.recover().requests
    ] == [request_id]
    taken, sends = world.hub.submit(Submit(prompt=PROMPT, request_id=request_id), world.now)
    assert (
        isinstance(taken, ErrorReply)
        and taken.kind == "bad_request"
        and "taken" in taken.message
        and not sends
    )
    for bad in (base, f"{base}-", f"{base}-1234", f"{base.upper()}-1", "../x-1"):
        refused = world.hub.admit(Submit(prompt=PROMPT, request_id=bad))
        assert isinstance(refused, ErrorReply) and "request_id" in refused.message, bad
    assert finished(world, request_id).tokens == reference(model, SEEDED).tokens


def test_a_dead_gateway_s_requests_are_cancelled_and_nobody_else_s(world):
    from pipeline.protocol.messages import LaneDown

    mine = world.submit(PROMPT, params=SamplingParams(max_tokens=400, ignore_eos=True), owner="gateway:55")
    other = world.submit(PROMPT, params=GREEDY)
    world.run(until=6)
    world.feed(world.hub.on_control(LaneDown(lane="gateway", pid=55, returncode=-9, restarts=1), world.now))
    world.run()
    assert world.result(mine).finish_reason == "cancelled"
    assert world.result(other).finish_reason == "length"
    assert mine not in world.verifier.requests


def test_after_a_restart_of_everything_a_dead_gateway_s_requests_are_cancelled_when_a_new_one_is_up(
    model, tmp_path
):
    """A supervisor SIGKILL takes every process with it, so no LaneDown ever says the gateway
    died: the restarted orchestrator recovers its requests from the journal. When the new gateway
    (another pid) is up, the requests of the one before it are cancelled; a socket client's are
    not (its own lease, timeouts.client_idle, decides), nor the new gateway's."""
    from pipeline.protocol.messages import Heartbeat, SpeculativeState

    world = World(model, journal_path=str(tmp_path / "journal.sqlite"))
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    old = world.submit(PROMPT, params=params, owner="gateway:55")
    socket_client = world.submit(PROMPT, params=params)
    world.run(until=6)
    world.orchestrator_killed(deliver_in_flight=False)
    assert world.result(old) is None  # recovered, running again
    new = world.submit(PROMPT, params=params, owner="gateway:77")
    world.feed(world.hub.on_control(Heartbeat(lane="gateway", pid=77, state=SpeculativeState()), world.now))
    world.run(until=20)
    assert world.result(old).finish_reason == "cancelled"
    assert world.result(socket_client) is None and world.result(new) is None


# --- admission: tokenizing apart from opening, the running cap and its queue -------------------


def test_admit_is_pure_and_open_begins_what_it_admitted(world, model):
    """The lane tokenizes in a worker thread (`admit`), then opens in its loop: admitting changes
    nothing, and the opened request decodes exactly what `submit` would have."""
    world.run()  # the lanes' first snapshots
    msg, events = Submit(prompt=PROMPT, params=GREEDY), len(world.hub.ledger.outbox)
    admitted = world.hub.admit(msg)
    assert world.hub.admit(msg).tokens == admitted.tokens
    assert not world.hub.front.requests and not world.telemetry.spans() and not world.in_flight
    assert len(world.hub.ledger.outbox) == events and world.hub.status().queued_requests == 0
    reply, sends = world.hub.open(msg, admitted, world.now)
    world.feed(sends)
    assert any(isinstance(s.message, Open) and s.message.tokens == admitted.tokens for s in sends)
    assert finished(world, reply.request_id).tokens == reference(model, GREEDY).tokens


@pytest.mark.parametrize(
    ("field", "msg"),
    [
        ("idempotency_key", Submit(prompt=PROMPT, idempotency_key="k" * 257)),
        ("owner", Submit(prompt=PROMPT, owner="gateway:" + "1" * 300)),
        ("stop", Submit(prompt=PROMPT, params=SamplingParams(stop=tuple("abcdefghijklmnopq")))),
        ("stop string", Submit(prompt=PROMPT, params=SamplingParams(stop=("s" * 1025,)))),
    ],
)
def test_fields_a_request_keeps_are_refused_when_too_large_to_keep(world, field, msg):
    """A finished request is kept for timeouts.retain with its key, owner and stop strings: at near-cap
    sizes, submitting and cancelling such requests would hold megabytes each (test_hostile found it)."""
    reply = world.hub.admit(msg)
    assert isinstance(reply, ErrorReply) and reply.kind == "bad_request"
    assert field in reply.message, reply.message
    at_limit = msgspec.structs.replace(
        msg, idempotency_key="k" * 256, owner="", params=SamplingParams(stop=("s" * 1024,) * 16)
    )
    assert not isinstance(world.hub.admit(at_limit), ErrorReply)


def test_a_shutdown_while_a_prompt_is_tokenized_still_refuses_it(world):
    msg = Submit(prompt=PROMPT, params=GREEDY)
    admitted = world.hub.admit(msg)
    world.feed(world.hub.on_control(Shutdown(reason="SIGTERM"), world.now))
    reply, sends = world.hub.open(msg, admitted, world.now)
    assert isinstance(reply, ErrorReply) and reply.kind == "draining" and sends == []


def capped(model: Model, running: int, queued: int) -> World:
    world = World(
        model, msgspec.convert({"admission": {"max_running": running, "max_queued": queued}}, Config)
    )
    world.up()
    return world


def opened(world: World) -> list[str]:
    """Request ids in the order their prompts went to the verify lane (first Open only)."""
    ids = [s.message.request_id for s in [*world.sent, *world.in_flight] if isinstance(s.message, Open)]
    return list(dict.fromkeys(ids))


def test_beyond_max_running_requests_wait_and_begin_in_arrival_order(model):
    world = capped(model, running=2, queued=3)
    ids = [world.submit(PROMPT, params=GREEDY) for _ in range(5)]
    assert opened(world) == ids[:2]  # the others are admitted, not begun
    report = world.hub.status()
    assert (report.active_requests, report.queued_requests) == (2, 3)
    world.run()
    assert opened(world) == ids  # each began as a place came free, oldest first
    want = reference(model, GREEDY).tokens
    assert all(world.result(i).tokens == want for i in ids)
    report = world.hub.status()
    assert (report.active_requests, report.queued_requests) == (0, 0)


def test_beyond_max_queued_a_request_is_refused_as_overloaded_until_a_place_frees(model):
    world = capped(model, running=1, queued=1)
    first, second = world.submit(PROMPT, params=GREEDY), world.submit(PROMPT, params=GREEDY)
    reply, sends = world.hub.submit(Submit(prompt=PROMPT, params=GREEDY), world.now)
    assert isinstance(reply, ErrorReply) and reply.kind == "overloaded" and sends == []
    assert "1 requests running, 1 waiting" in reply.message and "max_queued = 1" in reply.message
    assert len(world.hub.front.requests) == 2  # the refused one left no trace in the hub
    finished(world, first)
    finished(world, second)
    world.submit(PROMPT, params=GREEDY)  # room again


def test_a_queued_request_can_be_cancelled_and_never_reaches_the_verify_lane(model):
    world = capped(model, running=1, queued=2)
    first, queued, last = (world.submit(PROMPT, params=GREEDY) for _ in range(3))
    reply, _ = world.hub.cancel(queued, world.secrets[queued], world.now)
    assert isinstance(reply, Chunks) and reply.done is not None and reply.done.finish_reason == "cancelled"
    assert world.hub.status().queued_requests == 1
    world.run()
    assert opened(world) == [first, last]
    assert world.result(first).finish_reason == world.result(last).finish_reason == "length"


def test_a_queued_request_nobody_polls_is_cancelled_like_a_running_one(model):
    world = capped(model, running=1, queued=1)
    world.lost.add("verify")  # the running request makes no progress
    running, queued = world.submit(PROMPT, params=GREEDY), world.submit(PROMPT, params=GREEDY)
    world.run()
    world.hub.front.poll_begins(running)  # its client is still there
    world.tick(world.config.timeouts.client_idle + 1)
    assert world.result(queued).finish_reason == "cancelled" and world.result(running) is None
    assert world.hub.status().queued_requests == 0


def test_the_queue_wait_is_the_request_s_queue_span(model):
    world = capped(model, running=1, queued=1)
    first, second = world.submit(PROMPT, params=GREEDY), world.submit(PROMPT, params=GREEDY)
    world.run()
    roots = {s.attributes["speclanes.request_id"]: s for s in world.telemetry.spans() if s.parent is None}
    queues = {s.parent.span_id: s for s in world.telemetry.spans("queue")}
    waited = queues[roots[second].context.span_id]
    assert waited.start_time < roots[first].end_time <= waited.end_time  # it waited for the first to end
    assert queues[roots[first].context.span_id].end_time < roots[first].end_time


def test_max_tokens_beyond_the_context_ends_where_the_context_does(world, model):
    request_id = world.submit(
        PROMPT, params=SamplingParams(max_tokens=10**9, ignore_eos=True), drafter="ngram"
    )
    result = finished(world, request_id)
    assert result.finish_reason == "length"
    assert (
        len(result.prompt_tokens) + len(result.tokens) == model.cfg.context_length + 1
    )  # the last is not fed


def test_max_tokens_over_the_limit_is_refused_on_the_client_socket_naming_it():
    raw = msgspec.msgpack.encode({"type": "Submit", "prompt": "hi", "params": {"max_tokens": 2**31}})
    with pytest.raises(BadMessage) as caught:
        Codec(ClientRequest).decode(raw)
    assert "max_tokens must be <= 2147483647" in str(caught.value)


def test_a_journal_row_this_version_cannot_read_costs_that_request_only(model, tmp_path):
    world = World.paced(model, journal_path=str(tmp_path / "journal.sqlite"))  # a middle to stop in
    world.up()
    good, damaged = (world.submit(PROMPT, params=GREEDY) for _ in range(2))
    world.run(until=12)
    journal = world.hub.journal
    journal.db.execute("UPDATE steps SET record = ? WHERE request_id = ? AND step = 0", (b"\xc1", damaged))
    journal.db.execute("INSERT INTO opened VALUES (?, ?)", ("stranger", b"not msgpack"))
    journal.db.execute("INSERT INTO faults (data) VALUES (?)", (b"\xc1",))
    world.orchestrator_killed(deliver_in_flight=False)
    assert world.result(good) is None and world.hub.front.machine(damaged) is None
    assert finished(world, good).tokens == reference(model, GREEDY).tokens
    assert {r.opened.request_id for r in world.hub.journal.recover().requests} == {good}

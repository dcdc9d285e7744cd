"""The verify and draft lanes' logic without processes or sockets: a tiny model, a fake lane
context, and the in-process decoder as the reference."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.decoding.drafters import EMPTY, NoDraftSource, Proposal
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.drafters.registry import make_draft_sources
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.session import Session
from pipeline.decoding.speculation import Speculation
from pipeline.decoding.speculative import decode
from pipeline.model import Model
from pipeline.observability.telemetry import carrier
from pipeline.orchestration.lane_table import LaneTable
from pipeline.orchestration.request import Identity, RequestMachine
from pipeline.protocol.config import Timeouts
from pipeline.protocol.messages import (
    BadMessage,
    Close,
    Drafted,
    DraftRequest,
    Heartbeat,
    Open,
    Opened,
    Rows,
    SpeculativeState,
    StepFailed,
    Verified,
    Verify,
)
from pipeline.workers.draft_server import DraftServer
from pipeline.workers.driver import DraftLane, Driver, Out
from pipeline.workers.verifier import Verifier
from pipeline.workers.verify_core import reports_now

from .orchestration_harness import FakeLane
from .telemetry_harness import MemoryTelemetry, steps_of
from .tinymodel import TinySpec, write_tiny_gguf

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, seed=1234, max_tokens=16, ignore_eos=True)
PROMPTS = {
    "short": [17, 42, 99],
    "repetitive": [40, 41, 42, 43, 44, 45] * 3,
    "long": list(range(60, 100)),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("lanes") / "target.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=1.2))
    return Model.load(path)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("lanes") / "draft.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, scale=0.8))
    return Model.load(path)


def one(replies: list) -> object:
    assert len(replies) == 1, replies
    return replies[0]


class Client:
    """One request driven by the verify lane's own `Driver` and followed by the orchestrator's
    `RequestMachine`, delivered to a verifier by hand, message by message, so the tests can repeat,
    reorder, batch or alter them. Drafts are whatever the test passes: they answer the driver's
    draft request."""

    def __init__(self, verifier: Verifier, request_id: str, prompt: Sequence[int], params: SamplingParams):
        self.verifier, self.request_id, self.params = verifier, request_id, params
        self.prompt = list(prompt)
        lanes = LaneTable()
        for lane in ("verify", "draft"):
            lanes.update(Heartbeat(lane=lane, pid=1, state=SpeculativeState()), 0.0)
        seed = params.seed if params.seed is not None else 0
        who = Identity(request_id, seed, Speculation(k=16), {}, started=0.0, submitted=0.0)
        self.follower = RequestMachine(who, self.session(), lanes, Timeouts())
        (send,) = self.follower.begin(0.0)
        self.first_open = send.message
        self.driver = self.drive(self.first_open)

    def session(self) -> Session:
        model = self.verifier.model
        return Session(model.tokenizer, model.cfg.context_length, self.prompt, self.params, Speculation(k=16))

    def drive(self, opened: Open) -> Driver:
        """A driver as the verify lane starts one for an Open (it never waits for the journal here)."""
        driver = Driver(opened, self.session(), FakeLane(), DraftLane(), 1.0, 10**9)
        driver.begin(0.0)
        return driver

    @property
    def context(self) -> list[int]:
        return self.driver.session.context

    @property
    def output(self) -> list[int]:
        return self.context[len(self.prompt) :]

    @property
    def step(self) -> int:
        return self.driver.step

    @property
    def draws(self) -> int:
        return self.driver.draws

    def open_message(self) -> Open:
        return self.first_open

    def open(self) -> Opened:
        opened = self.record(one(self.verifier.handle([self.open_message()])))
        assert isinstance(opened, Opened) and opened.token is not None
        return opened

    def verify_message(self, drafts: Sequence[int] = (), probs: Rows | None = None) -> Verify:
        driver = self.driver
        if isinstance(driver.pending, DraftRequest):
            drafted = Drafted(
                request_id=self.request_id, step=driver.pending.step, tokens=list(drafts), probs=None,
                drafter="test", seconds=0.0,
            )  # fmt: skip
            driver.on_reply(drafted, 0.0)
        message = driver.pending
        assert isinstance(message, Verify), message
        return message if probs is None else msgspec.structs.replace(message, draft_probs=probs)

    def record(self, reply: object) -> Opened | Verified:
        """The reply to the driver, and what it decides to the follower (which must agree)."""
        assert isinstance(reply, Opened | Verified), reply
        before = self.step
        for out in self.driver.on_reply(reply, 0.0):
            if out.lane == "data":
                self.follower.on_reply(out.message, 0.0)
        if isinstance(reply, Verified):
            assert reply.request_id == self.request_id and reply.step == before + 1 == self.step
        assert self.follower.session.context == self.context
        return reply

    def verify(self, drafts: Sequence[int] = ()) -> Verified:
        verified = self.record(one(self.verifier.handle([self.verify_message(drafts)])))
        assert isinstance(verified, Verified)
        return verified

    def reprime_message(self, draws: int | None = None) -> Open:
        """What the orchestrator sends when the verify lane says it lost the request; the lane's
        driver starts again from it."""
        lost = StepFailed(
            request_id=self.request_id, step=self.step + 1, origin="verify", kind="unknown_request",
            message="restarted",
        )  # fmt: skip
        (send,) = self.follower.on_reply(lost, 0.0)
        message = send.message
        assert isinstance(message, Open) and not message.sample
        message = message if draws is None else msgspec.structs.replace(message, draws=draws)
        self.driver = self.drive(message)
        return message

    def run(self, until: int) -> list[int]:
        """Plain steps (no drafts) until `until` output tokens."""
        while len(self.output) < until:
            self.verify()
        return self.output


def reference(model: Model, prompt: Sequence[int], params: SamplingParams) -> list[int]:
    return decode(model, prompt, params, NoDraftSource(), k=0).tokens


def cache_length(verifier: Verifier, request_id: str) -> int:
    return verifier.requests[request_id].target.cache.length


# --- verify lane ----------------------------------------------------------------------


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_plain_steps_reproduce_in_process_greedy_decoding(model, prompt):
    expected = reference(model, PROMPTS[prompt], GREEDY)
    assert len(expected) == GREEDY.max_tokens
    lane = FakeLane()
    verifier = Verifier(model, lane)
    client = Client(verifier, "r", PROMPTS[prompt], GREEDY)
    opened = client.open()
    assert (opened.step, opened.token, opened.u, opened.draws) == (0, expected[0], None, 0)
    while len(client.output) < len(expected):
        verified = client.verify()
        assert (verified.accepted, verified.decisions, verified.batch_size) == (0, [], 1)
        assert len(verified.tokens) == 1 and verified.final_u is None and verified.draws == 0
        assert cache_length(verifier, "r") == len(client.context) - 1
    assert client.output == expected
    steps = len(expected) - 1
    assert (lane.state.runs, lane.state.batches, lane.state.batched_rows) == (1, steps, steps)
    assert lane.state.active_requests == 1 and lane.faults == []


def test_plain_steps_reproduce_in_process_seeded_sampling(model):
    expected = reference(model, PROMPTS["short"], SAMPLED)
    assert expected != reference(model, PROMPTS["short"], GREEDY)
    client = Client(Verifier(model, FakeLane()), "r", PROMPTS["short"], SAMPLED)
    opened = client.open()
    assert opened.u is not None and opened.draws == 1
    assert client.run(len(expected)) == expected
    assert client.draws == len(expected)  # one uniform per sampled token


def test_verified_drafts_keep_greedy_output_exact(model):
    """Drafts from the in-process n-gram drafter, verified by the lane: plain decoding's tokens."""
    prompt = PROMPTS["repetitive"]
    expected = reference(model, prompt, GREEDY)
    client = Client(Verifier(model, FakeLane()), "r", prompt, GREEDY)
    client.open()
    drafter = NgramSource(min_n=1, max_n=3).start(prompt, GREEDY, 0)
    drafted = accepted = 0
    while len(client.output) < len(expected):
        drafts = drafter.propose(client.context, 4).tokens[:4]
        verified = client.verify(drafts)
        assert len(verified.decisions) == min(len(drafts), verified.accepted + 1)
        assert verified.tokens[: verified.accepted] == drafts[: verified.accepted]
        drafted, accepted = drafted + len(drafts), accepted + verified.accepted
        assert cache_length(client.verifier, "r") == len(client.context) - 1
    assert client.output[: len(expected)] == expected
    assert drafted > 0 and accepted > 0
    assert (client.verifier.lane.state.drafted, client.verifier.lane.state.accepted) == (drafted, accepted)


def test_a_repeated_verify_is_answered_from_the_cache(model):
    expected = reference(model, PROMPTS["short"], SAMPLED)
    lane = FakeLane()
    verifier = Verifier(model, lane)
    client = Client(verifier, "r", PROMPTS["short"], SAMPLED)
    client.open()
    client.run(5)
    message = Verify(
        request_id="r", step=client.step, position=len(client.context) - 2, pending=client.context[-2]
    )
    first = verifier.requests["r"].reply
    length, draws, batches = (
        cache_length(verifier, "r"),
        verifier.requests["r"].target.draws,
        lane.state.batches,
    )
    for _ in range(3):
        again = one(verifier.handle([message]))
        assert again is first
    assert cache_length(verifier, "r") == length
    assert verifier.requests["r"].target.draws == draws
    assert lane.state.batches == batches
    assert client.run(len(expected)) == expected


def test_a_repeated_open_is_answered_from_the_cache(model):
    verifier = Verifier(model, FakeLane())
    client = Client(verifier, "r", PROMPTS["short"], SAMPLED)
    opened = client.open()
    target = verifier.requests["r"].target
    assert one(verifier.handle([client.open_message()])) is opened
    assert verifier.requests["r"].target is target and target.draws == 1


def test_a_duplicate_in_one_batch_is_executed_once(model):
    lane = FakeLane()
    verifier = Verifier(model, lane)
    client = Client(verifier, "r", PROMPTS["short"], GREEDY)
    client.open()
    message = client.verify_message()
    first, second = verifier.handle([message, message])
    assert first is second
    client.record(first)
    assert lane.state.batches == 1 and lane.state.batched_rows == 1
    assert cache_length(verifier, "r") == len(client.context) - 1


def test_unknown_request_is_not_a_fault(model):
    lane = FakeLane()
    verifier = Verifier(model, lane)
    reply = one(verifier.handle([Verify(request_id="ghost", step=3, position=10, pending=5)]))
    assert isinstance(reply, StepFailed)
    assert (reply.request_id, reply.step, reply.origin, reply.kind) == (
        "ghost",
        3,
        "verify",
        "unknown_request",
    )
    assert lane.faults == []
    client = Client(verifier, "r", PROMPTS["short"], GREEDY)
    client.open()
    verifier.handle([Close(request_id="r")])
    assert "r" not in verifier.requests
    assert one(verifier.handle([client.verify_message()])).kind == "unknown_request"


@pytest.mark.parametrize(
    ("step", "position"), [(1, 0), (-2, 0), (0, 1), (0, -1)], ids=["skip", "stale", "ahead", "behind"]
)
def test_a_wrong_step_or_position_is_an_unknown_request(model, step, position):
    """Offsets from the next correct step: the lane cannot serve it, the orchestrator re-primes."""
    expected = reference(model, PROMPTS["short"], GREEDY)
    lane = FakeLane()
    verifier = Verifier(model, lane)
    client = Client(verifier, "r", PROMPTS["short"], GREEDY)
    client.open()
    client.run(3)
    length = cache_length(verifier, "r")
    right = client.verify_message()
    wrong = Verify(
        request_id="r", step=right.step + step, position=right.position + position, pending=right.pending
    )
    reply = one(verifier.handle([wrong]))
    assert isinstance(reply, StepFailed) and reply.kind == "unknown_request"
    assert f"this lane is at step {client.step}, position {length}" in reply.message
    assert cache_length(verifier, "r") == length and lane.faults == []
    assert client.run(len(expected)) == expected


def test_bad_verify_requests_are_refused_and_reported(model):
    expected = reference(model, PROMPTS["short"], GREEDY)
    lane = FakeLane()
    verifier = Verifier(model, lane)
    vocab = model.cfg.vocab_size
    client = Client(verifier, "r", PROMPTS["short"], GREEDY)
    client.open()
    client.run(2)
    right = client.verify_message()
    length = cache_length(verifier, "r")
    fields = {"request_id": "r", "step": right.step, "position": right.position}
    bad = [
        (Verify(**fields, pending=vocab), "token id out of range [0, 267)"),
        (Verify(**fields, pending=-1), "token id out of range"),
        (Verify(**fields, pending=right.pending, drafts=[3, vocab + 5]), "token id out of range"),
        (
            Verify(**fields, pending=right.pending, drafts=[3], draft_probs=Rows.of(np.zeros((2, vocab)))),
            f"draft rows of shape (2, {vocab}) for 1 drafts",
        ),
        (
            Verify(**fields, pending=right.pending, drafts=[3, 4], draft_probs=Rows.of(np.ones((2, 7)))),
            "draft rows of shape (2, 7) for 2 drafts",
        ),
    ]
    for message, problem in bad:
        reply = one(verifier.handle([message]))
        assert isinstance(reply, StepFailed)
        assert (reply.kind, reply.origin, reply.step) == ("bad_request", "verify", right.step)
        assert problem in reply.message
        assert lane.faults[-1] == ("bad_request", reply.message, "r", right.step)
        assert cache_length(verifier, "r") == length
    assert len(lane.faults) == len(bad)
    assert client.run(len(expected)) == expected


def test_draft_rows_with_the_wrong_byte_length_are_a_bad_request(model):
    lane = FakeLane()
    verifier = Verifier(model, lane)
    a = Client(verifier, "a", PROMPTS["short"], GREEDY)
    b = Client(verifier, "b", PROMPTS["long"], GREEDY)
    a.open()
    b.open()
    torn = Rows((1, model.cfg.vocab_size), b"\x00" * 8)  # the right shape, 8 bytes of data
    replies = verifier.handle([a.verify_message([3], torn), b.verify_message()])
    by_id = {r.request_id: r for r in replies}
    assert isinstance(by_id["a"], StepFailed) and by_id["a"].kind == "bad_request"
    b.record(by_id["b"])
    assert b.output == reference(model, PROMPTS["long"], GREEDY)[:2]
    assert cache_length(verifier, "a") == len(a.context) - 1


def test_drafts_past_the_context_fail_only_their_own_request(model):
    lane = FakeLane()
    verifier = Verifier(model, lane)
    a = Client(verifier, "a", PROMPTS["short"], GREEDY)
    b = Client(verifier, "b", PROMPTS["long"], GREEDY)
    a.open()
    b.open()
    overflow = [3] * model.cfg.context_length
    replies = verifier.handle(
        [msgspec.structs.replace(a.verify_message(), drafts=overflow), b.verify_message()]
    )
    by_id = {r.request_id: r for r in replies}
    assert isinstance(by_id["a"], StepFailed) and by_id["a"].kind == "bad_request"
    assert isinstance(by_id["b"], Verified)
    assert "b" in verifier.requests


@pytest.mark.parametrize(
    ("tokens", "problem"),
    [
        ([], "0 prompt tokens for a context of 128"),
        ([5] * 128, "128 prompt tokens"),
        ([5, 267], "out of range"),
    ],
)
def test_bad_open_requests_are_refused_and_reported(model, tokens, problem):
    lane = FakeLane()
    verifier = Verifier(model, lane)
    reply = one(verifier.handle([Open(request_id="r", step=0, tokens=tokens, params=GREEDY, seed=1)]))
    assert isinstance(reply, StepFailed)
    assert (reply.kind, reply.origin) == ("bad_request", "open") and problem in reply.message
    assert lane.faults == [("bad_request", reply.message, "r", 0)]
    assert verifier.requests == {}


def test_a_bad_message_is_reported_and_the_rest_answered(model):
    lane = FakeLane()
    verifier = Verifier(model, lane)
    a = Client(verifier, "a", PROMPTS["short"], GREEDY)
    b = Client(verifier, "b", PROMPTS["long"], GREEDY)
    a.open()
    replies = verifier.handle(
        [BadMessage("undecodable message (3 bytes)"), b.open_message(), a.verify_message()]
    )
    assert lane.faults == [("bad_request", "undecodable message (3 bytes)", None, None)]
    assert [type(r) for r in replies] == [Opened, Verified]
    assert replies[0].request_id == "b" and replies[1].request_id == "a"
    a.record(replies[1])
    assert a.output == reference(model, PROMPTS["short"], GREEDY)[:2]


def test_concurrent_requests_are_verified_in_one_batch(model):
    """Three requests' steps in one call: one forward (batch_size 3), the tokens of one at a time."""
    params = {"short": GREEDY, "repetitive": GREEDY, "long": SAMPLED}
    alone = {}
    for name, p in params.items():
        client = Client(Verifier(model, FakeLane()), name, PROMPTS[name], p)
        client.open()
        alone[name] = client.run(p.max_tokens)
    lane = FakeLane()
    verifier = Verifier(model, lane)
    clients = [Client(verifier, name, PROMPTS[name], p) for name, p in params.items()]
    for client in clients:
        client.open()
    for _ in range(GREEDY.max_tokens - 1):
        replies = verifier.handle([c.verify_message() for c in reversed(clients)])
        assert [r.batch_size for r in replies] == [3, 3, 3]
        by_id = {r.request_id: r for r in replies}
        for client in clients:
            client.record(by_id[client.request_id])
    assert {c.request_id: c.output for c in clients} == alone
    steps = GREEDY.max_tokens - 1
    assert (lane.state.batches, lane.state.batched_rows) == (steps, 3 * steps)
    assert lane.state.active_requests == 3


def test_each_request_in_a_batch_gets_a_verify_span_in_its_own_trace(model):
    """One forward serves both, but each request's trace shows its own step, under the
    context its message carried, with the batch it shared."""
    lane, callers = FakeLane(), MemoryTelemetry()
    verifier = Verifier(model, lane)
    roots = {name: callers.start(f"request {name}") for name in ("short", "long")}
    clients = {name: Client(verifier, name, PROMPTS[name], GREEDY) for name in roots}
    for name, client in clients.items():
        client.record(
            one(verifier.handle([msgspec.structs.replace(client.open_message(), trace=carrier(roots[name]))]))
        )
    drafts = {"short": [5, 6], "long": []}
    verifier.handle(
        [
            msgspec.structs.replace(c.verify_message(drafts[n]), trace=carrier(roots[n]))
            for n, c in clients.items()
        ]
    )
    assert lane.telemetry.spans("verify") == []  # open: a span covers a run of steps
    for name in clients:
        verifier.forget(name)  # the request leaves the lane: its span ends
    spans = {s.attributes["speclanes.request_id"]: s for s in lane.telemetry.spans("verify")}
    assert set(spans) == set(roots)
    for name, span in spans.items():
        root = roots[name].get_span_context()
        assert span.parent is not None and span.parent.span_id == root.span_id
        assert span.context.trace_id == root.trace_id
        (step,) = steps_of(span.attributes)  # one step in its columns
        assert step["batch_size"] == 2 and step["batch_rows"] == 4 and step["number"] == 1
        assert step["k"] == len(drafts[name]) and step["emitted"] == step["accepted"] + 1
        assert span.attributes["speclanes.steps"] == 1 and span.attributes["speclanes.first_step"] == 1
    prefills = lane.telemetry.spans("prefill")
    assert {s.context.trace_id for s in prefills} == {r.get_span_context().trace_id for r in roots.values()}


def test_batched_drafts_of_different_lengths_match_one_at_a_time(model):
    names = ["short", "repetitive"]
    alone, drafted = {}, {}
    for name in names:
        client = Client(Verifier(model, FakeLane()), name, PROMPTS[name], GREEDY)
        client.open()
        drafter = NgramSource(min_n=1, max_n=3).start(PROMPTS[name], GREEDY, 0)
        steps = []
        while len(client.output) < GREEDY.max_tokens:
            drafts = drafter.propose(client.context, 3).tokens[:3]
            steps.append(drafts)
            client.verify(drafts)
        alone[name], drafted[name] = client.output, steps
    verifier = Verifier(model, FakeLane())
    clients = {name: Client(verifier, name, PROMPTS[name], GREEDY) for name in names}
    for client in clients.values():
        client.open()
    for i in range(max(len(s) for s in drafted.values())):
        live = [n for n in names if i < len(drafted[n])]
        replies = verifier.handle([clients[n].verify_message(drafted[n][i]) for n in live])
        assert {r.batch_size for r in replies} == {len(live)}
        for reply in replies:
            clients[reply.request_id].record(reply)
    assert {n: c.output for n, c in clients.items()} == alone
    assert any(len(d) for d in drafted["repetitive"])


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    ("at", "restart"),
    [(1, True), (7, True), (2, False), (7, False)],
    ids=["new-lane-at-open", "new-lane", "same-lane-early", "same-lane"],
)
def test_repriming_continues_the_undisturbed_run(model, params, at, restart):
    prompt = PROMPTS["long"]
    expected = reference(model, prompt, params)
    first = Verifier(model, FakeLane())
    client = Client(first, "r", prompt, params)
    client.open()
    client.run(at)
    if restart:
        client.verifier = Verifier(model, FakeLane())
        assert one(client.verifier.handle([client.verify_message()])).kind == "unknown_request"
    message = client.reprime_message()
    opened = client.record(one(client.verifier.handle([message])))
    assert isinstance(opened, Opened)
    assert (opened.step, opened.token, opened.u, opened.draws) == (client.step, None, None, client.draws)
    assert one(client.verifier.handle([message])) is opened  # a re-sent re-prime is a repeat
    assert cache_length(client.verifier, "r") == len(client.context) - 1
    assert client.verifier.lane.state.runs == (0 if restart else 1)  # a re-prime is not a new run
    assert client.run(len(expected)) == expected


def test_repriming_needs_no_draw_count_the_numbers_are_keyed_by_position(model):
    """A re-prime that forgets how many numbers were used still continues the same seeded
    output: each position's number depends on the seed and the position alone."""
    prompt = PROMPTS["long"]
    expected = reference(model, prompt, SAMPLED)
    client = Client(Verifier(model, FakeLane()), "r", prompt, SAMPLED)
    client.open()
    client.run(6)
    assert client.draws == 6
    client.verifier = Verifier(model, FakeLane())
    client.record(one(client.verifier.handle([client.reprime_message(draws=0)])))
    assert client.run(len(expected)) == expected


def test_a_request_in_a_crowded_forward_decodes_plainly_without_asking_the_draft_lane(model):
    """Beside seven neighbours a forward has no room for drafts (each row past one costs 40% here),
    so the step goes straight to the verifier: a draft lane round trip whose proposal the cut would
    drop cost `auto` a fifth of its throughput under 8 clients. Alone, the same request asks."""
    crowded_curve = [0.010, *[0.010 + 0.004 * r for r in range(1, 33)]]
    opening = Client(Verifier(model, FakeLane()), "r", PROMPTS["repetitive"], GREEDY).open_message()
    pending = {}
    for neighbours in (0, 7):
        prompt = PROMPTS["repetitive"]
        session = Session(model.tokenizer, model.cfg.context_length, prompt, GREEDY, Speculation())
        driver = Driver(opening, session, FakeLane(), DraftLane(), 1.0, 10**9)
        driver.neighbours = neighbours
        (first,) = driver.begin(0.0)
        opened = one(Verifier(model, FakeLane()).handle([first.message]))
        out = driver.on_reply(msgspec.structs.replace(opened, row_seconds=crowded_curve), 0.0)
        assert [o.lane for o in out if o.lane == "draft"] == (["draft"] if neighbours == 0 else [])
        pending[neighbours] = driver.pending
    assert isinstance(pending[0], DraftRequest) and pending[0].k > 0
    assert isinstance(pending[7], Verify) and pending[7].drafts == []


def test_a_first_token_a_last_step_and_a_failure_are_reported_at_once_the_rest_ride_the_interval(model):
    """The verify lane batches decided steps into reports every `run.report_interval_seconds`;
    `reports_now` picks what may not wait for one: time to first token and the end of an answer are
    latencies a client sees whole, and a re-prime waits on a failure."""
    verifier = Verifier(model, FakeLane())
    client = Client(verifier, "r", PROMPTS["short"], GREEDY)
    driver = client.driver
    assert reports_now(driver.on_reply(one(verifier.handle([client.open_message()])), 0.0))
    middle, last = [], []
    while not driver.over:
        out = driver.on_reply(one(verifier.handle([client.verify_message()])), 0.0)
        (last if driver.over else middle).append(out)
    assert len(middle) == GREEDY.max_tokens - 2 and not any(reports_now(out) for out in middle)
    assert len(last) == 1 and reports_now(last[0])
    lost = StepFailed(request_id="r", step=3, origin="verify", kind="unknown_request", message="restarted")
    assert reports_now([Out("data", lost)])


# --- draft lane -----------------------------------------------------------------------


def draft_request(
    request_id: str,
    context: Sequence[int],
    *,
    step: int = 1,
    prompt_length: int | None = None,
    drafter: str = "ngram",
    k: int = 4,
    params: SamplingParams = GREEDY,
    seed: int = 7,
) -> DraftRequest:
    return DraftRequest(
        request_id=request_id, step=step, drafter=drafter, params=params, seed=seed,
        prompt_length=len(context) - 1 if prompt_length is None else prompt_length,
        context=list(context), k=k,
    )  # fmt: skip


@pytest.fixture
def drafts(model) -> tuple[DraftServer, FakeLane]:
    lane = FakeLane()
    return DraftServer(make_draft_sources(model), model.cfg.vocab_size, lane), lane


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    context=st.lists(st.integers(3, 9), min_size=2, max_size=40),
    cut=st.integers(1, 40),
    k=st.integers(0, 8),
)
def test_ngram_proposals_equal_the_in_process_drafter(model, context, cut, k):
    server = DraftServer(make_draft_sources(model), model.cfg.vocab_size, FakeLane())
    prompt_length = min(cut, len(context))
    reply = server.draft(draft_request("r", context, prompt_length=prompt_length, k=k))
    assert isinstance(reply, Drafted)
    drafter = NgramSource().start(context[:prompt_length], GREEDY, 7)
    expected = drafter.propose(context, k).tokens[:k] if k else []
    assert reply.tokens == expected
    assert reply.probs is None and reply.drafter == "ngram"
    assert (reply.request_id, reply.step) == ("r", 1)


def test_ngram_proposal_on_a_known_context(drafts):
    server, lane = drafts
    reply = server.draft(draft_request("r", [5, 6, 7, 8, 9, 5, 6, 7], k=3))
    assert isinstance(reply, Drafted) and reply.tokens == [8, 9, 5]
    assert lane.state.drafted == 3 and lane.faults == []


def test_model_drafter_proposals_and_rows_equal_the_in_process_drafter(model, draft_model):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=16)
    sources = make_draft_sources(model, draft_model)
    server = DraftServer(sources, model.cfg.vocab_size, FakeLane())
    drafter = ModelSource(draft_model, model).start(PROMPTS["short"], params, 5)
    context = [*PROMPTS["short"], 11]
    for step in (1, 2):
        reply = server.draft(
            draft_request(
                "r", context, step=step, prompt_length=3, drafter="model", k=4, params=params, seed=5
            )
        )
        assert isinstance(reply, Drafted) and reply.probs is not None
        expected = drafter.propose(context, 4)
        assert reply.tokens == expected.tokens and len(reply.tokens) == 4
        np.testing.assert_allclose(reply.probs.array(), expected.probs, rtol=1e-6, atol=1e-7)
        assert reply.probs.shape == (4, model.cfg.vocab_size)
        context = [*context, *expected.tokens[:2], 30]  # two accepted, then a correction
        drafter.accept(context)


def test_a_repeated_draft_request_is_answered_from_the_cache(drafts):
    server, lane = drafts
    context = [5, 6, 7, 8, 9, 5, 6, 7]
    first = server.draft(draft_request("r", context, step=4))
    assert isinstance(first, Drafted) and first.tokens == [8, 9, 5, 6]
    # Same (request, step): the reply already sent, even though this context would draft differently.
    assert server.draft(draft_request("r", [*context, 1, 2], step=4)) is first
    assert lane.state.drafted == 4
    later = server.draft(draft_request("r", [*context, 8, 9, 5], step=5))
    assert isinstance(later, Drafted) and later is not first and later.tokens == [6, 7, 8, 9]


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"drafter": "magic"}, "drafter 'magic' is not served here (have: none, ngram, suffix, auto)"),
        ({"k": 33}, "k must be 0..32, got 33"),
        ({"k": -1}, "k must be 0..32, got -1"),
        ({"context": [5, 6, 267]}, "token id out of range [0, 267)"),
        ({"context": [5, -2, 6]}, "token id out of range"),
        ({"prompt_length": 0}, "prompt length 0 for a context of 3"),
        ({"prompt_length": 4}, "prompt length 4 for a context of 3"),
    ],
)
def test_bad_draft_requests_are_refused_and_reported(drafts, changes, problem):
    server, lane = drafts
    fields = {"context": [5, 6, 7], "prompt_length": 2} | changes
    reply = server.draft(draft_request("r", fields.pop("context"), step=3, **fields))
    assert isinstance(reply, StepFailed)
    assert (reply.kind, reply.origin, reply.request_id, reply.step) == ("bad_request", "draft", "r", 3)
    assert problem in reply.message
    assert lane.faults == [("bad_request", reply.message, "r", 3)]
    assert "r" not in server.active


class BoomSource:
    name = "boom"

    def __init__(self, where: str) -> None:
        self.where = where

    def start(self, prompt, params, rng):
        if self.where == "start":
            raise RuntimeError("cannot start")
        return BoomDrafter(self.where)


class BoomDrafter:
    name = "boom"

    def __init__(self, where: str) -> None:
        self.where = where

    def propose(self, context, k, tree=False, floor=0.0) -> Proposal:
        if self.where == "propose":
            raise RuntimeError("kaboom")
        return EMPTY

    def accept(self, context) -> None:
        if self.where == "accept":
            raise RuntimeError("kaboom")

    def finish(self, context) -> None:
        raise RuntimeError("finish kaboom")


@pytest.mark.parametrize("where", ["start", "propose", "accept"])
def test_a_raising_drafter_fails_its_step_and_the_lane_serves_on(model, where):
    lane = FakeLane()
    sources = {**make_draft_sources(model), "boom": BoomSource(where)}
    server = DraftServer(sources, model.cfg.vocab_size, lane)
    ok = server.draft(draft_request("other", [5, 6, 7, 8, 5, 6, 7], k=2))
    context = [5, 6, 7, 5, 6, 7] if where == "accept" else [5, 6, 7]
    reply = server.draft(draft_request("bad", context, step=2, prompt_length=2, drafter="boom"))
    assert isinstance(reply, StepFailed)
    assert (reply.kind, reply.origin, reply.step) == ("draft_failed", "draft", 2)
    assert "boom drafter raised RuntimeError" in reply.message
    assert lane.faults == [("draft_failed", reply.message, "bad", 2)]
    assert "bad" not in server.active and "other" in server.active
    assert isinstance(ok, Drafted) and ok.tokens == [8, 5]
    again = server.draft(draft_request("other", [5, 6, 7, 8, 5, 6, 7, 8], step=2, prompt_length=6, k=2))
    assert isinstance(again, Drafted) and again.tokens == [5, 6]
    retry = server.draft(draft_request("bad", context, step=3, prompt_length=2, drafter="ngram"))
    assert isinstance(retry, Drafted)


def test_a_raising_finish_is_reported(model):
    lane = FakeLane()
    server = DraftServer({"boom": BoomSource("finish")}, model.cfg.vocab_size, lane)
    assert isinstance(server.draft(draft_request("r", [5, 6, 7], drafter="boom")), Drafted)
    server.close(Close(request_id="r", context=[5, 6, 7, 8]))
    assert lane.faults == [("draft_failed", "finish raised RuntimeError('finish kaboom')", "r", None)]
    assert server.active == {} and lane.state.runs == 1


def test_close_with_context_teaches_the_suffix_table(drafts):
    server, lane = drafts
    text = list(range(100, 130))
    before = server.draft(draft_request("b0", text[8:12], prompt_length=3, drafter="suffix"))
    assert isinstance(before, Drafted) and before.tokens == []
    first = server.draft(draft_request("a", text[:6], prompt_length=5, drafter="suffix"))
    assert isinstance(first, Drafted) and first.tokens == []
    server.close(Close(request_id="a", context=text))
    assert "a" not in server.active and lane.state.runs == 1
    after = server.draft(draft_request("b1", text[8:12], prompt_length=3, drafter="suffix"))
    assert isinstance(after, Drafted) and after.tokens == text[12:16] and after.drafter == "suffix"
    # The composite drafter shares the same table.
    auto = server.draft(draft_request("b2", text[8:12], prompt_length=3, drafter="auto"))
    assert isinstance(auto, Drafted) and auto.tokens == text[12:16]


def test_close_without_context_teaches_nothing(drafts):
    server, lane = drafts
    text = list(range(100, 130))
    server.draft(draft_request("a", text[:6], prompt_length=5, drafter="suffix"))
    server.close(Close(request_id="a"))
    assert "a" not in server.active and lane.state.runs == 0
    later = server.draft(draft_request("b", text[8:12], prompt_length=3, drafter="suffix"))
    assert isinstance(later, Drafted) and later.tokens == []

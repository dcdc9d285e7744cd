"""The `learned` drafter served by the pipeline: the verify lane computes the target's features, the
orchestrator passes them to the draft lane with each draft request, the draft lane's drafter
observes them before it proposes. Drafts change speed, never output.

A tiny native target (row-invariant, as the verify lane needs) and a tiny head trained for it
(`tests/tinyhead.py`). The lane cores are tested directly (features bit for bit against one forward
over the whole sequence; observe before propose, once per step), then through the orchestrator's
core with both lane cores and their faults (`World`), then once with real processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.audit.verify import verify_request
from pipeline.decoding.drafters import NoDraftSource, Proposal
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Runtime, load_model
from pipeline.model.draft_head import DraftHead, load_head
from pipeline.model.prompts import prompt_tokens
from pipeline.protocol.client import PipelineError
from pipeline.protocol.config import Config
from pipeline.protocol.messages import (
    Drafted,
    DraftRequest,
    Open,
    Opened,
    Rows,
    StepFailed,
    Verified,
    Verify,
)
from pipeline.service.launch import launch
from pipeline.training.prompts import prompts
from pipeline.workers.draft_server import DraftServer
from pipeline.workers.kept_features import MAX_KEPT_FEATURES, KeptFeatures, kept_features
from pipeline.workers.verifier import Verifier

from .orchestration_harness import FakeLane, World
from .pipeline_harness import running_pipeline
from .tinyhead import make_tiny_head
from .tinymodel import TinySpec, write_tiny_gguf

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=41, max_tokens=40, ignore_eos=True)


@dataclass(frozen=True)
class Tiny:
    model: Runtime
    path: Path
    head_path: Path
    head: DraftHead


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp("learned-lanes")
    path = root / "target.gguf"
    write_tiny_gguf(path, TinySpec(seed=5, scale=1.0, context=512))
    model = load_model(path, "native")
    head_path, _ = make_tiny_head(model, path, root)
    return Tiny(model, path, head_path, load_head(head_path, model.cfg, model.embed, path))


def prompt_text(index: int = 0) -> str:
    return prompts("train")[index]


def features_of(model: Runtime, tokens: list[int]) -> np.ndarray:
    """Every position's feature from one forward over the whole sequence: what the lane's must equal."""
    _, found = model.forward_features([(model.new_cache(len(tokens) + 1), tokens)], all_logits=False)
    return found[0]


def assert_features(reply: Opened | Verified, model: Runtime, context: list[int], at: int, n: int) -> None:
    """`reply` carries the features of positions [at, at + n) of `context`, bit for bit."""
    assert reply.features is not None and reply.features_at == at and reply.features.shape[0] == n, reply
    assert np.array_equal(reply.features.array(), features_of(model, context[: at + n])[at:])


def run(verifier: Verifier, *messages) -> list:
    replies = verifier.handle(list(messages))
    while verifier.busy():
        replies += verifier.handle([])
    return replies


def opening(request_id: str, tokens: list[int], features: bool = True, **fields) -> Open:
    return Open(
        request_id=request_id, step=0, tokens=tokens, params=GREEDY, seed=0, capacity=len(tokens) + 64,
        features=features, **fields,
    )  # fmt: skip


# --- the verify lane --------------------------------------------------------------------------


def test_the_verify_lane_sends_the_features_of_the_prefill_and_of_each_step_s_kept_rows(tiny):
    """Prefilled in chunks of 5, then steps with drafts partly accepted, all accepted, and a tree:
    each reply's features are those of the positions it kept, as one forward over the whole
    sequence computes them."""
    model = tiny.model
    prompt = prompt_tokens(model.tokenizer, prompt_text(), chat=True)
    truth = decode(model, prompt, GREEDY, NoDraftSource(), k=0).tokens
    verifier = Verifier(model, FakeLane(), prefill_chunk=5)
    (opened,) = run(verifier, opening("r", prompt))
    assert isinstance(opened, Opened) and opened.token == truth[0]
    assert_features(opened, model, prompt, 0, len(prompt))
    context = [*prompt, truth[0]]
    vocab = model.cfg.vocab_size
    # Two right then a wrong one; three right; a tree whose second first node and its child are right.
    steps = [
        ([truth[1], truth[2], (truth[3] + 1) % vocab], None, 2),
        ([truth[4], truth[5], truth[6]], None, 3),
        ([(truth[8] + 1) % vocab, truth[8], truth[9]], [-1, -1, 1], 2),
    ]
    for step, (drafts, parents, accepted) in enumerate(steps, start=1):
        at, done = len(context) - 1, len(context) - len(prompt)
        verify = Verify(
            request_id="r", step=step, position=at, pending=context[-1], drafts=drafts, parents=parents
        )
        (verified,) = run(verifier, verify)
        assert isinstance(verified, Verified) and verified.accepted == accepted
        assert verified.tokens == truth[done : done + accepted + 1]
        assert_features(verified, model, context + verified.tokens, at, 1 + accepted)
        context += verified.tokens


def test_a_re_prime_sends_the_features_of_the_whole_accepted_prefix(tiny):
    model = tiny.model
    prompt = prompt_tokens(model.tokenizer, prompt_text(1), chat=True)
    truth = decode(model, prompt, GREEDY, NoDraftSource(), k=0).tokens
    context = [*prompt, *truth[:6]]
    verifier = Verifier(model, FakeLane(), prefill_chunk=7)  # a restarted lane: it knows nothing
    reprime = opening(
        "r", context[:-1], sample=False, prompt_length=len(prompt), pending=context[-1], draws=0
    )
    (opened,) = run(verifier, msgspec.structs.replace(reprime, step=5))
    assert isinstance(opened, Opened) and opened.token is None
    assert_features(opened, model, context, 0, len(context) - 1)
    (verified,) = run(
        verifier, Verify(request_id="r", step=6, position=len(context) - 1, pending=context[-1])
    )
    assert isinstance(verified, Verified) and verified.tokens == [truth[6]]
    assert_features(verified, model, [*context, truth[6]], len(context) - 1, 1)


def test_copied_prompt_positions_have_no_features_and_only_asking_requests_get_any(tiny):
    """A prompt that begins like a cached one copies those positions: its features start after them.
    A request that did not ask for features gets none, though it shares the forward."""
    model = tiny.model
    first = prompt_tokens(model.tokenizer, prompt_text(2), chat=True)
    verifier = Verifier(model, FakeLane(), prefill_chunk=0)
    (opened,) = run(verifier, opening("a", first, features=False))
    assert isinstance(opened, Opened) and opened.features is None
    second = [*first[:20], 40, 41, 42]
    replies = run(
        verifier, opening("b", second),
        Verify(request_id="a", step=1, position=len(first), pending=opened.token),
    )  # fmt: skip
    by_id = {r.request_id: r for r in replies}
    assert isinstance(by_id["a"], Verified) and by_id["a"].features is None
    assert_features(by_id["b"], model, second, 20, 3)


# --- the draft lane ---------------------------------------------------------------------------


class Recorder:
    """A drafter (and its source) that records what the draft lane calls, in order."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, prompt, params, seed):
        self.calls.append(("start", len(prompt)))
        return self

    def observe(self, position: int, rows: np.ndarray) -> None:
        self.calls.append(("observe", position, rows.shape, float(rows[0, 0])))

    def accept(self, context) -> None:
        self.calls.append(("accept", len(context)))

    def propose(self, context, k, tree=False, floor=0.0) -> Proposal:
        self.calls.append(("propose", len(context)))
        return Proposal([7] * k, None, self.name)

    def finish(self, context) -> None:
        pass


def draft_request(step: int, context: list[int], features: np.ndarray | None, at: int = 0) -> DraftRequest:
    return DraftRequest(
        request_id="r", step=step, drafter="recorder", params=GREEDY, seed=0, prompt_length=4,
        context=context, k=2, features=None if features is None else Rows.of(features), features_at=at,
    )  # fmt: skip


def test_the_draft_lane_observes_the_features_before_it_proposes_once_per_step():
    recorder = Recorder()
    lane = FakeLane()
    server = DraftServer({"recorder": recorder}, 300, lane)
    prompt = [10, 11, 12, 13]
    first = draft_request(1, [*prompt, 20], np.full((4, 8), 1.0, np.float32))
    reply = server.draft(first)
    assert isinstance(reply, Drafted) and reply.tokens == [7, 7]
    assert recorder.calls == [("start", 4), ("observe", 0, (4, 8), 1.0), ("propose", 5)]
    assert server.draft(first) is reply  # a repeat: answered from the cache, nothing observed again
    assert len(recorder.calls) == 3
    second = draft_request(2, [*prompt, 20, 21, 22], np.full((2, 8), 2.0, np.float32), at=4)
    server.draft(second)
    assert recorder.calls[3:] == [("observe", 4, (2, 8), 2.0), ("accept", 7), ("propose", 7)]
    plain = draft_request(3, [*prompt, 20, 21, 22, 23], None)  # no new features: nothing to observe
    server.draft(plain)
    assert recorder.calls[6:] == [("accept", 8), ("propose", 8)]
    assert lane.faults == []


@pytest.mark.parametrize(
    ("features", "at", "problem"),
    [
        (np.zeros((5, 8), np.float32), 0, "positions 0..4 of a context of 5"),  # the pending token's
        (np.zeros((2, 8), np.float32), -1, "positions -1..0"),
        (None, 0, "in 5 bytes"),
    ],
)
def test_features_that_cannot_be_the_target_s_are_a_bad_request(features, at, problem):
    lane = FakeLane()
    server = DraftServer({"recorder": Recorder()}, 300, lane)
    msg = draft_request(1, [10, 11, 12, 13, 20], features, at)
    if features is None:
        msg = msgspec.structs.replace(msg, features=Rows((2, 8), b"short"))
    reply = server.draft(msg)
    assert isinstance(reply, StepFailed) and reply.kind == "bad_request" and problem in reply.message
    assert lane.faults and lane.faults[0][0] == "bad_request"


# --- the orchestrator's keeping ---------------------------------------------------------------


def rows(start: int, n: int, width: int = 3) -> Rows:
    return Rows.of(np.arange(start, start + n, dtype=np.float32)[:, None].repeat(width, 1))


def test_a_request_keeps_features_until_a_draft_request_takes_them():
    kept = kept_features(None, 0, rows(0, 5))
    kept = kept_features(kept, 5, rows(5, 2))  # a step that drafted nothing: they continue
    assert kept is not None and kept.taken()[0] == 0
    assert np.array_equal(kept.taken()[1].array()[:, 0], np.arange(7))
    kept = kept_features(kept, 6, rows(6, 3))  # overlapping (a re-sent step): the newer rows win
    assert kept is not None and kept.taken()[0] == 0 and kept.taken()[1].shape == (9, 3)
    assert kept_features(kept, 20, rows(20, 1)).taken()[0] == 20  # type: ignore[union-attr]  # a gap: restart
    assert kept_features(kept, 0, Rows((2, 3), b"bad")) is kept  # bytes that do not fit: none
    many = kept_features(None, 0, rows(0, MAX_KEPT_FEATURES + 10))
    assert many is not None and many.taken()[0] == 10 and many.taken()[1].shape[0] == MAX_KEPT_FEATURES


STEPS = st.tuples(st.integers(-6, 2), st.integers(0, 9), st.sampled_from([3, 3, 3, 2]))


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(STEPS, max_size=60), limit=st.integers(1, 30))
def test_kept_features_are_each_positions_latest_row(steps, limit):
    """Against a plain list: a step whose rows start inside or right after what is kept overwrites
    from its position on; a gap or another width starts again; the latest `limit` rows stay."""
    kept: KeptFeatures | None = None
    start, values, width = 0, [], 0  # the plain model: positions start, start + 1, ...
    for number, (offset, n, w) in enumerate(steps):
        at = max(0, start + len(values) + offset)  # around the end: overlaps, continuations, gaps
        kept = kept_features(kept, at, rows(1000 * number + at, n, w), limit)
        if number == 0 or w != width or not start <= at <= start + len(values):
            start, values = at, []
        values = values[: at - start] + [1000 * number + at + i for i in range(n)]
        start, values, width = start + max(0, len(values) - limit), values[-limit:] if values else [], w
        assert kept is not None
        first, got = kept.taken()
        assert (first, got.shape) == (start, (len(values), w))
        assert np.array_equal(got.array()[:, 0], values)


# --- the orchestrator with both lane cores --------------------------------------------------------


def head_world(tiny: Tiny, in_verify_lane: bool = True, **fields) -> World:
    """`in_verify_lane`: `run.draft_in_verify_lane`, the verify lane drafting `learned` itself (else
    the draft lane does, from the features each DraftRequest carries)."""
    settings = {"model": {"draft_head": str(tiny.head_path)}, "run": {"draft_in_verify_lane": in_verify_lane}}
    world = World(tiny.model, config=msgspec.convert(settings, Config), head=tiny.head, **fields)
    world.up()
    return world


def drafting_lane(world: World) -> FakeLane:
    """The lane whose drafter drafts `learned`: the verify lane, or the draft lane."""
    return world.drafter_server("learned").lane  # type: ignore[return-value]


def reference(tiny: Tiny, params: SamplingParams, drafter: str = "none") -> Result:
    tokens = prompt_tokens(tiny.model.tokenizer, prompt_text(), chat=False)
    source = make_draft_source(drafter, tiny.model, None, tiny.head)
    return decode(tiny.model, tokens, params, source, k=0 if drafter == "none" else 4)


def finished(world: World, request_id: str) -> Result:
    world.run()
    result = world.result(request_id)
    assert result is not None and result.error is None, result
    return result


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("in_verify_lane", [True, False], ids=["verify-lane", "draft-lane"])
def test_through_the_lanes_the_drafter_sees_what_it_sees_in_process(tiny, params, in_verify_lane):
    """The same tokens as plain decoding; and since every feature arrives, the same drafts, step for
    step, as the in-process loop's: each draft request's features run up to the pending token, and
    a drafter in the verify lane asks the draft lane for nothing."""
    drafter = "learned"
    world = head_world(tiny, in_verify_lane)
    request_id = world.submit(prompt_text(), params=params, drafter=drafter, k=4)
    result = finished(world, request_id)
    assert result.tokens == reference(tiny, params).tokens
    in_process = reference(tiny, params, drafter)
    assert result.stats.drafted == in_process.stats.drafted > 0
    assert result.stats.accepted == in_process.stats.accepted
    assert all(s.message.features for s in world.sent if isinstance(s.message, Open))
    asks = [s.message for s in world.sent if isinstance(s.message, DraftRequest)]
    assert drafting_lane(world).state.drafted == result.stats.drafted
    assert not asks if in_verify_lane else asks
    at = 0  # each draft request's features continue the last one's: up to the pending token
    for ask in asks:
        assert ask.features is not None and ask.features_at == at
        at += ask.features.shape[0]


def test_a_drafter_that_reads_no_features_gets_none(tiny):
    world = head_world(tiny)
    finished(world, world.submit(prompt_text(), params=GREEDY, drafter="ngram", k=4))
    finished(world, world.submit(prompt_text(), params=GREEDY, drafter="learned", k=0))
    sent = [s.message for s in world.sent if isinstance(s.message, Open | DraftRequest)]
    assert sent and not any(m.features for m in sent)


@pytest.mark.parametrize("in_verify_lane", [True, False], ids=["verify-lane", "draft-lane"])
@pytest.mark.parametrize("lane", ["draft", "verify", "orchestrator"])
def test_a_lane_restart_costs_drafts_never_output(tiny, tmp_path, lane, in_verify_lane):
    """Killed mid-request: a restarted draft lane's drafter starts its history at the next features it
    gets and drafts again; a re-primed verify lane (after its own or the orchestrator's restart) sends
    the whole prefix's features (to its own drafter, or with the next DraftRequest)."""
    world = head_world(tiny, in_verify_lane, journal_path=str(tmp_path / "journal.sqlite"))
    request_id = world.submit(prompt_text(), params=SEEDED, drafter="learned", k=4)
    world.run(until=12)
    assert world.result(request_id) is None  # mid-request
    if lane == "orchestrator":
        world.orchestrator_killed(deliver_in_flight=False)
    else:
        world.down(lane)
        world.up(lane)
    result = finished(world, request_id)
    assert result.tokens == reference(tiny, SEEDED).tokens
    assert drafting_lane(world).state.drafted > 0  # the drafting lane (a new one after its restart) drafted
    if lane != "draft":
        reprimes = [s.message for s in world.sent if isinstance(s.message, Open) and not s.message.sample]
        assert reprimes and all(m.features for m in reprimes)


# --- real processes -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_pipeline_serves_learned_and_auto_exactly_through_lane_kills(tiny, tmp_path):
    """`model.draft_head` names the head; `learned` and `auto`, greedy and seeded, give in-process plain
    decoding's tokens with drafts proposed; SIGKILLs of the draft lane and of the verify lane
    mid-stream change nothing."""
    settings = [
        f"model.path={tiny.path}", f"model.draft_head={tiny.head_path}", "timeouts.draft=30.0",
        "restart.initial_backoff=0.1",
    ]  # fmt: skip
    model = load_model(tiny.path)  # the backend the pipeline serves with (auto)
    prompt = prompt_tokens(model.tokenizer, prompt_text(), chat=True)

    def plain(params: SamplingParams) -> list[int]:
        return decode(model, prompt, params, NoDraftSource(), k=0).tokens

    with running_pipeline(tmp_path / "run", settings) as pipeline, pipeline.client() as client:
        served = []
        for drafter in ("learned", "auto"):
            for params in (GREEDY, SEEDED):
                done = client.complete(prompt_text(), chat=True, params=params, drafter=drafter, k=4)
                assert done.tokens == plain(params) and done.stats.drafted > 0, (drafter, params)
                served.append(done.request_id)
        # Long enough that the kill lands 100 tokens before the end even when the client's first
        # chunks come late and large (on a loaded CI machine, the chunk that took the count past 20
        # once took it to 220 of 300).
        long = SamplingParams(temperature=0.8, seed=9, max_tokens=450, ignore_eos=True)
        for lane in ("draft", "verify"):
            pid = pipeline.lane(lane).pid
            done, killed_at = stream_through_a_kill(client, pid, long)
            assert done.error is None and done.stats.drafted > 0, done
            assert done.tokens == plain(long) and killed_at < len(done.tokens) - 100, (lane, killed_at)
            pipeline.wait_lane_up(lane, pid)
            served.append(done.request_id)
        for request_id in served:  # the audit trail proves each, kills included
            report = verify_request(request_id, pipeline.events(request_id), model, None)
            assert report.verdict == "pass", report


def stream_through_a_kill(client, pid: int | None, params: SamplingParams) -> tuple[Result, int]:
    """A `learned` request streamed while `pid` is SIGKILLed once 20 tokens are out: its result (which
    must be what the chunks said) and how many tokens had come when the kill was sent."""
    assert pid is not None
    emitted, killed_at = [0], [-1]

    def kill() -> None:
        while emitted[0] < 20:
            time.sleep(0.005)
        killed_at[0] = emitted[0]
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    request_id = client.submit(prompt_text(), chat=True, params=params, drafter="learned", k=4).request_id
    tokens: list[int] = []
    for item in client.chunks(request_id):
        if isinstance(item, Result):
            assert item.tokens == tokens
            killer.join(5)
            return item, killed_at[0]
        tokens += item.tokens
        emitted[0] = len(tokens)
    raise AssertionError("the stream ended with no result")


@pytest.mark.slow
def test_a_named_head_that_is_not_one_for_the_model_fails_start_at_once(tiny, tmp_path):
    not_a_head = tmp_path / "notes.head.npz"
    not_a_head.write_bytes(b"not an npz")
    settings = [f"run.dir={tmp_path / 'run'}", f"model.path={tiny.path}", f"model.draft_head={not_a_head}"]
    started = time.monotonic()
    with pytest.raises(PipelineError, match="not a draft head file"):
        launch(settings, timeout=60)
    assert time.monotonic() - started < 30

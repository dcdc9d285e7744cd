"""The wire format: every message round-trips, and anything else is a BadMessage."""

from __future__ import annotations

import typing

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeline.decoding.acceptance import Decision
from pipeline.decoding.result import FINISH_REASONS, RequestError, Result, RunStats
from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.messages import (
    PROTOCOL,
    AuditAck,
    AuditBatch,
    AuditInbox,
    AuditLaneInbox,
    BadMessage,
    Cancel,
    Chunk,
    Chunks,
    ClientReply,
    ClientRequest,
    Close,
    Codec,
    ControlInbox,
    Cursor,
    DataInbox,
    Decided,
    Detokenize,
    Drafted,
    DraftInbox,
    DraftRequest,
    ErrorReply,
    Fault,
    FaultEvent,
    Heartbeat,
    LaneDown,
    LaneFailed,
    LaneSnapshot,
    LaneStatus,
    LaneUp,
    MetricsQuery,
    MetricsReport,
    Open,
    Poll,
    Reported,
    RequestOpened,
    Rows,
    Shutdown,
    SpeculativeEvent,
    SpeculativeState,
    StatusQuery,
    StatusReport,
    StepEvent,
    StepFailed,
    StepRecord,
    StepsJournaled,
    Submit,
    Submitted,
    Text,
    Tokenize,
    Tokens,
    Verify,
    VerifyInbox,
    Watch,
    Watched,
    encode,
)

UNIONS = {
    "VerifyInbox": VerifyInbox,
    "DraftInbox": DraftInbox,
    "AuditInbox": AuditInbox,
    "AuditLaneInbox": AuditLaneInbox,
    "DataInbox": DataInbox,
    "ControlInbox": ControlInbox,
    "ClientRequest": ClientRequest,
    "ClientReply": ClientReply,
}

CODECS = {name: Codec(union) for name, union in UNIONS.items()}


def members(union: object) -> tuple[type, ...]:
    return typing.get_args(union)


# --- strategies -----------------------------------------------------------------------

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
ids = st.text("abcdef0123456789-", min_size=1, max_size=16)
small = st.integers(0, 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
tokens = st.lists(st.integers(0, 2**20), max_size=20)
traces = st.dictionaries(st.sampled_from(["traceparent", "tracestate"]), text, max_size=2)
fault_kinds = st.sampled_from(typing.get_args(typing.get_type_hints(Fault)["kind"]))
# JSON-like values for the dict[str, Any] fields (lists, not tuples: msgpack has no tuple).
json_values = st.recursive(
    st.none() | st.booleans() | i64 | finite | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
json_dicts = st.dictionaries(text, json_values, max_size=4)

sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.0, 5.0),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.none() | st.integers(0, 2**64 - 1),
    max_tokens=st.integers(1, 100_000),
    stop=st.lists(text.filter(bool), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
)
rows = st.builds(
    Rows.of,
    hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=5)),
)
decisions = st.builds(
    Decision,
    position=small,
    draft_token=small,
    p=finite,
    q=finite,
    u=st.none() | st.floats(0.0, 1.0, exclude_max=True),
    kept=st.booleans(),
    replacement=st.none() | small,
)
states = st.builds(
    SpeculativeState,
    runs=small,
    drafted=small,
    accepted=small,
    active_requests=small,
    batches=small,
    batched_rows=small,
)
faults = st.builds(
    Fault,
    kind=fault_kinds,
    lane=text,
    message=text,
    request_id=st.none() | ids,
    step=st.none() | small,
    time=finite,
)
work = {"request_id": ids, "step": small, "trace": traces}
audit = {"event_id": ids, "request_id": ids, "time": finite}

results = st.builds(
    Result,
    finish_reason=st.sampled_from(FINISH_REASONS),
    request_id=ids,
    prompt_tokens=tokens,
    tokens=tokens,
    text=text,
    stats=st.builds(RunStats, steps=small, drafted=small, acceptance_rate=finite, seed=i64, drafter=text),
    error=st.none() | st.builds(RequestError, kind=text, message=text),
)

chunk_batches = st.builds(  # a poll's reply, and each stream of a watch's
    Chunks,
    request_id=ids,
    chunks=st.lists(st.builds(Chunk, seq=small, text=text, tokens=tokens), max_size=4),
    done=st.none() | results,
)

step_records = st.builds(
    StepRecord, step=small, drafted=small, tokens=tokens, accepted=small, draft_seconds=finite,
    verify_seconds=finite, draws=small, drafter=text, bonus=st.booleans(),
)  # fmt: skip
step_events = st.builds(
    StepEvent, **audit, step=small, drafter=text, k=st.integers(0, 32), drafted=tokens, emitted=tokens,
    decisions=st.lists(decisions, max_size=4), final_u=st.none() | finite, draws=small, batch_size=small,
)  # fmt: skip
STRATEGIES: dict[type, st.SearchStrategy] = {
    Open: st.builds(
        Open,
        **work,
        tokens=tokens,
        params=sampling_params,
        seed=st.integers(0, 2**64 - 1),
        draws=small,
        sample=st.booleans(),
        capacity=small,
    ),
    Close: st.builds(Close, request_id=ids, context=tokens),
    DraftRequest: st.builds(
        DraftRequest,
        **work,
        drafter=st.sampled_from(["none", "ngram", "suffix", "model", "auto"]),
        params=sampling_params,
        seed=st.integers(0, 2**64 - 1),
        prompt_length=small,
        context=tokens,
        k=st.integers(0, 32),
    ),
    Decided: st.builds(
        Decided,
        **work,
        record=st.none() | step_records,
        event=st.none() | step_events,
        over=st.booleans(),
    ),
    StepsJournaled: st.builds(StepsJournaled, steps=st.dictionaries(ids, small, max_size=4)),
    Drafted: st.builds(Drafted, **work, tokens=tokens, probs=st.none() | rows, drafter=text, seconds=finite),
    StepFailed: st.builds(
        StepFailed,
        **work,
        origin=st.sampled_from(["open", "verify", "draft"]),
        kind=fault_kinds,
        message=text,
    ),
    AuditAck: st.builds(AuditAck, event_ids=st.lists(ids, max_size=5)),
    RequestOpened: st.builds(RequestOpened, **audit, settings=json_dicts, prompt_tokens=tokens),
    StepEvent: step_events,
    SpeculativeEvent: st.builds(
        SpeculativeEvent,
        **audit,
        drafted=small,
        accepted=small,
        acceptance_rate=finite,
        iterations=small,
        content_length=small,
        finish_reason=text,
        stats=json_dicts,
        tokens=tokens,
    ),
    FaultEvent: st.builds(FaultEvent, **audit, fault=faults),
    LaneSnapshot: st.builds(
        LaneSnapshot,
        **audit,
        lane=text,
        pid=st.none() | small,
        restarts=small,
        lane_state=st.sampled_from(["starting", "up", "down"]),
        totals=states,
    ),
    Fault: faults,
    LaneUp: st.builds(LaneUp, lane=text, pid=small, restarts=small),
    LaneDown: st.builds(LaneDown, lane=text, pid=small, returncode=st.none() | i64, restarts=small),
    LaneFailed: st.builds(
        LaneFailed, lane=text, pid=small, returncode=st.none() | i64, restarts=small, reason=text
    ),
    Heartbeat: st.builds(Heartbeat, lane=text, pid=small, state=states),
    Shutdown: st.builds(Shutdown, reason=text),
    Submit: st.builds(
        Submit,
        prompt=st.none() | text,
        messages=st.none() | st.lists(st.dictionaries(st.sampled_from(["role", "content"]), text)),
        chat=st.booleans(),
        params=sampling_params,
        drafter=st.none() | text,
        k=st.none() | st.integers(0, 32),
        max_iterations=st.none() | small,
    ),
    Poll: st.builds(Poll, request_id=ids, after=st.integers(-1, 2**31), wait=finite),
    Watch: st.builds(
        Watch,
        watcher=text,
        cursors=st.lists(
            st.builds(Cursor, request_id=ids, secret=text, after=st.integers(-1, 2**31)), max_size=4
        ),
        wait=finite,
    ),
    Cancel: st.builds(Cancel, request_id=ids),
    StatusQuery: st.builds(StatusQuery),
    MetricsQuery: st.builds(MetricsQuery),
    Tokenize: st.builds(
        Tokenize,
        text=st.none() | text,
        messages=st.none() | st.lists(st.dictionaries(st.sampled_from(["role", "content"]), text)),
        add_special=st.none() | st.booleans(),
        add_generation_prompt=st.booleans(),
        with_pieces=st.booleans(),
    ),
    Detokenize: st.builds(Detokenize, tokens=tokens),
    MetricsReport: st.builds(MetricsReport, text=text, content_type=text),
    Tokens: st.builds(
        Tokens, tokens=tokens, pieces=st.lists(st.binary(max_size=8), max_size=4), context_length=small
    ),
    Text: st.builds(Text, text=text),
    Submitted: st.builds(Submitted, request_id=ids, prompt_tokens=small),
    Chunks: chunk_batches,
    ErrorReply: st.builds(ErrorReply, kind=text, message=text),
    Watched: st.builds(
        Watched,
        streams=st.lists(chunk_batches, max_size=3),
        unknown=st.lists(ids, max_size=2),
    ),
    StatusReport: st.builds(
        StatusReport,
        lanes=st.lists(
            st.builds(
                LaneStatus,
                name=text,
                state=st.sampled_from(["starting", "up", "stalled", "down", "failed"]),
                pid=st.none() | small,
                restarts=small,
                active_requests=small,
                totals=states,
                reason=text,
            ),
            max_size=4,
        ),
        active_requests=small,
        audit_pending=small,
        totals=states,
        faults=st.lists(faults, max_size=3),
    ),
}


# A verify-lane report and an audit batch hold other messages (the batch as their encoded bytes).
STRATEGIES[Reported] = st.builds(
    Reported, messages=st.lists(STRATEGIES[Decided] | STRATEGIES[StepFailed], min_size=1, max_size=3)
)
audit_events = st.lists(st.one_of(*(STRATEGIES[kind] for kind in typing.get_args(AuditInbox))), max_size=3)
STRATEGIES[AuditBatch] = st.builds(
    AuditBatch, events=audit_events.map(lambda events: [msgspec.Raw(encode(e)) for e in events])
)


def union_messages(union: object) -> st.SearchStrategy:
    return st.one_of(*(STRATEGIES[kind] for kind in members(union)))


def test_every_union_member_has_a_strategy():
    every = {kind for union in UNIONS.values() for kind in members(union)}
    assert every == set(STRATEGIES)
    assert len(every) == 37  # Close goes to the verify and the draft lane


# --- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(UNIONS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_message_round_trips(name, data):
    union = UNIONS[name]
    message = data.draw(union_messages(union))
    decoded = Codec(union).decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message
    assert decoded.version == PROTOCOL


def test_round_trip_keeps_nested_values():
    """Spot check of the values the property test compares with ==: rows, decisions, params."""
    probs = np.array([[0.25, 0.75], [1.0, 0.0]], np.float32)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2**64 - 1, stop=("\n",))
    sent = Drafted(request_id="r", step=3, tokens=[1, 0], probs=Rows.of(probs), drafter="model", seconds=0.5)
    got = Codec(VerifyInbox).decode(encode(sent))
    assert isinstance(got, Drafted) and got.probs is not None
    np.testing.assert_array_equal(got.probs.array(), probs)
    opened = Codec(VerifyInbox).decode(
        encode(Open(request_id="r", step=0, tokens=[1, 2], params=params, seed=7))
    )
    assert isinstance(opened, Open)
    assert opened.params == params and opened.params.seed == 2**64 - 1 and opened.params.stop == ("\n",)
    verdict = Decision(2, 11, 0.5, 0.25, 0.875, False, 4)
    record = StepRecord(3, 2, [9, 4], 1, 0.5, 0.25, 2, "ngram", bonus=False)
    event = StepEvent(
        event_id="r:step:3", request_id="r", time=1.0, step=3, drafter="ngram", k=2, drafted=[9, 5],
        emitted=[9, 4], decisions=[verdict], final_u=None, draws=2, batch_size=3,
    )  # fmt: skip
    decided = Codec(DataInbox).decode(encode(Decided(request_id="r", step=3, record=record, event=event)))
    assert isinstance(decided, Decided) and decided.record == record and decided.event is not None
    assert decided.event.decisions[0].u == 0.875 and decided.event.decisions[0].replacement == 4


# --- Rows -----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=8),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    )
)
def test_rows_round_trip_float32_exactly(array):
    rows = Rows.of(array)
    assert rows.shape == array.shape
    back = rows.array()
    assert back.dtype == np.dtype("<f4")
    assert back.shape == array.shape
    # Bit for bit (NaN payloads and signed zeros included).
    assert back.view(np.uint32).tolist() == array.view(np.uint32).tolist()
    wire = Codec(VerifyInbox).decode(
        encode(Drafted(request_id="r", step=1, tokens=[], probs=rows, drafter="d", seconds=0.0))
    )
    assert isinstance(wire, Drafted) and wire.probs is not None
    assert wire.probs.array().view(np.uint32).tolist() == array.view(np.uint32).tolist()


def test_rows_of_converts_to_little_endian_float32():
    array = np.array([[0.1, 2.5, -3.0]], dtype=">f8")
    rows = Rows.of(array)
    assert len(rows.data) == 3 * 4
    np.testing.assert_array_equal(rows.array(), array.astype(np.float32))
    with pytest.raises(ValueError, match="2-D"):
        Rows.of(np.zeros(3, np.float32))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 6), width=st.integers(0, 6), length=st.integers(0, 200))
def test_rows_with_the_wrong_byte_length_are_a_bad_message(n, width, length):
    rows = Rows((n, width), b"\x00" * length)
    if length == n * width * 4:
        assert rows.array().shape == (n, width)
    else:
        with pytest.raises(BadMessage, match=f"need {n * width * 4} bytes, got {length}"):
            rows.array()


@pytest.mark.parametrize("shape", [(-1, 4), (4, -1), (-2, -2)])
def test_rows_with_a_negative_shape_are_a_bad_message(shape):
    with pytest.raises(BadMessage):
        Rows(shape, b"\x00" * 16).array()


# --- what is not a message ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(list(UNIONS)), data=st.binary(max_size=64))
def test_arbitrary_bytes_are_a_bad_message(name, data):
    with pytest.raises(BadMessage):
        CODECS[name].decode(data)


tags = st.sampled_from([kind.__name__ for kind in STRATEGIES] + ["Nope", ""])
field_names = st.sampled_from(
    ["request_id", "step", "tokens", "params", "pending", "position", "drafts", "lane", "kind", "event_ids"]
)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(list(UNIONS)),
    tag=tags,
    version=st.sampled_from([PROTOCOL, 0, 2, 99, "1", None]),
    fields=st.dictionaries(field_names, json_values, max_size=5),
)
def test_message_shaped_garbage_is_a_bad_message_or_a_valid_message(name, tag, version, fields):
    """Maps that look like messages (a known tag, wrong fields) never raise anything but BadMessage."""
    union = UNIONS[name]
    data = msgspec.msgpack.encode({"type": tag, "version": version, **fields})
    try:
        message = CODECS[name].decode(data)
    except BadMessage:
        return
    assert isinstance(message, members(union))
    assert type(message).__name__ == tag and message.version == PROTOCOL


PAIRS = [(a, b) for a in UNIONS for b in UNIONS if set(members(UNIONS[a])) - set(members(UNIONS[b]))]


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_another_sockets_message_is_a_bad_message(data):
    sender, receiver = data.draw(st.sampled_from(PAIRS))
    foreign = [kind for kind in members(UNIONS[sender]) if kind not in members(UNIONS[receiver])]
    message = data.draw(st.one_of(*(STRATEGIES[kind] for kind in foreign)))
    with pytest.raises(BadMessage, match="undecodable"):
        Codec(UNIONS[receiver]).decode(encode(message))


def test_a_draft_is_not_an_audit_event_and_a_verify_stays_inside_the_verify_lane():
    drafted = Drafted(request_id="r", step=1, tokens=[1, 2], probs=None, drafter="ngram", seconds=0.0)
    with pytest.raises(BadMessage, match="Drafted"):
        Codec(AuditInbox).decode(encode(drafted))
    assert Codec(VerifyInbox).decode(encode(drafted)) == drafted
    with pytest.raises(BadMessage, match="Verify"):  # its driver makes it: no socket takes one
        Codec(VerifyInbox).decode(encode(Verify(request_id="r", step=1, position=4, pending=7)))


def test_unknown_type_tag_is_a_bad_message():
    with pytest.raises(BadMessage, match="Nope"):
        Codec(VerifyInbox).decode(msgspec.msgpack.encode({"type": "Nope", "version": PROTOCOL}))
    with pytest.raises(BadMessage):
        Codec(VerifyInbox).decode(msgspec.msgpack.encode({"version": PROTOCOL, "request_id": "r"}))


def test_wrong_protocol_version_is_a_bad_message():
    fields = {"type": "StepsJournaled", "steps": {"r": 3}}
    journaled = Codec(VerifyInbox).decode(msgspec.msgpack.encode({**fields, "version": 1}))
    assert isinstance(journaled, StepsJournaled)
    with pytest.raises(BadMessage, match="protocol version 99"):
        Codec(VerifyInbox).decode(msgspec.msgpack.encode({**fields, "version": 99}))
    with pytest.raises(BadMessage, match="protocol version 99"):
        Codec(ClientRequest).decode(msgspec.msgpack.encode({"type": "StatusQuery", "version": 99}))


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"temperature": -1.0}, "temperature must be a finite number >= 0, got -1.0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"top_k": -3}, "top_k must be >= 0"),
        ({"seed": -1}, "seed must be in [0, 2**64), got -1"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"temperature": 0.5, "nucleus": 0.9}, "nucleus"),
    ],
)
def test_submit_with_invalid_sampling_params_names_the_problem(params, problem):
    data = msgspec.msgpack.encode({"type": "Submit", "version": PROTOCOL, "prompt": "hi", "params": params})
    with pytest.raises(BadMessage) as caught:
        Codec(ClientRequest).decode(data)
    assert problem in str(caught.value)
    assert "params" in str(caught.value)


def test_valid_submit_decodes_with_its_params():
    params = {"temperature": 0.9, "top_p": 0.5, "max_tokens": 3, "seed": 12}
    data = msgspec.msgpack.encode({"type": "Submit", "version": PROTOCOL, "prompt": "hi", "params": params})
    submit = Codec(ClientRequest).decode(data)
    assert isinstance(submit, Submit)
    assert submit.params == SamplingParams(temperature=0.9, top_p=0.5, max_tokens=3, seed=12)
    assert submit.prompt == "hi" and submit.drafter is None and submit.k is None

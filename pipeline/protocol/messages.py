"""Every message on every socket: msgspec Structs, msgpack-encoded, one tagged union per
socket, each carrying the protocol version.

Sockets and what they carry (the receiving side listens, senders dial):
- verify lane inbox (data): Open, Close, StepsJournaled from the orchestrator; Drafted from the draft lane
- draft lane inbox (data): DraftRequest, Close (from the verify lane, which drives each request's steps)
- audit lane inbox (data): RequestOpened, StepEvent, SpeculativeEvent, FaultEvent, LaneSnapshot
- orchestrator data inbox: Decided, StepFailed, Reported (from the verify lane): acted on at once
Inside the verify lane, its driver and its verifier exchange Verify, Opened and Verified.
- orchestrator control inbox: Fault, LaneUp, LaneDown, LaneFailed, Heartbeat, Shutdown, AuditAck: read at
  each tick, so none of them wakes the orchestrator
- orchestrator client socket (req/rep): Submit, Poll, Watch, Cancel, StatusQuery, MetricsQuery, Tokenize,
  Detokenize -> Submitted, Chunks, Watched, ErrorReply, StatusReport, MetricsReport, Tokens, Text
- gateway inbox: Pushed (from the orchestrator: the chunks of the streams a `Watch` with `push` asked for)

Work messages carry (request_id, step) so a repeat is recognised and answered from a cache
rather than executed twice, and a W3C trace context so spans parent across processes.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

import msgspec
import numpy as np

from pipeline.decoding.acceptance import Decision
from pipeline.decoding.logprobs import TokenLogprobs
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculation import Speculation
from pipeline.observability.process_stats import ProcessStats

PROTOCOL = 1

FaultKind = Literal[
    "draft_failed",
    "verification_failed",
    "max_iterations_exceeded",
    "lane_down",
    "lane_failed",
    "timeout",
    "bad_request",
    "unknown_request",
    "storage_full",
]


class BadMessage(ValueError):
    """Bytes that are not a message this socket takes (garbage, wrong type, other version)."""


class Rows(msgspec.Struct, frozen=True, array_like=True):
    """Float rows (draft probabilities, the target's features) as raw little-endian float32 bytes
    with their shape."""

    shape: tuple[int, int]
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> Rows:
        a = np.ascontiguousarray(array, dtype="<f4")
        if a.ndim != 2:
            raise ValueError(f"rows must be 2-D, got shape {a.shape}")
        return cls((int(a.shape[0]), int(a.shape[1])), a.tobytes())

    def problem(self) -> str | None:
        """Why these bytes are not float32 rows of this shape, or None."""
        n, width = self.shape
        if n < 0 or width < 0 or len(self.data) != n * width * 4:
            return f"rows of shape {self.shape} need {n * width * 4} bytes, got {len(self.data)}"
        return None

    def array(self) -> np.ndarray:
        if (problem := self.problem()) is not None:
            raise BadMessage(problem)
        return np.frombuffer(self.data, dtype="<f4").reshape(self.shape)


class Message(msgspec.Struct, tag_field="type", tag=True, kw_only=True, frozen=True):
    version: int = PROTOCOL


class Work(Message, frozen=True, kw_only=True):
    request_id: str
    step: int
    trace: dict[str, str] = {}


class StepRecord(msgspec.Struct, array_like=True, frozen=True):
    """One decided step: what `Session` needs to replay it (the orchestrator journals it, and a re-primed
    verify lane replays the journaled ones): step 0 is the prefill's first token (its
    `verify_seconds` is the prefill time). `draws` is the verifier's draw count after it."""

    step: int
    drafted: int
    tokens: list[int]
    accepted: int
    draft_seconds: float
    verify_seconds: float
    draws: int
    drafter: str = ""
    depth: int | None = None  # levels of the verified tree (None: a chain of `drafted`)
    offered: list[float] | None = None  # `tree.offered` of the step (None: a chain's)
    logprobs: list[TokenLogprobs] = []  # the tokens' entries, when asked: a replay streams them again
    bonus: bool = False  # the last token is the target's bonus, not a correction (`decoding.decided`)


# --- data lane: orchestrator -> verify lane -------------------------------------------


class Open(Work, frozen=True, kw_only=True):
    """Prefill `tokens` into a fresh KV cache. A new request samples its first token from
    the last position; a re-prime after a verifier restart (`sample=False`) feeds the
    accepted prefix and fast-forwards the random stream by `draws`. `prompt_length` says where
    the prompt ends in `tokens` (None: all of them), so penalties tell prompt from output. A
    re-prime also names `pending`, the newest output token (the next Verify feeds it): a grammar
    (`params.response_format`) must stand after the whole output, that token included.
    `features`: the request's drafter reads the target's features (`drafters.kinds`), so the
    Opened and every Verified carry those of the positions the lane computed and kept."""

    tokens: list[int]
    params: SamplingParams
    seed: int
    draws: int = 0
    sample: bool = True
    capacity: int = 0
    prompt_length: int | None = None
    pending: int | None = None
    features: bool = False
    # How the verify lane drives the request: its drafter and k policy, and (a re-prime) the steps
    # journaled so far, which rebuild its session exactly as the orchestrator's.
    speculation: Speculation = msgspec.field(default_factory=lambda: Speculation(drafter="none", k=0))
    history: list[StepRecord] = []
    # Which Open of the request this is: the driver stamps its Decided with it, and the orchestrator takes
    # only those of the last Open it sent (a stale driver's steps may cut the tokens into other steps).
    epoch: int = 0


class StepsJournaled(Message, frozen=True, kw_only=True):
    """The orchestrator has journaled each request's steps up to this number: the verify lane runs at most
    `run.run_ahead` steps past it (a step not journaled was never shown to a client)."""

    steps: dict[str, int]


class Verify(Work, frozen=True, kw_only=True):
    """Forward [pending, *drafts] at `position` (= KV-cache length) and decide the drafts: a
    chain, or the token tree whose node i continues node parents[i] (-1: `pending`)."""

    position: int
    pending: int
    drafts: list[int] = []
    draft_probs: Rows | None = None
    parents: list[int] | None = None


class Close(Message, frozen=True, kw_only=True):
    """The request is over: free its state. To the draft lane, `context` (prompt and output)
    lets the cross-request cache learn from it."""

    request_id: str
    context: list[int] = []


# --- data lane: verify lane -> draft lane ----------------------------------------------


class DraftRequest(Work, frozen=True, kw_only=True):
    """Everything a draft lane needs to (re)build the request's drafter, so a restarted
    lane serves the next step without a handshake. `features`: the target's features at
    positions [features_at, ...) that the verify lane sent since the last DraftRequest (for a
    drafter that reads them; a restarted lane's drafter starts its history where they begin)."""

    drafter: str
    params: SamplingParams
    seed: int
    prompt_length: int
    context: list[int]
    k: int  # draft nodes at most
    tree: bool = False  # a token tree welcome (`decoding.tree`), not only a chain
    floor: float = 0.0  # the least weight of a tree's likeliest first node (`Controller.floor`)
    features: Rows | None = None
    features_at: int = 0


# --- inside the verify lane (verifier -> driver), and draft lane -> verify lane ---------


class Opened(Work, frozen=True, kw_only=True):
    """The prompt (or a re-prime's prefix) is in. With `Open.features`, `features` are the target's
    features at positions [features_at, ...): those this lane computed (copied prefixes have none)."""

    token: int | None
    u: float | None
    draws: int
    seconds: float
    backend: str = ""  # the runtime that computed it ("torch:int4", "numpy:f32"): see model.backends
    row_seconds: list[float] = []  # the lane's calibrated t(rows) (`model.calibration`)
    logprobs: list[TokenLogprobs] = []  # the first token's entry, when `params.logprobs` asks
    features: Rows | None = None
    features_at: int = 0


class Verified(Work, frozen=True, kw_only=True):
    tokens: list[int]
    accepted: int
    decisions: list[Decision]
    final_u: float | None
    draws: int
    batch_size: int
    seconds: float
    backend: str = ""
    path: list[int] = []  # the verified nodes kept, root first (indices among `verified`)
    # The draft nodes the forward ran, as indices into the Verify's drafts (None: all of them). A
    # grammar cuts the nodes it forbids before the forward: they were never offered to the target.
    verified: list[int] | None = None
    logprobs: list[TokenLogprobs] = []  # one per token of `tokens`, when `params.logprobs` asks
    # With `Open.features`: the kept rows' features, the pending token's position first, then
    # the accepted drafts' (`TargetState.conclude`).
    features: Rows | None = None
    features_at: int = 0


class Drafted(Work, frozen=True, kw_only=True):
    tokens: list[int]
    probs: Rows | None
    drafter: str
    seconds: float
    parents: list[int] | None = None  # a token tree's shape; None: a chain
    shares: list[float] | None = None  # each node's share of its parent's candidates


class Decided(Work, frozen=True, kw_only=True):
    """A step the verify lane decided, to the orchestrator: the journal's record of it and its audit
    event (`record` None: a re-primed request that was already over). `over`: no step follows."""

    record: StepRecord | None
    event: StepEvent | None = None
    over: bool = False
    epoch: int = 0  # the Open the deciding driver started from


class StepFailed(Work, frozen=True, kw_only=True):
    origin: Literal["open", "verify", "draft"]
    kind: FaultKind
    message: str


class Reported(Message, frozen=True, kw_only=True):
    """The verify lane's report of a burst: every step it decided (and every failure) since its last
    report, in order, as one message. One a step cost both processes a wake-up and a socket round
    each, on the cores the forward runs on."""

    messages: list[Decided | StepFailed]


class AuditAck(Message, frozen=True, kw_only=True):
    event_ids: list[str]


# --- data lane: orchestrator -> audit lane (immutable events with ids) ----------------


class AuditEvent(Message, frozen=True, kw_only=True):
    event_id: str
    request_id: str
    time: float
    trace: dict[str, str] = {}  # the request's trace context: the audit lane's spans join it


class RequestOpened(AuditEvent, frozen=True, kw_only=True):
    settings: dict[str, Any]
    prompt_tokens: list[int]


class StepEvent(AuditEvent, frozen=True, kw_only=True):
    """One verify pass (step 0 is the prefill that sampled the first token)."""

    step: int
    drafter: str
    k: int
    drafted: list[int]
    emitted: list[int]
    decisions: list[Decision]
    final_u: float | None
    draws: int
    batch_size: int
    backend: str = ""  # the verify lane's runtime for this step: `audit verify` recomputes with it
    parents: list[int] | None = None  # `drafted` as a token tree (None: a chain)


class AuditBatch(Message, frozen=True, kw_only=True):
    """Several audit events in one message: the events of a burst of decided steps (or a re-send),
    which the audit lane writes in one transaction. Each stays the exact bytes the orchestrator's
    outbox keeps (`msgspec.Raw`), so a batch costs no re-encoding and a bad event costs only itself."""

    events: list[msgspec.Raw]


class SpeculativeEvent(AuditEvent, frozen=True, kw_only=True):
    """Per-request summary."""

    drafted: int
    accepted: int
    acceptance_rate: float
    iterations: int
    content_length: int
    finish_reason: str
    stats: dict[str, Any]
    tokens: list[int] = []  # the output the client was served (emitted tokens cut at the stop)


class FaultEvent(AuditEvent, frozen=True, kw_only=True):
    fault: Fault


class LaneSnapshot(AuditEvent, frozen=True, kw_only=True):
    """A lane's running totals as its heartbeat reported them (request_id is "": not per request)."""

    lane: str
    pid: int | None
    restarts: int
    lane_state: str  # starting | up | down
    totals: SpeculativeState


# --- control lane ---------------------------------------------------------------------


class SpeculativeState(msgspec.Struct, kw_only=True):
    """Running totals a lane reports in its heartbeats."""

    runs: int = 0
    drafted: int = 0
    accepted: int = 0
    active_requests: int = 0
    batches: int = 0
    batched_rows: int = 0
    prompt_tokens_reused: int = 0  # verify lane: prompt positions copied from another cache, not computed
    # verify lane: seconds spent in each phase of its loop (`workers.loop_phases.LoopPhase`)
    loop_seconds: dict[str, float] = {}

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Fault(Message, frozen=True, kw_only=True):
    kind: FaultKind
    lane: str
    message: str
    request_id: str | None = None
    step: int | None = None
    time: float = 0.0


class LaneUp(Message, frozen=True, kw_only=True):
    lane: str
    pid: int
    restarts: int


class LaneDown(Message, frozen=True, kw_only=True):
    lane: str
    pid: int
    returncode: int | None
    restarts: int


class LaneFailed(Message, frozen=True, kw_only=True):
    """The lane died once more than the restart intensity allows: the supervisor leaves it down.
    `reason` is the process's own last error line. Repeated while the supervisor runs, so a
    restarted orchestrator learns it too (the control lane drops what it cannot deliver)."""

    lane: str
    pid: int
    returncode: int | None
    restarts: int
    reason: str


class Heartbeat(Message, frozen=True, kw_only=True):
    lane: str
    pid: int
    state: SpeculativeState
    runtime: dict[str, Any] = {}  # a model lane's backend, kernel path and CPU flags
    process: ProcessStats | None = None  # its own CPU, memory and fds (absent from an older sender)


class Shutdown(Message, frozen=True, kw_only=True):
    """The supervisor is stopping the pipeline: admit nothing new. With a drain window, the
    requests still unfinished when it ends are ended with a server_shutdown error (and journaled
    as finished, so no later start resumes them); without one the processes are stopped at once."""

    reason: str = ""
    drain_seconds: float = 0.0


# --- clients <-> orchestrator ---------------------------------------------------------


class Submit(Message, frozen=True, kw_only=True):
    """A prompt given one of three ways: text (`prompt`), chat `messages`, or token ids."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None  # the prompt as the model's token ids, used as given
    # A tool request's conversation kept structured (assistant `tool_calls`, `tool` results) and its
    # OpenAI `tools`: admission renders these through the model's own template where it renders tools
    # (model/tool_templates.py), and `messages`, the same turns in the fallback format, elsewhere.
    tools: list[dict[str, Any]] | None = None
    tool_messages: list[dict[str, Any]] | None = None
    chat: bool = False
    params: SamplingParams = SamplingParams()
    drafter: str | None = None  # None: the configured default
    k: int | None = None  # None: the configured policy
    max_iterations: int | None = None
    trace: dict[str, str] = {}  # the caller's W3C trace context: the request's trace joins it
    # A client's random key: a Submit repeated with it (its reply was lost) gets the same request
    # back instead of a second one, so a client may retry a Submit across an orchestrator restart.
    idempotency_key: str = ""
    owner: str = ""  # "gateway:<pid>": the gateway's requests, cancelled when that process dies
    # The id this request asks for: "" (a fresh one), or `<32 hex digits>-<index>`, the id of one
    # choice of an OpenAI request with n > 1 (`api/choices.py`); refused if it is taken.
    request_id: str = ""


class Poll(Message, frozen=True, kw_only=True):
    """Chunks with seq > after; waits up to `wait` seconds for one if none is ready. `secret` is
    the one `Submitted` handed out: a request is read and cancelled only by whoever submitted it."""

    request_id: str
    secret: str = ""
    after: int = -1
    wait: float = 1.0


class Cursor(msgspec.Struct, frozen=True, array_like=True):
    """One stream of a `Watch`: its request, the secret, and the last chunk seen (-1: none yet)."""

    request_id: str
    secret: str
    after: int = -1


class Watch(Message, frozen=True, kw_only=True):
    """`Poll` for many streams at once (the gateway's): answered as soon as any of them has news, or
    after `wait` seconds, with the news of all of them. `watcher` names the client; a newer Watch of
    the same watcher answers the one still waiting at once, so a stream that joined is never held
    up behind a wait that does not ask about it."""

    watcher: str
    cursors: list[Cursor]
    wait: float = 1.0
    # The watcher reads the gateway inbox (addresses.gateway): the orchestrator pushes these streams'
    # chunks there as they are decided (`Pushed`), and answers this watch with news only when the inbox
    # refused one. It answers it empty after `wait`, or when a newer watch supersedes it.
    push: bool = False


class Cancel(Message, frozen=True, kw_only=True):
    request_id: str
    secret: str = ""


class StatusQuery(Message, frozen=True, kw_only=True):
    pass


class Submitted(Message, frozen=True, kw_only=True):
    request_id: str
    prompt_tokens: int
    secret: str = ""  # what Poll and Cancel must present for this request


class Chunk(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprobs] = []  # one per token, when the request asked (`decoding.logprobs`)
    decided: str = ""  # how each token was decided, a letter per token (`decoding.decided`)


class Chunks(Message, frozen=True, kw_only=True):
    request_id: str
    chunks: list[Chunk]
    done: Result | None = None  # the final result, as `generate --json` prints it


class ErrorReply(Message, frozen=True, kw_only=True):
    kind: str
    message: str


class PushedStream(msgspec.Struct, frozen=True, array_like=True):
    """One stream's chunks after `after`. `after` lets the watcher see a gap (a push lost with a pipe):
    it watches again from where it really is."""

    after: int
    chunks: Chunks


class Pushed(Message, frozen=True, kw_only=True):
    """The news of the streams a watch subscribed (`Watch.push`), pushed to its watcher: as many
    streams as a burst of decided steps gave news, in one message (one wake-up of the gateway)."""

    watcher: str
    streams: list[PushedStream]


class Watched(Message, frozen=True, kw_only=True):
    """A `Watch`'s answer: `Chunks` for each stream with news (chunks after its cursor, or its end),
    and the ids of those that are unknown or not the caller's (`unknown_request`)."""

    streams: list[Chunks]
    unknown: list[str] = []


class LaneStatus(msgspec.Struct, kw_only=True):
    name: str
    state: str  # starting | up | stalled | down | failed
    pid: int | None
    restarts: int
    active_requests: int
    totals: SpeculativeState
    runtime: dict[str, Any] = {}
    reason: str = ""  # a failed lane's last error line
    process: ProcessStats | None = None  # from its last heartbeat while it runs


class StatusReport(Message, frozen=True, kw_only=True):
    lanes: list[LaneStatus]
    active_requests: int
    audit_pending: int
    totals: SpeculativeState
    faults: list[Fault]
    queued_requests: int = 0  # admitted, waiting for one of admission.max_running places
    closing: str = ""  # why the pipeline admits nothing new (it is shutting down), or ""
    ended_at_shutdown: int = 0  # requests its drain window ended unfinished (server_shutdown)
    storage: str = ""  # why the run directory's disk takes no new work now (full, low), or ""

    def lane(self, name: str) -> LaneStatus | None:
        """The lane called `name`, if this pipeline has one."""
        return next((lane for lane in self.lanes if lane.name == name), None)


class MetricsQuery(Message, frozen=True, kw_only=True):
    """The orchestrator's metrics in the Prometheus text format (the gateway's `GET /metrics`)."""


class MetricsReport(Message, frozen=True, kw_only=True):
    text: str  # made by prometheus_client from the OpenTelemetry instruments, never by hand
    content_type: str  # the exposition format's HTTP Content-Type


class Tokenize(Message, frozen=True, kw_only=True):
    """Text (or chat messages, through the chat template) to the ids a request would be given."""

    text: str | None = None
    messages: list[dict[str, str]] | None = None
    add_special: bool | None = None  # the BOS token; None: as a prompt gets it (the model's own flag)
    add_generation_prompt: bool = True  # messages only: end with the assistant's turn opening
    with_pieces: bool = False  # also each token's text


class Detokenize(Message, frozen=True, kw_only=True):
    tokens: list[int]


class Tokens(Message, frozen=True, kw_only=True):
    tokens: list[int]
    pieces: list[bytes] = []  # with_pieces: the bytes each token stands for (maybe part of a character)
    context_length: int = 0  # the model's context, for the HTTP API's max_model_len


class Text(Message, frozen=True, kw_only=True):
    text: str


VerifyInbox = Open | Close | StepsJournaled | Drafted | StepFailed  # StepFailed: a draft that failed
DraftInbox = DraftRequest | Close
AuditInbox = RequestOpened | StepEvent | SpeculativeEvent | FaultEvent | LaneSnapshot
AuditLaneInbox = AuditInbox | AuditBatch  # what the audit lane's socket takes (AuditInbox: what it stores)
DataInbox = Decided | StepFailed | Reported
ControlInbox = Fault | LaneUp | LaneDown | LaneFailed | Heartbeat | Shutdown | AuditAck
ClientRequest = Submit | Poll | Watch | Cancel | StatusQuery | MetricsQuery | Tokenize | Detokenize
GatewayInbox = Pushed
ClientReply = Submitted | Chunks | Watched | ErrorReply | StatusReport | MetricsReport | Tokens | Text

T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class Codec(Generic[T]):
    """Decodes one socket's union; anything else becomes a BadMessage saying why."""

    def __init__(self, union: Any) -> None:
        self.union = union
        self._decoder = msgspec.msgpack.Decoder(union)

    def decode(self, data: bytes) -> T:
        try:
            message = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise BadMessage(f"undecodable message ({len(data)} bytes): {exc}") from None
        if message.version != PROTOCOL:
            raise BadMessage(f"protocol version {message.version}; this build speaks {PROTOCOL}")
        return message

"""The pipeline's configuration: one TOML file, validated by msgspec, then overridden by
environment variables (`SPECLANES_<SECTION>_<KEY>`) and `--set section.key=value` flags,
in that order. `{run_dir}` in any string expands to the run directory, so the defaults
put every socket and the audit store in one place.
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pipeline.decoding.speculation import Speculation, SpeculationError
from pipeline.observability.export_files import DEFAULT_ROTATION, Rotation
from pipeline.protocol import address

LANES = ("orchestrator", "verify", "draft", "audit")
# Everything a supervisor can run: the lanes and the HTTP gateway.
COMPONENTS = (*LANES, "gateway")
# What a Submit adds to the JSON body it came from (field names, sampling settings, trace context).
MESSAGE_OVERHEAD = 64 << 10
# Nothing decodes without these: their failure stops the pipeline; the others' failure degrades it.
ESSENTIAL = ("orchestrator", "verify")
# The lanes `run.helper_nice` makes lighter than the verify lane's forward (pipeline/service/autogroup.py).
HELPERS = ("orchestrator", "audit")
# In a restarted orchestrator's environment: its predecessor's LaneDown (JSON), which no orchestrator
# was there to hear on the control lane.
PREDECESSOR = "SPECLANES_PREDECESSOR"


def default_run_dir(environ: Mapping[str, str] | None = None) -> str:
    base = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return str(Path(base) / f"speclanes-{os.getuid()}")


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class Run(Section):
    dir: str = ""
    # Which processes this host's supervisor runs (multi-host: split them across hosts).
    components: list[Literal["orchestrator", "verify", "draft", "audit", "gateway"]] = msgspec.field(
        default_factory=lambda: list(COMPONENTS)
    )
    heartbeat_seconds: float = 0.5
    # How long the verify lane waits for proposals still on their way from the draft lane, so those
    # requests' steps join the same batched forward.
    batch_window_seconds: float = 0.004
    # Drafters that run no draft model (ngram, suffix, learned, auto without one) draft inside the verify
    # lane, between its forwards, with no round trip to the draft lane; false: every draft request goes
    # to the draft lane. On 2 cores the trip and a second process drafting cost more than drafting
    # in place (docs/benchmarks.md, "Where drafts are made").
    draft_in_verify_lane: bool = True
    # Steps the verify lane may decide past what the orchestrator has journaled: it never waits for the
    # orchestrator between two forwards unless it is this far ahead.
    run_ahead: Annotated[int, Meta(ge=1, le=256)] = 8
    # How often the verify lane sends its decided steps to the orchestrator while it keeps decoding: 0,
    # after every forward; more means fewer, larger messages (fewer wake-ups of the orchestrator, the
    # audit lane, the gateway and polling clients) for up to that much added latency per token. A
    # request's first token and its end go at once whatever this is. 50 ms against 20 ms: 0.43 against
    # 0.69 ms of orchestrator CPU a token and about 10% more tok/s through the gateway on 2 cores
    # (docs/benchmarks.md); tokens then reach a reader 20 times a second.
    report_interval_seconds: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.05
    # How long the verify lane yields the CPU after sending decided steps while it has more to decode:
    # on a machine whose cores the forward's threads all use, the orchestrator, the audit lane and the
    # clients then handle them between two forwards instead of stalling one. 0 on a machine with cores
    # to spare.
    report_pause_seconds: Annotated[float, Meta(ge=0.0, le=0.1)] = 0.002
    # The autogroup nice (0-19) of the `HELPERS`' sessions. Where the kernel groups tasks by session, each
    # lane weighs as much as the verify lane, and a busy helper takes most of a forward thread's core; a
    # higher nice makes it wait for a free one: more tok/s with many clients, a little more inter-token
    # latency at times (docs/benchmarks.md, "Scheduling the helpers"). 0: as heavy as the verify lane.
    helper_nice: Annotated[int, Meta(ge=0, le=19)] = 0
    # Prompt rows per verify-lane forward while other requests decode; the rest waits for the next
    # forward, so their steps run between the chunks of a long prompt. 0: a whole prompt in one forward.
    # With none decoding, up to 512 rows (`Verifier.prefill_budget`).
    prefill_chunk: Annotated[int, Meta(ge=0, le=8192)] = 128
    # The orchestrator's write-ahead journal: a restarted orchestrator resumes every request from it.
    journal: str = "{run_dir}/journal.sqlite"


class ModelSection(Section):
    path: str = ""  # empty: the embedded SmolLM2-135M-Instruct
    draft_path: str = ""  # a smaller GGUF with the same vocabulary, for the `model` drafter
    # The `learned` drafter's head (`speclanes drafter train`); empty: the one found for the model.
    draft_head: str = ""
    # auto: the native backend where this machine builds its kernels, else the numpy reference (logged);
    # native/torch/numpy: that one or a clear error. A key such as "torch:bf16" also picks the format.
    backend: str = "auto"

    def __post_init__(self) -> None:
        name, _, weight_format = self.backend.partition(":")
        formats = {"auto": (), "native": ("q8",), "torch": ("int4", "bf16"), "numpy": ("f32",)}
        if name not in formats or (weight_format and weight_format not in formats[name]):
            raise ValueError(
                f"model.backend must be auto, native, native:q8, torch, torch:int4, torch:bf16, numpy or "
                f"numpy:f32, got {self.backend!r}"
            )


class Addresses(Section):
    """Where each inbox listens; senders dial the same string. nng URLs: ipc://PATH, tls+tcp://HOST:PORT
    (mutual TLS, see [tls]) or tcp://HOST:PORT on loopback (see pipeline/protocol/address.py)."""

    client: str = "ipc://{run_dir}/client.ipc"
    control: str = "ipc://{run_dir}/control.ipc"
    data: str = "ipc://{run_dir}/data.ipc"
    verify: str = "ipc://{run_dir}/verify.ipc"
    draft: str = "ipc://{run_dir}/draft.ipc"
    audit: str = "ipc://{run_dir}/audit.ipc"
    gateway: str = "ipc://{run_dir}/gateway.ipc"


# Optional bind addresses when they differ from what peers dial (tcp://0.0.0.0:PORT): one per
# address above, "" meaning "listen where peers dial".
Listen = msgspec.defstruct(
    "Listen", [(name, str, "") for name in Addresses.__struct_fields__], bases=(Section,), module=__name__
)


class Timeouts(Section):
    draft: float = 0.5  # a slower proposal is skipped: the step runs as plain decoding
    verify: float = 10.0  # then the step is re-sent (idempotent by request and step)
    prefill_per_token: float = 0.01  # added to `verify` for Open
    send: float = 5.0
    client_idle: float = 30.0  # a running request nobody polls for this long is cancelled
    retain: float = 120.0  # a finished request's chunks stay available for resuming this long
    poll_wait_max: float = 10.0


class Restart(Section):
    initial_backoff: float = 0.2
    max_backoff: float = 10.0
    reset_after: float = 30.0  # a lane up this long starts its back-off afresh
    shutdown_grace: float = 3.0  # SIGTERM, then SIGKILL after this long
    # A lane whose event loop has not beaten for this long (stopped, hung) is killed and restarted,
    # and the orchestrator stops counting it as up (0: never).
    hang_seconds: Annotated[float, Meta(ge=0)] = 5.0
    # Restart intensity, as in OTP: a lane restarted more than max_restarts times within
    # within_seconds is marked failed and left down (see pipeline/service/supervisor.py).
    max_restarts: Annotated[int, Meta(ge=0)] = 5
    within_seconds: Annotated[float, Meta(gt=0)] = 60.0

    def alive_path(self, run_dir: str, lane: str) -> Path:
        """Touched by the lane on every heartbeat; its age is what the supervisor watches."""
        return Path(run_dir) / f"{lane}.alive"


class Audit(Section):
    path: str = "{run_dir}/audit.sqlite"
    resend_after: float = 1.0  # unacknowledged events are sent again after this long
    snapshot_seconds: float = 60.0  # each lane's heartbeat totals are recorded this often (0: never)
    # whole requests whose last event is older are deleted (0: keep forever)
    max_age_days: Annotated[float, Meta(ge=0)] = 30.0
    max_requests: Annotated[int, Meta(ge=0)] = 10000  # only the newest this many are kept (0: no limit)
    prune_seconds: Annotated[float, Meta(gt=0)] = 300.0  # how often the audit lane applies the two limits
    # Events the audit lane has not acknowledged yet, at most; past it new requests are refused
    # ("overloaded") until it catches up. Nothing is dropped: the running requests' events wait.
    max_pending: Annotated[int, Meta(ge=1)] = 20000
    # The orchestrator holds the events it records this long and sends them as one batch, which the
    # audit lane writes in one transaction (one fsync) and acknowledges together; 0: with every tick
    # of the orchestrator. Nothing waits on it but the acknowledgement: the orchestrator keeps every
    # event until then. Each write costs the lane a commit, a span per request and an AuditAck, and
    # both processes a wake-up: CPU taken from the forward on a small machine (docs/benchmarks.md,
    # "What the per-step record keeping costs").
    batch_seconds: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.3


class Gateway(Section):
    """The OpenAI-compatible HTTP API (lanes/gateway.py), a client of the orchestrator."""

    enabled: bool = True  # false: not started even when run.components lists it
    host: str = "127.0.0.1"  # loopback unless API keys are set (pipeline/api/keys.py)
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    model: str = ""  # the model id clients name; "" means the target GGUF's file name without .gguf
    api_key_file: str = ""  # one API key per line; SPECLANES_API_KEY gives one more
    # A larger request body is refused with 413 before it is read into memory (1 MiB: a prompt far
    # longer than any context, so only abuse is refused).
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 1 << 20
    # OpenAI's `n`: the most choices one request may ask for, each a pipeline request of its own
    # (admission counts each); more is a 400 naming `n`.
    max_choices: Annotated[int, Meta(ge=1)] = 16
    # The max_tokens of a request that names none (nor max_completion_tokens); 0: no cap, it runs to
    # its end of sequence or the context's end, as vLLM's do.
    default_max_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    # Origins a browser may call the API from (CORS, answered by Starlette's CORSMiddleware); "*": any,
    # as llama-server and vLLM allow; []: no CORS headers. The API key is still required where set.
    cors_origins: list[str] = msgspec.field(default_factory=lambda: ["*"])


class Admission(Section):
    """How much work the orchestrator takes on (pipeline/orchestration/admission_queue.py)."""

    # Requests decoding at once; more wait their turn, first come first served.
    max_running: Annotated[int, Meta(ge=1)] = 16
    # Requests waiting their turn; one more is refused as overloaded (HTTP 429).
    max_queued: Annotated[int, Meta(ge=0)] = 64
    # The largest message the orchestrator's client socket takes; nng drops the connection of a client
    # that sends a larger one before it is read. Keep it above gateway.max_body_bytes (a Submit
    # encodes a JSON body in about as many bytes).
    max_message_bytes: Annotated[int, Meta(ge=4096)] = 2 << 20
    # Finished requests kept for resuming (each until timeouts.retain has passed); past this many the
    # oldest go first, so submit-and-cancel at any rate holds a bounded amount of memory.
    max_retained: Annotated[int, Meta(ge=1)] = 1024


class Tls(Section):
    """Mutual TLS on tls+tcp:// addresses (nng's TLS transport): every socket, listening or
    dialing, shows this host's certificate and accepts only peers whose certificate the CA
    signed. `speclanes certs make` writes all three files (pipeline/service/certs.py)."""

    ca_file: str = ""  # the pipeline's own CA certificate (PEM): the only one trusted
    cert_file: str = ""  # this host's certificate (PEM), signed by that CA
    key_file: str = ""  # its private key (PEM, mode 0600)
    # Allow plain tcp:// to hosts off loopback: no authentication, no encryption. Only for a network
    # that is private by other means.
    insecure_tcp: bool = False

    def configured(self) -> bool:
        return bool(self.ca_file and self.cert_file and self.key_file)


class StorageSection(Section):
    """The run directory's disk (pipeline/orchestration/storage.py): below `min_free_bytes` free,
    or after a write failed for want of space, new requests are refused (HTTP 503 storage_full)
    until space returns; the pipeline notices within about a second."""

    min_free_bytes: Annotated[int, Meta(ge=0)] = 64 * 2**20


class ShutdownSection(Section):
    """SIGTERM (`speclanes stop`, systemd, a container runtime) drains: nothing new is admitted
    (503 with Retry-After; /health 503 "draining"), in-flight requests have `drain_seconds` to
    finish (vLLM's --shutdown-timeout), then each one left ends with a server_shutdown error and
    is journaled as finished, so no later start resumes it. SIGINT, a second SIGTERM and
    `speclanes stop --now` stop at once (in-flight requests are resumed by the next start)."""

    drain_seconds: Annotated[float, Meta(ge=0)] = 30.0
    # after the drain window, how long the gateway gets to send the last streams their error and [DONE]
    flush_seconds: Annotated[float, Meta(ge=0)] = 1.0


class TelemetrySection(Section):
    """Where the default OTLP/JSON file export goes, and its bound: each process's file rotates
    at `file_max_bytes` and keeps `file_backups` older files; the files of processes that are
    gone are pruned, oldest first, to one process's share (pipeline/observability/export_files.py).
    Which exporters run, and where an OTLP collector is, follow the standard OTEL_* variables
    (see pipeline/observability/telemetry.py)."""

    dir: str = "{run_dir}/telemetry"
    file_max_bytes: Annotated[int, Meta(ge=2**20)] = DEFAULT_ROTATION.max_bytes  # > a batch line (~180 KB)
    file_backups: Annotated[int, Meta(ge=0, le=100)] = DEFAULT_ROTATION.backups

    def rotation(self) -> Rotation:
        return Rotation(self.file_max_bytes, self.file_backups)


class Config(Section):
    run: Run = msgspec.field(default_factory=Run)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    speculation: Speculation = msgspec.field(default_factory=Speculation)
    addresses: Addresses = msgspec.field(default_factory=Addresses)
    listen: Listen = msgspec.field(default_factory=Listen)
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    restart: Restart = msgspec.field(default_factory=Restart)
    audit: Audit = msgspec.field(default_factory=Audit)
    gateway: Gateway = msgspec.field(default_factory=Gateway)
    telemetry: TelemetrySection = msgspec.field(default_factory=TelemetrySection)
    shutdown: ShutdownSection = msgspec.field(default_factory=ShutdownSection)
    storage: StorageSection = msgspec.field(default_factory=StorageSection)
    tls: Tls = msgspec.field(default_factory=Tls)
    admission: Admission = msgspec.field(default_factory=Admission)

    def __post_init__(self) -> None:
        """Every address is one the pipeline may use (pipeline/protocol/address.py says which), and
        the gateway's largest Submit fits the orchestrator's client socket."""
        files, insecure = self.tls.configured(), self.tls.insecure_tcp
        for section in ("addresses", "listen"):
            for name in Addresses.__struct_fields__:
                url = getattr(getattr(self, section), name)
                address.check(f"{section}.{name}", url, tls_files=files, insecure_tcp=insecure)
        if self.gateway.max_body_bytes + MESSAGE_OVERHEAD > self.admission.max_message_bytes:
            raise ValueError(
                f"gateway.max_body_bytes ({self.gateway.max_body_bytes}) must leave "
                f"{MESSAGE_OVERHEAD} bytes under admission.max_message_bytes "
                f"({self.admission.max_message_bytes}): the gateway's Submits must fit the orchestrator's "
                "client socket"
            )

    def bind(self, name: str) -> str:
        return getattr(self.listen, name) or getattr(self.addresses, name)

    def run_id(self) -> str:
        """What ties the processes of one pipeline together in telemetry: its run directory."""
        return self.run.dir

    def model_id(self) -> str:
        """The served model's name (gen_ai.request.model, the HTTP API's model id)."""
        if self.gateway.model:
            return self.gateway.model
        from pipeline.model.default import DEFAULT_MODEL_FILE  # light: no numpy, no model

        return Path(self.model.path or DEFAULT_MODEL_FILE).name.removesuffix(".gguf")

    def processes(self) -> list[str]:
        """What this host's supervisor starts: run.components, less a disabled gateway."""
        return [c for c in self.run.components if c != "gateway" or self.gateway.enabled]


class ConfigError(ValueError):
    pass


def _value(text: str) -> Any:
    """A TOML value if it parses as one (3, 0.5, true, ["a"]), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set(data: dict[str, Any], dotted: str, text: str, origin: str) -> None:
    section, _, key = dotted.partition(".")
    fields = Config.__struct_fields__
    if section not in fields or not key:
        raise ConfigError(f"{origin}: unknown setting {dotted!r} (sections: {', '.join(fields)})")
    # A string setting keeps the text as typed: a path like 2024-01-01 must not become a date.
    types = {f.name: f.type for f in msgspec.structs.fields(type(getattr(Config(), section)))}
    data.setdefault(section, {})[key] = text if types.get(key) is str else _value(text)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for section, section_type in Config.__annotations__.items():
        for key in globals()[section_type].__struct_fields__:
            env_name = f"SPECLANES_{section}_{key}".upper()
            if env_name in environ:
                _set(data, f"{section}.{key}", environ[env_name], env_name)
    for item in overrides:
        dotted, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set takes section.key=value, got {item!r}")
        _set(data, dotted.strip(), text.strip(), "--set")
    try:
        config = msgspec.convert(data, Config)
    except (msgspec.ValidationError, ValueError) as exc:
        problem = f"speculation.{exc.__cause__}" if isinstance(exc.__cause__, SpeculationError) else exc
        raise ConfigError(f"{path or 'configuration'}: {problem}") from None
    return expand(config, environ)


def expand(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    run_dir = config.run.dir or default_run_dir(environ)
    raw = msgspec.to_builtins(config)
    raw["run"]["dir"] = run_dir

    def sub(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: sub(v) for k, v in node.items()}
        if isinstance(node, list):
            return [sub(v) for v in node]
        return node.replace("{run_dir}", run_dir) if isinstance(node, str) else node

    return msgspec.convert(sub(raw), Config)

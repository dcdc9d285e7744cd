"""A service you can trust (issue 13): hostile users and hostile input against one real pipeline.

One pipeline serves the module, with an API key on its gateway, in a run directory whose parent
every user can traverse: the run directory's own permissions are then the only barrier a probe
running as another user meets (pytest's temporary directories are 0700 and would refuse it first,
proving nothing). Each test checks that its attack fails *and* that the same move by the rightful
owner succeeds, so none of them can pass by not trying.

Covered elsewhere, not repeated here: a peer without the pipeline's certificate never reaches a
TLS lane (tests/test_tls.py, `test_a_lanes_listener_refuses_a_peer_that_is_not_a_lane`,
`test_a_client_without_the_pipelines_certificate_gets_no_answer`); unstructured garbage on every
socket (tests/test_pipeline.py, `test_fuzzed_client_socket_answers_every_garbage_with_an_error`,
`test_garbage_on_every_socket_disturbs_no_lane_and_no_request`); the run directory checks as unit
tests (tests/test_run_dir.py); the gateway's 413 and 401 with no pipeline behind it
(tests/test_gateway.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pynng
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.protocol.client import Client, PipelineError
from pipeline.protocol.messages import (
    ClientReply,
    Codec,
    Cursor,
    ErrorReply,
    Poll,
    Submit,
    Submitted,
    Watch,
    Watched,
)

from .pipeline_harness import Pipeline, alive, running_pipeline
from .test_gateway import _raw_post, assert_error, fetch_json
from .test_pipeline import CODE, PROMPTS, _reference

pytestmark = pytest.mark.slow

NOBODY = 65534
API_KEY = "hostile-suite-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LANE_NAMES = ("verify", "draft", "audit", "orchestrator", "gateway")


@pytest.fixture(scope="module")
def open_parent() -> Iterator[Path]:
    """A directory every user can enter and read (0755), to hold the run directory."""
    path = Path(tempfile.mkdtemp(prefix="speclanes-hostile-"))
    os.chmod(path, 0o755)
    (path / "readable.txt").write_text("anyone may read this\n")
    os.chmod(path / "readable.txt", 0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pipeline(open_parent: Path) -> Iterator[Pipeline]:
    settings_ = [
        "restart.initial_backoff=0.1",
        "timeouts.client_idle=10",
        "timeouts.poll_wait_max=1.0",  # a fuzzed poll for chunks that never come waits 1 s, not 10
        "gateway.default_max_tokens=16",  # a fuzzed null max_tokens would run to the context's end
    ]
    with running_pipeline(open_parent / "run", settings_, {"SPECLANES_API_KEY": API_KEY}) as p:
        yield p


# --- another user on the same host -------------------------------------------------------


def as_user(uid: int | None, probe: str, *args: str) -> list[str]:
    """Lines printed by `probe` (Python) run as `uid` (None: as ourselves, the control). The probe's
    imports happen before the switch (the interpreter lives under /root, 0700); it prints `ready`
    once it runs as that user, so a probe that died early cannot pass for one that was refused."""
    switch = f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n" if uid is not None else ""
    code = PROBE_PRELUDE + switch + "print('ready', os.getuid(), flush=True)\n" + probe
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"ready {os.getuid() if uid is None else uid}", done.stdout
    return lines[1:]


PROBE_PRELUDE = """
import os, sys
import pynng
from pipeline.protocol.messages import ClientReply, Codec, StatusQuery, encode
"""

READ_PROBE = """
def attempt(name, action):
    try:
        action()
        print(name, 'allowed')
    except PermissionError:
        print(name, 'denied')

parent, run, *files = sys.argv[1:]
attempt('control', lambda: open(parent + '/readable.txt').read())
attempt('list', lambda: os.listdir(run))
for path in files:
    attempt(os.path.basename(path), lambda: open(path, 'rb').read(1))
"""

DIAL_PROBE = """
for address in sys.argv[1:]:
    name = address.rsplit('/', 1)[-1]
    client = name.startswith('client')
    try:
        with (pynng.Req0 if client else pynng.Push0)(recv_timeout=3000, send_timeout=3000) as sock:
            sock.dial(address, block=True)
            if client:
                sock.send(encode(StatusQuery()))
                print(name, 'answered', type(Codec(ClientReply).decode(sock.recv())).__name__)
            else:
                sock.send(b'garbage from ' + str(os.getuid()).encode())
                print(name, 'sent')
    except pynng.NNGException as exc:
        print(name, 'refused', type(exc).__name__)
"""


def root_only() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a probe as another user (uid 65534); run as root to check this")


def test_another_user_cannot_read_the_run_directory_or_its_files(
    pipeline: Pipeline, open_parent: Path
) -> None:
    root_only()
    config = pipeline.config
    files = [str(pipeline.run_dir / "config.json"), config.run.journal, config.audit.path]
    files += [str(pipeline.run_dir / "supervisor.log"), str(pipeline.run_dir / "verify.log")]
    names = [Path(f).name for f in files]
    assert all(Path(f).parent == pipeline.run_dir for f in files), files
    ours = as_user(None, READ_PROBE, str(open_parent), str(pipeline.run_dir), *files)
    assert ours == [f"{what} allowed" for what in ("control", "list", *names)]
    theirs = as_user(NOBODY, READ_PROBE, str(open_parent), str(pipeline.run_dir), *files)
    assert theirs == ["control allowed"] + [f"{what} denied" for what in ("list", *names)]


def test_another_user_cannot_dial_any_socket_and_the_pipeline_hears_nothing(pipeline: Pipeline) -> None:
    root_only()
    addresses = pipeline.config.addresses
    dialed = [addresses.client, addresses.data, addresses.control]
    assert all(a.startswith("ipc://") and str(pipeline.run_dir) in a for a in dialed)

    def garbage_faults() -> list[str]:
        return [
            f.message
            for f in pipeline.status().faults
            if f.kind == "bad_request" and f.lane == "orchestrator"
        ]

    before = garbage_faults()
    theirs = as_user(NOBODY, DIAL_PROBE, *dialed)
    assert [line.split()[1] for line in theirs] == ["refused"] * 3, theirs
    time.sleep(1.0)  # what was sent would have been reported by now (the control below is)
    assert garbage_faults() == before
    # The control: the same probe as the pipeline's own user is answered, and its garbage reported.
    ours = as_user(None, DIAL_PROBE, *dialed)
    assert ours == ["client.ipc answered StatusReport", "data.ipc sent", "control.ipc sent"]
    deadline = time.monotonic() + 10
    while len(garbage_faults()) < len(before) + 2:
        assert time.monotonic() < deadline, "the owner's garbage was never reported"
        time.sleep(0.1)


@pytest.mark.parametrize("detach", [False, True], ids=["start", "start-detach"])
@pytest.mark.parametrize("hijack", ["world-writable", "another-users", "symlink"])
def test_start_refuses_a_run_directory_someone_else_prepared(
    pipeline: Pipeline, open_parent: Path, hijack: str, detach: bool
) -> None:
    """An attacker who creates the run directory first (0777, or theirs, or a link to theirs) would
    own the sockets' directory: `start` must refuse it, at once and in one line, touching nothing."""
    trap = Path(tempfile.mkdtemp(prefix="trap-", dir=open_parent))
    run_dir = trap
    if hijack == "world-writable":
        os.chmod(trap, 0o777)
        problem = "is writable by others (mode 777): refusing it"
    elif hijack == "another-users":
        root_only()
        os.chown(trap, NOBODY, NOBODY)
        problem = f"belongs to uid {NOBODY}, not to you: refusing it"
    else:
        run_dir = open_parent / f"link-{trap.name}"
        run_dir.symlink_to(trap)
        problem = "is not a directory (a symlink?): refusing it"
    command = [sys.executable, "-m", "pipeline.cli", "start", *(["--detach"] if detach else [])]
    started = time.monotonic()
    out = subprocess.run(
        [*command, f"--set=run.dir={run_dir}", "--set=gateway.port=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert out.returncode == 2 and out.stderr == f"speclanes: error: the run directory {run_dir} {problem}\n"
    assert elapsed < 5, f"refused after {elapsed:.2f} s"  # a Python start-up (2 s on a loaded CI), no lane
    assert list(trap.iterdir()) == []  # no lock, no log, no socket left in the attacker's directory
    # The control: the module's pipeline started in a directory it made itself, and serves.
    assert pipeline.status().lanes


def test_another_client_cannot_poll_or_cancel_a_request_knowing_only_its_id(pipeline: Pipeline) -> None:
    params = SamplingParams(max_tokens=40)
    ref = _reference(CODE, params, "none", 0)
    with pipeline.client() as owner, pipeline.client() as stranger:
        submitted = owner.submit(CODE, chat=True, params=params, drafter="ngram")
        request_id = submitted.request_id
        stream = owner.chunks(request_id)
        first = next(stream)  # the owner can poll
        assert not isinstance(first, Result) and first.seq == 0
        for secret in (None, "", "0" * 32, submitted.secret[:-1], submitted.secret + "0"):
            with pytest.raises(PipelineError) as polled:
                next(stranger.chunks(request_id, secret=secret))
            assert polled.value.kind == "unknown_request"
            with pytest.raises(PipelineError) as cancelled:
                stranger.cancel(request_id, secret=secret)
            assert cancelled.value.kind == "unknown_request"
            assert "secret" not in polled.value.message + cancelled.value.message
            cursor = Cursor(request_id, secret or "")  # a Watch with the wrong secret: unknown, at once
            assert stranger.call(Watch(watcher="w", cursors=[cursor], wait=5.0)) == Watched(
                streams=[], unknown=[request_id]
            )
        rest = list(stream)
        done = rest[-1]
        assert isinstance(done, Result) and done.finish_reason != "cancelled"
        assert done.tokens == ref.tokens
        assert "".join(c.text for c in [first, *rest[:-1]]) == ref.text  # type: ignore[union-attr]
        # With the secret (handed over by its owner), another connection resumes the whole stream.
        resumed = list(stranger.chunks(request_id, secret=submitted.secret))
        assert resumed[-1] == done and [c.seq for c in resumed[:-1]] == list(range(len(resumed) - 1))
        # A NaN wait from the owner is a bad request, not an internal error (the client fuzz found it).
        with pytest.raises(PipelineError) as nan_wait:
            owner.call(Poll(request_id=request_id, secret=submitted.secret, wait=math.nan))
        assert nan_wait.value.kind == "bad_request" and "wait" in nan_wait.value.message
        with pytest.raises(PipelineError) as nan_watch:
            owner.call(Watch(watcher="w", cursors=[Cursor(request_id, submitted.secret)], wait=math.nan))
        assert nan_watch.value.kind == "bad_request" and "wait" in nan_watch.value.message
        watched = stranger.call(Watch(watcher="w", cursors=[Cursor(request_id, submitted.secret, 2)]))
        assert watched.streams[0].chunks == resumed[3:-1] and watched.streams[0].done == done
        # ... and cancels: a second request, cancelled by the stranger holding its secret.
        long = owner.submit(CODE, chat=True, params=SamplingParams(max_tokens=2000, ignore_eos=True))
        stranger.cancel(long.request_id, secret=long.secret)
        *_, ended = owner.chunks(long.request_id)
        assert isinstance(ended, Result) and ended.finish_reason == "cancelled"


# --- the gateway's API key, end to end ---------------------------------------------------


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    return fetch_json(url, json.dumps(body).encode(), headers=headers)


def test_the_gateway_answers_401_without_the_key_and_serves_with_it(pipeline: Pipeline) -> None:
    url, model = pipeline.gateway_url, pipeline.config.model_id()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": CODE}],
        "max_tokens": 16,
        "temperature": 0,
    }
    before = pipeline.status().totals.runs
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, answer = post(f"{url}/v1/chat/completions", body, headers)
        assert status == 401, (headers, answer)
        assert_error(answer, code="invalid_api_key")
    assert post(f"{url}/v1/completions", {"prompt": "hi", "max_tokens": 4})[0] == 401
    assert fetch_json(f"{url}/health")[0] == 200  # health needs no key
    status, answer = post(f"{url}/v1/chat/completions", body, AUTH)
    assert status == 200, answer
    assert (
        answer["choices"][0]["message"]["content"]
        == _reference(CODE, SamplingParams(max_tokens=16), "none", 0).text
    )
    # Only the keyed request reached the pipeline.
    pipeline.wait_until(lambda r: r.totals.runs == before + 1, timeout=10, what="one run counted")


# --- bounded memory ----------------------------------------------------------------------


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """The process's resident set now (VmRSS) or at its peak so far (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def lane_pids(pipeline: Pipeline) -> dict[str, int]:
    report = pipeline.status()
    assert all(lane.state == "up" for lane in report.lanes), [(x.name, x.state) for x in report.lanes]
    return {lane.name: lane.pid for lane in report.lanes if lane.pid}


def rss_of(pids: dict[str, int]) -> dict[str, int]:
    return {name: rss_kib(pid) for name, pid in pids.items()}


def settle_rss(pids: dict[str, int], idle: dict[str, int], slack: float, timeout: float) -> dict[str, int]:
    """The lanes' RSS once every one is within `slack` of `idle`, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        now = rss_of(pids)
        if all(now[name] <= idle[name] * (1 + slack) for name in pids) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def report_rss(title: str, idle: dict[str, int], *stages: tuple[str, dict[str, int]]) -> None:
    print(f"\n{title} (VmRSS, MiB)")
    for name in idle:
        figures = "  ".join(f"{stage} {values[name] / 1024:7.1f}" for stage, values in stages)
        print(f"  {name:<12} idle {idle[name] / 1024:7.1f}  {figures}")


def run_concurrently(jobs: list[Callable[[], Any]], timeout: float = 180) -> list[Any]:
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return results


def eight_streams_equal_in_process(pipeline: Pipeline) -> None:
    params = SamplingParams(max_tokens=24)

    def one(i: int) -> Callable[[], Result]:
        def run() -> Result:
            with pipeline.client(timeout=60) as client:
                return client.complete(PROMPTS[i % 4], chat=True, params=params, drafter="ngram")

        return run

    for i, done in enumerate(run_concurrently([one(i) for i in range(8)])):
        assert done.tokens == _reference(PROMPTS[i % 4], params, "none", 0).tokens


def warm_up(pipeline: Pipeline) -> None:
    """Requests through each way in, so caches and allocator pools are in use before `idle`: normal
    streams, one over HTTP, and a round of near-cap Submits: the orchestrator's allocator keeps about
    12 MB after the first round of 2 MB messages and no more after the next ones (measured over five
    rounds), so without this the first round would count as growth."""
    eight_streams_equal_in_process(pipeline)
    body = {"model": pipeline.config.model_id(), "prompt": CODE, "max_tokens": 8}
    assert post(f"{pipeline.gateway_url}/v1/completions", body, AUTH)[0] == 200
    limit = pipeline.config.admission.max_message_bytes
    with Client(pipeline.config.addresses.client, timeout=60, max_message_bytes=limit) as client:
        for submit, refused in near_cap_submits(limit, 30):
            with contextlib.suppress(PipelineError) if refused else contextlib.nullcontext():
                client.cancel(client.request(submit).request_id)


def idle_after(pipeline: Pipeline) -> dict[str, int]:
    pipeline.wait_until(lambda r: r.active_requests == 0 and r.queued_requests == 0, what="idle")
    time.sleep(2.0)
    return rss_of(lane_pids(pipeline))


def near_cap_submits(cap: int, count: int) -> list[tuple[Submit, str | None]]:
    """Submits just under admission.max_message_bytes, each a short prompt asking for 10**9 tokens,
    with what the orchestrator must answer: padded in the trace context (read once, never kept),
    admitted, queued and clamped to the context; padded in the fields a request keeps for as long as
    it is retained (its idempotency key, its stop strings), refused naming the field."""
    room, params = cap - 64 * 1024, SamplingParams(max_tokens=10**9, ignore_eos=True)
    submits: list[tuple[Submit, str | None]] = []
    for i in range(count):
        pad = f"{i:04d}" + "k" * (room - 4)
        if i % 5 == 3:
            submits.append(
                (Submit(prompt=CODE, chat=True, params=params, idempotency_key=pad), "idempotency_key")
            )
        elif i % 5 == 4:
            stop = tuple(f"{i}-{n}-" + "s" * 1000 for n in range(room // 1100))
            stopping = SamplingParams(max_tokens=10**9, ignore_eos=True, stop=stop)
            submits.append((Submit(prompt=CODE, chat=True, params=stopping), "stop"))
        else:
            trace = {"traceparent": "00-" + "f" * 32 + "-" + "e" * 16 + "-01", "junk": pad}
            submits.append((Submit(prompt=CODE, chat=True, params=params, trace=trace), None))
    return submits


def test_huge_bodies_and_max_tokens_leave_every_lanes_memory_where_it_was(pipeline: Pipeline) -> None:
    warm_up(pipeline)
    pids = lane_pids(pipeline)
    assert {"verify", "draft", "audit", "orchestrator", "gateway"} <= set(pids)
    idle = idle_after(pipeline)
    model, cap = pipeline.config.model_id(), pipeline.config.gateway.max_body_bytes
    # 100 bodies over the gateway's cap, asking for 10**9 tokens: refused from the headers, or
    # (chunked) cut off as they pass the cap.
    body = json.dumps({"model": model, "prompt": "x" * (cap + 1000), "max_tokens": 10**9}).encode()
    for i in range(100):
        if i % 2:
            head = b"Content-Length: %d\r\n\r\n" % len(body)
            payload = body
        else:
            head = b"Transfer-Encoding: chunked\r\n\r\n"
            payload = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" % API_KEY.encode()
        )
        status, _, answer = _raw_post(pipeline.gateway_url, request + head, payload)
        assert status == 413, answer
    after_http = rss_of(pids)
    # Near the orchestrator's cap, over nng: admitted (they fit), queued, clamped to the context; then
    # cancelled by their owner.
    limit = pipeline.config.admission.max_message_bytes
    with Client(pipeline.config.addresses.client, timeout=60, max_message_bytes=limit) as client:
        submitted = []
        for submit, refused in near_cap_submits(limit, 30):
            if refused is None:
                submitted.append(client.request(submit))
            else:
                with pytest.raises(PipelineError) as info:
                    client.request(submit)
                assert info.value.kind == "bad_request" and refused in info.value.message
        report = pipeline.status()
        assert report.active_requests + report.queued_requests == len(submitted) == 18
        for sub in submitted:
            client.cancel(sub.request_id)
        for sub in submitted:
            *_, done = client.chunks(sub.request_id)
            assert isinstance(done, Result) and done.finish_reason == "cancelled"
    after_nng = rss_of(pids)
    eight_streams_equal_in_process(pipeline)
    assert lane_pids(pipeline) == pids  # nobody died on the way
    pipeline.wait_until(lambda r: r.active_requests == 0 and r.queued_requests == 0, what="idle")
    settled = settle_rss(pids, idle, 0.10, timeout=20)
    report_rss(
        "huge bodies and max_tokens", idle, ("after-413s", after_http), ("after-near-cap", after_nng),
        ("settled", settled),
    )  # fmt: skip
    grown = {name: f"{idle[name] / 1024:.1f} -> {settled[name] / 1024:.1f} MiB" for name in pids
             if settled[name] > idle[name] * 1.10}  # fmt: skip
    assert not grown, f"RSS did not return within 10% of idle: {grown}"


# --- structured fuzzing ------------------------------------------------------------------

BIG_INTS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63)]),
)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-320, 1e308]),
)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "\x00", "auto", "none", "ngram", "🦀" * 10]))


@st.composite
def big_list(draw: st.DrawFn, item: Any, limit: int = 200_000) -> list[Any]:
    """Short lists from `item` mostly; now and then an enormous one (still within the message cap)."""
    if draw(st.integers(0, 9)) == 0:
        return [draw(item)] * draw(st.integers(1000, limit))
    return draw(st.lists(item, max_size=8))


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


@st.composite
def one_hostile(
    draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]], hostile: st.SearchStrategy[dict[str, Any]]
) -> dict[str, Any]:
    """A valid message with one field (or none) from `hostile`: each value meets the checks alone
    rather than hiding behind another field's refusal."""
    message, fields = draw(valid), draw(hostile)
    if fields:
        key = draw(st.sampled_from(sorted(fields)))
        message[key] = fields[key]
    return message


PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": FLOATS, "top_k": BIG_INTS, "top_p": FLOATS, "seed": maybe(BIG_INTS),
        "max_tokens": st.one_of(BIG_INTS, st.integers(1, 4)), "stop": big_list(TEXT, 20_000),
        "ignore_eos": st.booleans(),
    },
)  # fmt: skip
SUBMITS = st.fixed_dictionaries(
    {"type": st.just("Submit")},
    optional={
        "version": st.sampled_from([1, 0, 2, -1, 2**63 - 1]), "prompt": maybe(TEXT),
        "messages": maybe(big_list(st.dictionaries(TEXT, TEXT, max_size=3), 50_000)),
        "chat": st.booleans(), "params": PARAMS, "drafter": maybe(TEXT), "k": maybe(BIG_INTS),
        "max_iterations": maybe(BIG_INTS), "trace": st.dictionaries(TEXT, TEXT, max_size=3),
        "idempotency_key": TEXT, "owner": TEXT,
    },
)  # fmt: skip


VALID_SUBMIT = st.fixed_dictionaries({
    "type": st.just("Submit"), "prompt": st.text(min_size=1, max_size=40), "chat": st.booleans(),
    "params": st.fixed_dictionaries({"max_tokens": st.integers(1, 4)}),
})  # fmt: skip


@st.composite
def client_messages(draw: st.DrawFn, live: tuple[str, str]) -> dict[str, Any]:
    """A valid-shaped client message with hostile values; polls and cancels name unknown ids, or
    the live request's id with a wrong secret or (to reach past the ownership check) the right one."""
    kind = draw(st.sampled_from(["Submit", "Poll", "Cancel", "StatusQuery"]))
    if kind == "Submit":
        return draw(st.one_of(one_hostile(VALID_SUBMIT, SUBMITS), SUBMITS))
    if kind == "StatusQuery":
        return {"type": kind}
    whose = draw(st.sampled_from(["unknown", "wrong secret", "owner"]))
    request_id = live[0] if whose != "unknown" else draw(TEXT)
    secret = live[1] if whose == "owner" else draw(TEXT)
    message = {"type": kind, "request_id": request_id, "secret": secret}
    if kind == "Poll":
        message["after"] = draw(BIG_INTS)
        message["wait"] = draw(st.one_of(FLOATS, st.sampled_from([0.0, 0.01, -1.0])))
    return message


SLOW_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
ERROR_KINDS = {"bad_request", "prompt_too_long", "overloaded", "unknown_request"}


def lane_health(pipeline: Pipeline) -> tuple[dict[str, tuple[int | None, int, str]], dict[str, int]]:
    report = pipeline.status()
    return {lane.name: (lane.pid, lane.restarts, lane.state) for lane in report.lanes}, rss_of(
        lane_pids(pipeline)
    )


def assert_unharmed(pipeline: Pipeline, before: tuple[dict, dict], title: str) -> None:
    """Same processes, all up; the orchestrator answers status; each still serves the right output;
    no lane's RSS grew by more than 10%."""
    lanes_before, rss_before = before
    pipeline.wait_until(lambda r: r.active_requests == 0 and r.queued_requests == 0, what="idle", timeout=60)
    params = SamplingParams(max_tokens=16)
    with pipeline.client() as client:
        assert client.complete(CODE, chat=True, params=params, drafter="ngram").tokens == (
            _reference(CODE, params, "none", 0).tokens
        )
    lanes_after, _ = lane_health(pipeline)
    assert lanes_after == lanes_before
    assert all(alive(pid) for pid, _, _ in lanes_after.values() if pid)
    pids = lane_pids(pipeline)
    settled = settle_rss(pids, rss_before, 0.10, timeout=15)
    report_rss(title, rss_before, ("after", settled))
    grown = {n: f"{rss_before[n] / 1024:.1f} -> {settled[n] / 1024:.1f} MiB" for n in pids
             if settled[n] > rss_before[n] * 1.10}  # fmt: skip
    assert not grown, f"RSS grew by more than 10%: {grown}"


@pytest.fixture(scope="module")
def live_request(pipeline: Pipeline) -> Iterator[Submitted]:
    """A long request running while the client socket is fuzzed, so fuzzed polls and cancels can
    name a request that exists."""
    with pipeline.client() as client:
        yield client.submit(CODE, chat=True, params=SamplingParams(max_tokens=2000, ignore_eos=True))


@pytest.fixture(scope="module")
def warmed(pipeline: Pipeline) -> None:
    warm_up(pipeline)


@pytest.fixture
def before_fuzzing(pipeline: Pipeline, warmed: None) -> tuple[dict, dict]:
    """Each fuzz test's own baseline: lanes, pids and RSS once the pipeline is idle."""
    idle_after(pipeline)
    return lane_health(pipeline)


def _client_fuzz(pipeline: Pipeline, live: Submitted, max_examples: int) -> list[str]:
    seen: list[str] = []
    codec: Codec[Any] = Codec(ClientReply)

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=SLOW_CHECKS)
    @given(message=client_messages((live.request_id, live.secret)))
    def fuzz(message: dict[str, Any]) -> None:
        data = msgspec.msgpack.encode(message)
        assert len(data) < pipeline.config.admission.max_message_bytes
        with pynng.Req0(
            dial=pipeline.config.addresses.client, recv_timeout=30_000, send_timeout=10_000
        ) as sock:
            sock.send(data)
            reply = codec.decode(sock.recv())
            if isinstance(reply, Submitted):  # a hostile Submit that was admitted: its owner ends it
                sock.send(msgspec.msgpack.encode({"type": "Cancel", "request_id": reply.request_id,
                                                  "secret": reply.secret}))  # fmt: skip
                codec.decode(sock.recv())
        if isinstance(reply, ErrorReply):
            assert reply.kind in ERROR_KINDS and reply.message, (message, reply)
        seen.append(type(reply).__name__ if not isinstance(reply, ErrorReply) else reply.kind)

    fuzz()
    return seen


def test_structured_fuzz_of_the_client_socket(
    pipeline: Pipeline, before_fuzzing: tuple[dict, dict], live_request: Submitted
) -> None:
    started = time.monotonic()
    seen = _client_fuzz(pipeline, live_request, max_examples=100)
    print(f"\nclient socket: {len(seen)} messages in {time.monotonic() - started:.1f} s:",
          {kind: seen.count(kind) for kind in sorted(set(seen))})  # fmt: skip
    with pipeline.client() as client:
        client.cancel(live_request.request_id, secret=live_request.secret)
    assert_unharmed(pipeline, before_fuzzing, "after fuzzing the client socket")


# Lane names no process has: control messages about real lanes are the supervisor's word (the
# trust boundary: whatever reaches a data or control socket is a lane), so they are not fuzzed.
PHANTOM = st.text(min_size=1, max_size=12).filter(lambda name: name not in LANE_NAMES)
UNKNOWN_ID = st.one_of(st.text(max_size=40), st.just("nobody")).map(lambda s: "fuzz-" + s)
TOKENS = big_list(st.one_of(st.integers(0, 49151), BIG_INTS), 400_000)
ROWS = st.builds(
    lambda shape, data: [list(shape), data], st.tuples(BIG_INTS, BIG_INTS), st.binary(max_size=64)
)
FUZZ_PARAMS = st.fixed_dictionaries({"max_tokens": st.integers(1, 4)}, optional={"temperature": FLOATS})


def work(kind: str, /, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A work message (request id, step, trace) of `kind` for a request nobody knows."""
    base = {"type": st.just(kind), "request_id": UNKNOWN_ID, "step": BIG_INTS}
    return st.fixed_dictionaries(
        {**base, **fields}, optional={"trace": st.dictionaries(TEXT, TEXT, max_size=2)}
    )


def shaped(kind: str, /, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"type": st.just(kind), **fields})


FAULT_KIND = st.sampled_from(["draft_failed", "timeout", "bad_request", "unknown_request"])
TOTALS = st.fixed_dictionaries({}, optional={"runs": BIG_INTS, "drafted": BIG_INTS})
INBOXES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "data": st.one_of(
        work("Opened", token=maybe(BIG_INTS), u=maybe(FLOATS), draws=BIG_INTS, seconds=FLOATS),
        work(
            "Verified", tokens=TOKENS, accepted=BIG_INTS, decisions=st.just([]), final_u=maybe(FLOATS),
            draws=BIG_INTS, batch_size=BIG_INTS, seconds=FLOATS,
        ),
        work("Drafted", tokens=TOKENS, probs=maybe(ROWS), drafter=TEXT, seconds=FLOATS),
        work(
            "StepFailed", origin=st.sampled_from(["open", "verify", "draft"]), kind=FAULT_KIND, message=TEXT
        ),
        shaped("AuditAck", event_ids=big_list(TEXT, 100_000)),
    ),
    "control": st.one_of(
        shaped(
            "Fault", lane=TEXT, message=TEXT, request_id=maybe(UNKNOWN_ID), kind=FAULT_KIND,
            step=maybe(BIG_INTS), time=FLOATS,
        ),
        shaped("Heartbeat", lane=PHANTOM, pid=BIG_INTS, state=TOTALS),
        shaped("LaneUp", lane=PHANTOM, pid=BIG_INTS, restarts=BIG_INTS),
        shaped("LaneDown", lane=PHANTOM, pid=BIG_INTS, returncode=maybe(BIG_INTS), restarts=BIG_INTS),
    ),
    "verify": st.one_of(
        # An Open the lane accepts is followed by its Close (sent with it): a prefill for nobody.
        work(
            "Open", tokens=TOKENS, params=FUZZ_PARAMS, seed=BIG_INTS, draws=BIG_INTS, sample=st.booleans(),
            capacity=BIG_INTS,
        ),
        work("Verify", position=BIG_INTS, pending=BIG_INTS, drafts=TOKENS, draft_probs=maybe(ROWS)),
    ),
    "draft": work(
        "DraftRequest", drafter=st.sampled_from(["ngram", "suffix", "none", "auto", "model", "?"]),
        params=FUZZ_PARAMS, seed=BIG_INTS, prompt_length=BIG_INTS, context=TOKENS, k=BIG_INTS,
    ),
    "audit": st.one_of(
        shaped(
            "FaultEvent", event_id=UNKNOWN_ID, request_id=UNKNOWN_ID, time=FLOATS,
            fault=shaped("Fault", kind=FAULT_KIND, lane=TEXT, message=TEXT),
        ),
        shaped(
            "LaneSnapshot", event_id=UNKNOWN_ID, request_id=st.just(""), time=FLOATS, lane=PHANTOM,
            pid=maybe(BIG_INTS), restarts=BIG_INTS, lane_state=TEXT, totals=st.just({}),
        ),
    ),
}  # fmt: skip


def test_structured_fuzz_of_every_inbox(pipeline: Pipeline, before_fuzzing: tuple[dict, dict]) -> None:
    """Valid-shaped messages with hostile values, about requests nobody has, into the orchestrator's
    data and control inboxes and each lane's inbox: reported or ignored, never a death or a leak."""
    addresses = pipeline.config.addresses
    sockets = {
        name: pynng.Push0(dial=getattr(addresses, name), send_timeout=10_000)
        for name in ("data", "control", "verify", "draft", "audit")
    }
    sent: dict[str, int] = dict.fromkeys(sockets, 0)
    started = time.monotonic()

    def fuzz_round(examples: int) -> None:
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=SLOW_CHECKS)
        @given(inbox=st.sampled_from(sorted(INBOXES)), data=st.data())
        def fuzz(inbox: str, data: st.DataObject) -> None:
            message = data.draw(INBOXES[inbox])
            encoded = msgspec.msgpack.encode(message)
            assert len(encoded) < 8 << 20
            sockets[inbox].send(encoded)
            if message["type"] == "Open":
                sockets[inbox].send(
                    msgspec.msgpack.encode({"type": "Close", "request_id": message["request_id"]})
                )
            sent[inbox] += 1

        fuzz()
        time.sleep(0.5)  # let the queues drain

    try:
        # A first round populates the lanes' allocator pools. The verify lane's RSS swings by 20-45 MB
        # with messages of 400k tokens and comes back down (measured over four rounds: 222 MiB idle,
        # then 248, 205, 205, 250), so what counts is the second round against the first one's peak
        # (VmHWM): memory that accumulated would take it past that.
        fuzz_round(150)
        lanes, _ = lane_health(pipeline)
        assert lanes == before_fuzzing[0]
        peaks = {name: rss_kib(pid, "VmHWM") for name, pid in lane_pids(pipeline).items()}
        before_fuzzing = (lanes, {name: max(peaks[name], before_fuzzing[1][name]) for name in peaks})
        fuzz_round(150)
    finally:
        for sock in sockets.values():
            sock.close()
    print(f"\ninboxes: {sent} in {time.monotonic() - started:.1f} s")
    assert all(sent.values())
    assert_unharmed(pipeline, before_fuzzing, "after fuzzing every inbox")


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
SMALL_OR_HOSTILE = st.one_of(
    st.integers(0, 6), st.integers(2**31, 2**70), st.integers(-(2**70), -1), JSON_VALUES
)
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
BIAS_KEY = st.one_of(st.integers(-5, 2**70).map(str), st.text(max_size=4))  # token ids, as OpenAI writes them
BIAS_VALUE = st.one_of(st.floats(-200, 200), SMALL_OR_HOSTILE)
COMMON = {
    "model": st.one_of(st.just(MODEL_ID), JSON_VALUES),
    "temperature": st.one_of(st.floats(-10, 10, allow_nan=False), JSON_VALUES), "top_p": JSON_VALUES,
    "top_k": st.one_of(st.integers(-5, 100), JSON_VALUES),
    "seed": st.one_of(st.integers(-(2**70), 2**70), JSON_VALUES),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), JSON_VALUES),
    # Hostile n only: below 1, over the cap (16), huge, not a number, all 400s. Valid n > 1 is served
    # (tests/test_choices_api.py, test_gateway.py): sixteen choices of a default max_tokens here are
    # minutes of decoding and many KV caches at once, not a hostile value.
    "n": st.one_of(
        st.integers(-3, 1), st.integers(17, 2**70), JSON_VALUES.filter(lambda v: not isinstance(v, int))
    ),
    "stream": st.one_of(st.booleans(), JSON_VALUES), "ignore_eos": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_VALUES),
    "speculation": st.one_of(
        st.fixed_dictionaries({}, optional={"drafter": st.sampled_from(["ngram", "none", "auto", "x"]),
                                            "k": st.one_of(st.integers(-3, 40), st.just("auto"), JSON_VALUES),
                                            "max_iterations": SMALL_OR_HOSTILE}),
        JSON_VALUES,
    ),
    "logprobs": st.one_of(st.booleans(), st.integers(-3, 25), JSON_VALUES),
    "top_logprobs": st.one_of(st.integers(-3, 25), JSON_VALUES),
    "presence_penalty": st.one_of(st.floats(-3, 3), JSON_VALUES),
    "frequency_penalty": st.one_of(st.floats(-3, 3), JSON_VALUES),
    "repetition_penalty": st.one_of(st.floats(-1, 3), JSON_VALUES),
    "min_p": st.one_of(st.floats(-1, 2), JSON_VALUES),
    "logit_bias": st.one_of(st.dictionaries(BIAS_KEY, BIAS_VALUE, max_size=4), JSON_VALUES),
}  # fmt: skip
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
CONTENT = st.one_of(st.text(max_size=60), st.lists(TEXT_PART, max_size=3), JSON_VALUES)
ROLE = st.sampled_from(["user", "system", "assistant", "tool", ""])
CHAT_MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLE}, optional={"content": CONTENT}), max_size=4)
PROMPT_FIELD = st.one_of(
    st.text(max_size=80), st.lists(st.text(max_size=20), max_size=3), JSON_VALUES,
    st.lists(SMALL_OR_HOSTILE, max_size=6),  # token ids, in and out of the vocabulary
    st.lists(st.lists(st.integers(-3, 60_000), max_size=6), max_size=2),
)  # fmt: skip
COMPLETION = st.fixed_dictionaries(
    {"max_tokens": SMALL_OR_HOSTILE},
    optional={
        **COMMON,
        "prompt": PROMPT_FIELD,
        "echo": JSON_VALUES,
        "best_of": JSON_VALUES,
        "suffix": JSON_VALUES,
    },
)
CHAT = st.fixed_dictionaries(
    {"max_tokens": SMALL_OR_HOSTILE},
    optional={
        **COMMON, "messages": st.one_of(CHAT_MESSAGES, JSON_VALUES),
        "max_completion_tokens": SMALL_OR_HOSTILE,
        "tools": JSON_VALUES, "response_format": JSON_VALUES,
    },
)  # fmt: skip
VALID_COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL_ID), "prompt": st.text(min_size=1, max_size=40), "max_tokens": st.integers(1, 4)},
    optional={"stream": st.booleans(), "temperature": st.floats(0, 2), "seed": st.integers(0, 2**32)},
)
USER_TURN = st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=40)})
VALID_CHAT = st.fixed_dictionaries(
    {
        "model": st.just(MODEL_ID), "max_tokens": st.integers(1, 4),
        "messages": st.lists(USER_TURN, min_size=1, max_size=2),
    },
    optional={"stream": st.booleans(), "temperature": st.floats(0, 2), "seed": st.integers(0, 2**32)},
)  # fmt: skip
HTTP_BODIES = st.one_of(
    st.tuples(st.just("/v1/completions"), one_hostile(VALID_COMPLETION, COMPLETION)),
    st.tuples(st.just("/v1/chat/completions"), one_hostile(VALID_CHAT, CHAT)),
    st.tuples(st.just("/v1/completions"), COMPLETION),
    st.tuples(st.just("/v1/chat/completions"), CHAT),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), JSON_VALUES),
)


def http_call(url: str, body: Any) -> tuple[int, bytes]:
    """Status and whole body (a stream read to its end) of one POST with the API key."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **AUTH}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_fuzzed_http_api_never_answers_500(pipeline: Pipeline, before_fuzzing: tuple[dict, dict]) -> None:
    """The gateway serves no OpenAPI schema, so hypothesis builds the bodies: the OpenAI shapes with
    hostile values, and arbitrary JSON. Every answer is a success or a client error in the OpenAI
    shape; never a 5xx."""
    statuses: list[int] = []
    started = time.monotonic()

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=SLOW_CHECKS)
    @given(call=HTTP_BODIES)
    def fuzz(call: tuple[str, Any]) -> None:
        path, body = call
        status, payload = http_call(pipeline.gateway_url + path, body)
        assert status < 500, (status, body, payload)
        if status >= 400:
            assert_error(json.loads(payload))
        statuses.append(status)

    fuzz()
    print(f"\nHTTP: {len(statuses)} requests in {time.monotonic() - started:.1f} s:",
          {s: statuses.count(s) for s in sorted(set(statuses))})  # fmt: skip
    assert 200 in statuses and 400 in statuses
    assert_unharmed(pipeline, before_fuzzing, "after fuzzing the HTTP API")

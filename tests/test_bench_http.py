"""The benchmarks' HTTP side: the SSE client (`bench/http_clients.py`), the HTTP rows of `bench peers`
(`bench/http_peers.py`), llama-server's missing/crashed reports (`bench/llama_server.py`) and the gateway
row of `bench pipeline`. Pure parts with fabricated figures; a fake llama-server (a tiny script) for the
crash reports; one slow test against the real gateway."""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.bench import http_clients, http_peers, llama_server
from pipeline.bench import peers_bench as pb
from pipeline.bench import pipeline_bench as plb
from pipeline.bench.together import together


def chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def test_sse_events_reads_data_lines_until_done():
    lines = [
        'data: {"a": 1}',
        "",
        ": a comment",
        "event: x",
        'data:{"b": 2}',
        "data: [DONE]",
        'data: {"c": 3}',
    ]
    assert list(http_clients.sse_events(lines)) == [{"a": 1}, {"b": 2}]


def test_piece_reads_completions_and_chat_chunks():
    assert http_clients.piece(chunk("Hi")) == "Hi"
    assert http_clients.piece({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert http_clients.piece({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert http_clients.piece({"choices": [{"text": None}]}) == ""
    assert http_clients.piece(USAGE) == ""


def test_summarise_stream_times_what_the_client_saw():
    # llama-server puts usage in the last text chunk; speclanes sends it in a chunk of its own
    timed = [(10.1, chunk("")), (10.2, chunk("a")), (10.5, chunk("b c")), (10.6, USAGE)]
    got = http_clients.summarise_stream(timed, start=10.0)
    assert got["text"] == "ab c" and got["count"] == 3 and got["prompt_count"] == 7
    assert got["seconds"] == pytest.approx(0.6) and got["tokens_per_second"] == pytest.approx(5.0)
    assert got["first_token_seconds"] == pytest.approx(0.2)
    assert got["gaps"] == [pytest.approx(0.3)]


def test_summarise_stream_refuses_errors_and_streams_without_usage():
    with pytest.raises(http_clients.StreamError, match="error event"):
        http_clients.summarise_stream([(1.0, {"error": {"message": "overloaded"}})], start=0.0)
    with pytest.raises(http_clients.StreamError, match="include_usage"):
        http_clients.summarise_stream([(1.0, chunk("a"))], start=0.0)


def test_together_starts_every_client_at_once_and_keeps_their_order():
    def client(index: int, ready) -> list[int]:
        ready()
        return [index] * 2

    results, wall = together(3, client)
    assert results == [[0, 0], [1, 1], [2, 2]] and wall >= 0

    def failing(index: int, ready) -> int:
        if index == 1:
            raise ValueError("client 1 failed")  # before `ready`: the others must not wait forever
        ready()
        return index

    with pytest.raises(ValueError, match="client 1 failed"):
        together(3, failing)


def test_bodies_and_the_clients_plan():
    gateway = http_peers.body("gateway", "auto", [1, 2], 16)
    assert gateway["speculation"] == {"drafter": "auto"} and "cache_prompt" not in gateway
    server = http_peers.body("llama-server", "plain", [1, 2], 16)
    assert server["cache_prompt"] is False and "speculation" not in server
    for b in (gateway, server):
        assert b["prompt"] == [1, 2] and b["max_tokens"] == 16 and b["temperature"] == 0 and b["ignore_eos"]
    plan = http_peers.client_workloads(["chat", "quote", "code"], 4)
    assert plan == [["chat", "quote", "code"], ["quote", "code", "chat"], ["code", "chat", "quote"],
                    ["chat", "quote", "code"]]  # fmt: skip


def http_run(text: str, rate: float, count: int = 4) -> dict:
    return {"text": text, "count": count, "tokens_per_second": rate, "first_token_seconds": 0.1}


def test_http_summary_speedups_goal_and_table():
    refs = {"chat": "abcd", "code": "wxyz"}
    single = {
        "chat": {"gateway none": [http_run("abcd", 150.0), http_run("abcd", 170.0)],
                 "llama-server plain": [http_run("abXX", 100.0), http_run("abXX", 100.0)]},
        "code": {"gateway none": [http_run("wxyz", 90.0), http_run("wxyz", 90.0)],
                 "llama-server plain": [http_run("wxyz", 100.0), http_run("wxyz", 100.0)]},
    }  # fmt: skip
    phases = {
        "gateway none": [{"tokens_per_second": 300.0, "outputs": [("chat", http_run("abcd", 0)),
                                                                   ("code", http_run("wxyz", 0))]}],
        "llama-server plain": [{"tokens_per_second": 200.0, "outputs": [("chat", http_run("abXX", 0))]}],
    }  # fmt: skip
    summary = http_peers.summarise(single, phases, refs, max_tokens=4, eos_chars={"chat": 2, "code": None})
    gateway, server = summary["gateway none"], summary["llama-server plain"]
    assert gateway["workloads"]["chat"]["tokens_per_second"] == 160.0 and gateway["clients"]["requests"] == 2
    assert gateway["workloads"]["chat"]["equal"] and gateway["clients"]["equal"]
    assert not server["workloads"]["chat"]["equal"] and server["workloads"]["code"]["equal"]
    assert not server["clients"]["equal"]
    assert http_peers.gateway_equal(summary)
    ratios = {c["workload"]: c["ratio"] for c in http_peers.speedups(summary)}
    assert ratios == {"chat": 1.6, "code": 0.9, "clients": 1.5}
    table = "\n".join(http_peers.render(summary, clients=8))
    assert "| gateway | none | 160.0 | 90.0 | 0.10 / 0.10 | 300.0 | yes |" in table
    # llama-server bans EOS: "to EOS" where its text agrees up to the reference's first end of sequence
    assert server["workloads"]["chat"]["first_difference"] == 2 and server["workloads"]["chat"]["to_eos"]
    assert (
        "| llama-server | plain | 100.0 | 100.0 | 0.10 / 0.10 | 200.0 | chat to EOS (from char 2), code yes |"
        in table
    )
    assert "gateway none / llama-server: chat 1.60x, code 0.90x, clients 1.50x" in table
    assert "single stream: NOT met." in table
    # a short output is not equal even with the same text so far
    short = http_peers.summarise({"chat": {"gateway none": [http_run("abcd", 1.0, count=3)]}}, {}, refs, 4)
    assert not http_peers.gateway_equal(short)


def test_first_difference_and_agreement():
    assert http_peers.first_difference("abc", "abc") is None
    assert http_peers.first_difference("abX", "abc") == 2
    assert http_peers.first_difference("ab", "abc") == 2
    assert http_peers.agreement(["abc", "aXc"], "abc", eos_char=None) == {
        "first_difference": 1,
        "to_eos": False,
    }
    assert http_peers.agreement(["abX"], "abc", eos_char=2) == {"first_difference": 2, "to_eos": True}
    assert http_peers.agreement(["abc"], "abc", eos_char=None) == {"first_difference": None, "to_eos": True}


def test_peers_rows_with_the_gateway_and_llama_server():
    rows = pb.variants(["none"], pipeline=True, peers=["llama_server"], http_drafters=("none", "auto"))
    assert [v.name for v in rows] == [
        "speclanes none", "pipeline none", "gateway none", "gateway auto", "llama-server plain",
    ]  # fmt: skip
    assert [v.http for v in rows] == [False, False, True, True, True]
    no_pipeline = pb.variants(["none"], pipeline=False, peers=[], http_drafters=("none",))
    assert [v.name for v in no_pipeline] == ["speclanes none"]


def fake_server(tmp_path: Path, body: str, monkeypatch) -> Path:
    """A stand-in for llama-server: a Python script with the given body after its imports; its log
    (kept where it dies) goes to `tmp_path`."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\nimport http.server, os, signal, sys\n{body}\n")
    script.chmod(0o755)
    return script


def test_llama_server_missing_is_reported_as_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECLANES_LLAMA_SERVER", str(tmp_path / "nowhere"))
    skipped: dict[str, str] = {}
    assert pb.start_server(["llama_server"], Path("m.gguf"), 2, 8, 512, skipped) is None
    assert "not installed" in skipped["llama-server"] and "install_peers.sh" in skipped["llama-server"]
    assert pb.peer_missing("llama_server") == skipped["llama-server"]


def test_llama_server_that_dies_at_start_is_reported_as_crashed(monkeypatch, tmp_path):
    monkeypatch.setenv(
        "SPECLANES_LLAMA_SERVER", str(fake_server(tmp_path, "print('boom'); sys.exit(3)", monkeypatch))
    )
    skipped: dict[str, str] = {}
    assert pb.start_server(["llama_server"], Path("m.gguf"), 2, 8, 512, skipped) is None
    assert "failed to start: llama-server exited with code 3" in skipped["llama-server"]
    assert "boom" in skipped["llama-server"]
    assert llama_server.exit_reason(-signal.SIGSEGV) == "killed by SIGSEGV"


SEGFAULTS_ON_POST = """
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"status": "ok"}')
    def do_POST(self):
        os.kill(os.getpid(), signal.SIGSEGV)
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_llama_server_that_crashes_mid_run_loses_its_row(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECLANES_LLAMA_SERVER", str(fake_server(tmp_path, SEGFAULTS_ON_POST, monkeypatch)))
    server = pb.start_server(["llama_server"], Path("m.gguf"), 2, 8, 512, {})
    assert server is not None
    runner = pb.Runner(None, {}, server, 8)  # type: ignore[arg-type]
    try:
        row = pb.Variant("llama-server", "plain", "plain")
        assert runner.attempt(row, "chat", [1, 2, 3]) is None
        assert runner.dead["llama-server"].startswith("llama-server killed by SIGSEGV")
        assert runner.attempt(row, "chat", [1, 2, 3]) is None  # not asked again
        assert runner.clients_phase(row, {"chat": [1]}, 2, []) == (None, 0.0)
    finally:
        runner.http.close()
        server.close()


def test_pipeline_bench_gateway_row():
    base = {"prompt_tokens": [1, 2, 3], "tokens": [5, 6], "text": "hi there"}
    runs = [
        {"text": "hi there", "count": 2, "prompt_count": 3, "tokens_per_second": r}
        for r in (80.0, 90.0, 70.0)
    ]
    # In-process runs of the same repeats: the ratio is each repeat's (0.8, 0.5, 0.7), then their median.
    local = [{"tokens_per_second": r} for r in (100.0, 180.0, 100.0)]
    got = plb.gateway_figures(runs, local, base=base)
    assert got == {"gateway_tokens_per_second": 80.0, "gateway_ratio": 0.7, "gateway_identical": True}
    other_prompt = [{**runs[0], "prompt_count": 4}]
    assert not plb.gateway_figures(other_prompt, local[:1], base)["gateway_identical"]
    row = {"tokens": 2, "in_process_tokens_per_second": 100.0, "pipeline_tokens_per_second": 95.0,
           "ratio": 0.95, "pipeline_orchestrator_tokens_per_second": 96.0, "in_process_steps": 1,
           "pipeline_steps": 1, "acceptance_in_process": 0.0, "acceptance_pipeline": 0.0, "identical": True,
           **got}  # fmt: skip
    loop = {"forward": 5.0, "bookkeeping": 0.3, "pause": 0.25}
    single = {"workloads": {"chat": {"none": row}}, "cores": {"clients": 0.5, "others": 0.0}}
    lines = plb.render_stream({**single, "verify_loop_ms": loop})
    assert "gateway  ratio" in lines[1]
    assert lines[-1] == "verify lane, ms a forward by phase: forward 5.00, bookkeeping 0.30, pause 0.25"
    assert "chat     none         2    100.0     95.0  0.95x     80.0  0.70x    96.0" in lines[2]
    assert plb.render_gateway({"gateway_worst_ratio": None}) == []
    h = {"gateway_worst_ratio": 0.8, "gateway_median_ratio": 0.85, "gateway_met": False}
    assert (
        "worst gateway/in-process 0.80x, median 0.85x (target >= 0.90x: NOT met)" in plb.render_gateway(h)[0]
    )


@pytest.mark.slow
def test_gateway_streams_what_in_process_decoding_gives(gateway_pipeline, served_model):
    """The SSE client against the real gateway: one stream and two clients at once, each output equal
    to in-process plain decoding of the same prompt ids."""
    from pipeline.bench.common import chat_prompt
    from pipeline.decoding.drafters.registry import make_draft_source
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.speculative import decode

    prompts = {
        "a": chat_prompt(served_model, "Name a colour."),
        "b": chat_prompt(served_model, "Count to five."),
    }
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = {w: decode(served_model, p, params, make_draft_source("none", served_model), k=0).text
            for w, p in prompts.items()}  # fmt: skip
    url = gateway_pipeline.gateway_url
    with http_clients.new_client() as client:
        got = http_clients.stream(
            client, f"{url}/v1/completions", http_peers.body("gateway", "none", prompts["a"], 12)
        )
    assert got["text"] == want["a"] and got["count"] == 12 and got["prompt_count"] == len(prompts["a"])
    phase = http_peers.drive(url, "gateway", "auto", prompts, clients=2, max_tokens=12)
    assert [w for w, _ in phase["outputs"]] == ["a", "b", "b", "a"]
    assert all(r["text"] == want[w] and r["count"] == 12 for w, r in phase["outputs"])
    assert phase["count"] == 48 and phase["tokens_per_second"] > 0

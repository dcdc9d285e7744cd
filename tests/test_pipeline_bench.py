"""`speclanes bench pipeline`'s inter-token latency (the gaps between a stream's chunks, in ms) and
its verdicts against issue 25's targets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.bench.common import cpu_cgroup, render_header, scheduler_note
from pipeline.bench.pipeline_bench import headline, inter_token_ms, render_auto_vs_none

from .pipeline_harness import alive


def test_inter_token_latency_is_the_median_and_the_99th_percentile_gap():
    gaps = [0.010] * 98 + [0.200, 0.500]  # two stalls among a hundred chunks
    found = inter_token_ms(gaps)
    assert found["p50"] == pytest.approx(10.0)
    assert 200.0 < found["p99"] < 500.0  # between the two stalls: the 99th of 100 gaps
    assert inter_token_ms([]) == inter_token_ms([0.1]) == {"p50": 0.0, "p99": 0.0}


def run_of(ratios: dict, gateway: float, scaling: dict, rates: dict) -> dict:
    """A bench run's results, reduced to what `headline` reads: one workload, a 2.5x ceiling."""
    stream = {name: {"ratio": r, "gateway_ratio": gateway, "identical": True} for name, r in ratios.items()}
    drafters = {
        name: {"over_plain": scaling[name], "1": {"identical": True}, "8": {"tokens_per_second": rates[name],
                                                                           "identical": True}}
        for name in scaling
    }  # fmt: skip
    load = {"clients": 8, "drafters": drafters, "ceiling": {"ceiling_with_prefill": 2.5}}
    return {"single_stream": {"workloads": {"chat": stream}}, "load": load}


def test_the_headline_holds_every_drafter_to_the_targets_and_auto_to_none():
    met = headline(run_of({"none": 0.96, "ngram": 0.95, "auto": 0.97}, 0.91, {"none": 2.3, "auto": 2.25},
                          {"none": 400.0, "auto": 410.0}))  # fmt: skip
    assert met["overhead_met"] and met["gateway_met"] and met["scaling_met"] and met["identical"]
    assert met["auto_vs_none"] == pytest.approx(410 / 400)
    assert met["ceiling_share"]["auto"] == pytest.approx(0.9)
    missed = headline(run_of({"none": 0.96, "auto": 0.80}, 0.89, {"none": 2.3, "auto": 2.2},
                             {"none": 400.0, "auto": 380.0}))  # fmt: skip
    assert not missed["overhead_met"]  # auto counts too
    assert not missed["gateway_met"] and not missed["scaling_met"] and missed["auto_vs_none"] < 1.0


def test_auto_against_none_is_printed_precisely_enough_to_see_why_it_missed():
    assert render_auto_vs_none({"auto_vs_none": 0.998}) == [
        "auto / none at N clients: 0.998x (target >= 1.00x: NOT met)"
    ]


def test_the_scheduler_note_names_autogroups_and_the_cpu_cgroup(tmp_path):
    """Autogroups apply only in the root cpu cgroup: the note gives both facts, from cgroup v1's `cpu`
    line or else v2's unified one, and says what it could not read."""
    v1 = ["12:pids:/user.slice", "4:cpu,cpuacct:/system.slice/x.service", "0::/system.slice/x.service"]
    assert cpu_cgroup(v1) == "/system.slice/x.service"
    assert cpu_cgroup(["1:cpu:/", "0::/elsewhere"]) == "/"
    assert cpu_cgroup(["0::/user.slice/session-3.scope"]) == "/user.slice/session-3.scope"
    assert cpu_cgroup(["garbage", ""]) == "unknown"
    (tmp_path / "autogroup").write_text("1\n")
    (tmp_path / "cgroup").write_text("0::/\n")
    assert scheduler_note(tmp_path / "autogroup", tmp_path / "cgroup") == "autogroup=1 cpu_cgroup=/"
    assert scheduler_note(tmp_path / "none", tmp_path / "none") == "autogroup=absent cpu_cgroup=unknown"
    assert render_header({"load": "0.10/0.20/0.30", "scheduler": "autogroup=0 cpu_cgroup=/"}) == (
        "load=0.10/0.20/0.30 scheduler=autogroup=0 cpu_cgroup=/"
    )


BENCH_KILLED = """
import sys, time
from pipeline.bench.common import running_pipeline
from pipeline.service.run_dir import running_supervisor
from pathlib import Path
with running_pipeline([]) as config:
    print(running_supervisor(Path(config.run.dir)), config.run.dir, flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
def test_a_benchmark_sent_sigterm_stops_the_pipeline_it_started():
    """`timeout` ends a benchmark with SIGTERM; its pipeline used to go on running, decoding beside
    whatever was measured next. Its run directory goes too: a stopped benchmark is not a failed
    pipeline whose logs are worth keeping (each test run left one in /tmp)."""
    bench = subprocess.Popen([sys.executable, "-c", BENCH_KILLED], stdout=subprocess.PIPE, text=True)
    supervisor = 0
    try:
        pid, run_dir = bench.stdout.readline().split()
        supervisor = int(pid)
        assert supervisor > 0 and alive(supervisor) and Path(run_dir).is_dir()
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 143
        deadline = time.monotonic() + 30
        while alive(supervisor) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(supervisor)
        assert not Path(run_dir).exists()
    finally:
        bench.kill()
        if supervisor > 0 and alive(supervisor):  # not left running when the test fails
            os.kill(supervisor, signal.SIGINT)

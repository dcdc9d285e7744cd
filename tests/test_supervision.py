"""Supervision's pure parts, without processes: the restart intensity, the lane table's failed
state, the health verdict behind /health and `status`, and the reason read from a lane's log.
The processes themselves are in test_pipeline.py (crash loops, SIGSTOP)."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from pipeline.api.health import Health, judge, unreachable
from pipeline.observability.process_stats import ProcessStats
from pipeline.orchestration.lane_table import LaneTable
from pipeline.protocol.client import _settled
from pipeline.protocol.messages import (
    Codec,
    ControlInbox,
    Heartbeat,
    LaneDown,
    LaneFailed,
    LaneStatus,
    LaneUp,
    SpeculativeState,
    encode,
)
from pipeline.service.intensity import RestartIntensity
from pipeline.service.launch import last_error

# --- the restart intensity ------------------------------------------------------------------


def test_the_intensity_allows_max_restarts_within_the_window_and_refuses_the_next():
    intensity = RestartIntensity(3, 60.0)
    assert [intensity.allow(t) for t in (0.0, 1.0, 2.0)] == [True, True, True]
    assert not intensity.allow(3.0)
    assert not intensity.allow(59.9)  # the first restart is still inside the window


def test_restarts_older_than_the_window_no_longer_count():
    intensity = RestartIntensity(2, 10.0)
    assert intensity.allow(0.0) and intensity.allow(5.0)
    assert not intensity.allow(9.0)
    assert intensity.allow(10.0)  # 0.0 has left the window: 5.0 and 10.0 count
    assert not intensity.allow(14.9)
    assert intensity.allow(15.0) and intensity.allow(30.0)  # 5.0 left, then 10.0 and 15.0 did


def test_a_refused_restart_is_not_counted():
    intensity = RestartIntensity(1, 10.0)
    assert intensity.allow(0.0)
    assert not intensity.allow(1.0) and not intensity.allow(2.0)
    assert intensity.allow(10.5)  # only the granted restart at 0.0 was in the window


def test_an_intensity_of_zero_never_restarts():
    assert not RestartIntensity(0, 60.0).allow(0.0)


# --- the lane table --------------------------------------------------------------------------


def _failed(lane: str = "audit", pid: int = 31) -> LaneFailed:
    return LaneFailed(lane=lane, pid=pid, returncode=1, restarts=3, reason="OperationalError: unable to open")


def test_a_failed_lane_is_shown_failed_with_its_reason():
    table = LaneTable()
    table.update(LaneUp(lane="audit", pid=31, restarts=3), 0.0)
    assert table.update(_failed(), 1.0) == "failed"
    status = next(s for s in table.statuses() if s.name == "audit")
    assert (status.state, status.pid, status.restarts, status.reason) == (
        "failed", 31, 3, "OperationalError: unable to open"
    )  # fmt: skip
    assert not table.is_up("audit")


def test_a_repeated_failure_and_late_news_of_the_failed_process_change_nothing():
    table = LaneTable()
    table.update(_failed(), 1.0)
    assert table.update(_failed(), 2.0) == "ignored"
    assert table.update(Heartbeat(lane="audit", pid=31, state=SpeculativeState()), 2.0) == "ignored"
    assert table.update(LaneDown(lane="audit", pid=31, returncode=1, restarts=3), 2.0) == "ignored"
    assert table["audit"].state == "failed" and table["audit"].reason


def test_a_new_process_of_a_failed_lane_clears_the_failure():
    """Only another supervisor starts one (the lane on another host, its supervisor restarted)."""
    table = LaneTable()
    table.update(_failed("verify", 10), 1.0)
    assert table.update(Heartbeat(lane="verify", pid=11, state=SpeculativeState()), 2.0) == "came_up"
    assert (table["verify"].state, table["verify"].reason) == ("up", "")


def test_a_failed_lane_is_never_counted_as_stalled():
    table = LaneTable()
    table.update(Heartbeat(lane="draft", pid=20, state=SpeculativeState()), 0.0)
    table.update(_failed("draft", 20), 1.0)
    assert table.stalled(100.0, 5.0) == [] and table["draft"].state == "failed"


def test_a_failed_gateway_is_listed_even_when_the_table_did_not_know_it():
    table = LaneTable()
    assert table.update(_failed("gateway", 50), 1.0) == "failed"
    assert table["gateway"].state == "failed"


def test_a_heartbeat_carries_its_process_figures_and_the_table_keeps_them_while_it_lives():
    """Decoded as sent, an older sender's heartbeat (no `process`) too; kept per lane until the
    process is reported gone or another takes its place."""
    stats = ProcessStats.measure()
    assert stats.cpu_seconds > 0 and stats.resident_bytes > 0 and 0 < stats.start_time <= time.time()
    codec = Codec(ControlInbox)
    beat = codec.decode(encode(Heartbeat(lane="verify", pid=11, state=SpeculativeState(), process=stats)))
    assert isinstance(beat, Heartbeat) and beat.process == stats
    old = {"type": "Heartbeat", "version": 1, "lane": "verify", "pid": 11, "state": {}}
    old = msgspec.msgpack.encode(old)
    assert codec.decode(old) == Heartbeat(lane="verify", pid=11, state=SpeculativeState())
    table = LaneTable()
    table.update(beat, 1.0)
    assert table["verify"].status().process == stats
    table.update(LaneDown(lane="verify", pid=11, returncode=-9, restarts=1), 2.0)
    assert table["verify"].status().process is None  # its figures went with it
    table.update(beat, 2.5)  # a late heartbeat of the dead process
    assert table["verify"].process is None
    table.update(Heartbeat(lane="verify", pid=12, state=SpeculativeState(), process=stats), 3.0)
    table.update(LaneUp(lane="verify", pid=13, restarts=2), 4.0)  # yet another process
    assert table["verify"].process is None


# --- the health verdict ----------------------------------------------------------------------


def _lane(name: str, state: str = "up", reason: str = "") -> LaneStatus:
    return LaneStatus(
        name=name, state=state, pid=1, restarts=0, active_requests=0, totals=SpeculativeState(), reason=reason
    )


ALL_UP = [_lane(name) for name in ("verify", "draft", "audit", "orchestrator", "gateway")]


def test_all_up_is_healthy():
    health = judge(ALL_UP)
    assert health == Health() and health.reason() is None and health.body() == {"status": "ok"}


@pytest.mark.parametrize("lane", ["draft", "audit", "gateway"])
def test_a_failed_lane_that_degrades_still_serves_but_is_unhealthy(lane):
    lanes = [_lane(x.name, "failed", "disk full") if x.name == lane else x for x in ALL_UP]
    health = judge(lanes)
    assert health.not_serving is None  # requests are still served
    assert health.reason() == f"the {lane} lane failed: disk full"
    assert health.body() == {
        "status": "unavailable",
        "reason": health.reason(),
        "failed": {lane: "disk full"},
    }


@pytest.mark.parametrize("lane", ["verify", "orchestrator"])
@pytest.mark.parametrize("state", ["starting", "stalled", "down", "failed"])
def test_an_essential_lane_not_up_stops_serving(lane, state):
    lanes = [
        _lane(x.name, state, "boom" if state == "failed" else "") if x.name == lane else x for x in ALL_UP
    ]
    health = judge(lanes)
    assert health.not_serving == f"the pipeline is not ready (not up: {lane})"
    reason = health.reason()
    assert reason is not None and reason.startswith(health.not_serving)
    assert ("boom" in reason) == (state == "failed")


def test_a_stalled_or_restarting_lane_that_degrades_is_healthy():
    lanes = [_lane(x.name, "down") if x.name == "draft" else x for x in ALL_UP]
    assert judge(lanes).reason() is None


def test_an_orchestrator_that_does_not_answer_is_unhealthy():
    health = unreachable("timed out")
    assert health.not_serving == "the pipeline's orchestrator does not answer (timed out)"
    assert health.body()["status"] == "unavailable"


def test_waiting_for_a_pipeline_settles_on_a_degrading_failure_only():
    assert _settled(_lane("audit")) and _settled(_lane("audit", "failed"))
    assert not _settled(_lane("audit", "down")) and not _settled(_lane("verify", "failed"))


# --- the reason: the process's own last error line -------------------------------------------


def test_the_reason_is_the_last_error_line_of_the_process_own_output(tmp_path: Path):
    log = tmp_path / "audit.log"
    log.write_text("old ERROR from the previous process\n")
    since = log.stat().st_size
    with log.open("a") as out:
        out.write("Traceback (most recent call last):\n  ...\nsqlite3.OperationalError: unable to open\n\n")
    assert last_error(log, since) == "sqlite3.OperationalError: unable to open"
    since = log.stat().st_size
    with log.open("a") as out:
        out.write("audit[7] INFO started\nSegmentation fault\n")  # no error line of its own: its last line
    assert last_error(log, since) == "Segmentation fault"
    assert last_error(log) == "sqlite3.OperationalError: unable to open"  # the whole log: an older process's
    assert last_error(log, log.stat().st_size) == "(empty log)"
    assert last_error(tmp_path / "absent.log") == "(no log)"

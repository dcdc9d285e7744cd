"""`run.helper_nice`: the orchestrator's and the audit lane's session groups at a higher nice than the
verify lane's, retried while the kernel refuses a change, harmless where there are no autogroups."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from pipeline.protocol.config import HELPERS, Config
from pipeline.service.autogroup import RETRY_SECONDS, TRIES, set_autogroup_nice

from .pipeline_harness import running_pipeline


class Refusing:
    """A /proc/self/autogroup that answers EAGAIN `times` times (another process changed one less than
    100 ms ago), then takes the value."""

    def __init__(self, times: int) -> None:
        self.times, self.written = times, ""

    def write_text(self, text: str) -> None:
        if self.times:
            self.times -= 1
            raise BlockingIOError(11, "Resource temporarily unavailable")
        self.written = text


def own() -> bool:
    return True


def test_the_nice_goes_to_the_session_group(tmp_path):
    path = tmp_path / "autogroup"
    assert set_autogroup_nice(10, path, own=own)
    assert path.read_text() == "10"


def test_a_session_shared_with_a_terminal_keeps_its_group(tmp_path):
    """A lane started by hand shares its shell's session: the shell's group is not the lane's to change."""
    path = tmp_path / "autogroup"
    assert not set_autogroup_nice(10, path, own=lambda: False)
    assert not path.exists()


def test_a_refused_change_is_tried_again_after_the_kernel_s_100_ms():
    slept: list[float] = []
    path = Refusing(times=2)
    assert set_autogroup_nice(7, path, slept.append, own)  # type: ignore[arg-type]
    assert path.written == "7" and slept == [RETRY_SECONDS] * 2
    never = Refusing(times=TRIES)
    assert not set_autogroup_nice(7, never, slept.append, own)  # type: ignore[arg-type]
    assert never.written == ""


def test_a_kernel_without_autogroups_is_not_an_error(tmp_path):
    assert not set_autogroup_nice(10, tmp_path / "absent" / "autogroup", own=own)


def test_the_setting_is_a_nice_value():
    assert msgspec.convert({"run": {"helper_nice": 19}}, Config).run.helper_nice == 19
    for bad in (-1, 20):
        with pytest.raises(msgspec.ValidationError, match="helper_nice"):
            msgspec.convert({"run": {"helper_nice": bad}}, Config)


def autogroup_nice(pid: int) -> int:
    """`/proc/<pid>/autogroup` reads "/autogroup-<id> nice <n>"."""
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel has no autogroups")
def test_the_helpers_sessions_run_at_the_setting_and_the_verify_lane_s_at_0(tmp_path):
    with running_pipeline(tmp_path / "run", ["run.helper_nice=10", "gateway.enabled=false"]) as pipeline:
        pids = {lane.name: lane.pid for lane in pipeline.status().lanes if lane.pid}
        assert set(HELPERS) <= set(pids)
        assert {name: autogroup_nice(pid) for name, pid in pids.items()} == {
            name: 10 if name in HELPERS else 0 for name in pids
        }

"""The audit trail: `audit verify` proves a request followed the rule, and catches tampering.

Unit tests record requests in-process on tiny models exactly as the orchestrator records
them (same events, same fields), then verify and tamper. One slow test does the same
through a real pipeline with the default model and the `speclanes audit` command.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from pipeline import cli
from pipeline.audit.store import AuditStore, decode_event
from pipeline.audit.verify import (
    DRAW_EPS,
    Q_ABS,
    Report,
    draw_problem,
    rule_problem,
    uses_draft_rows,
    verify_request,
)
from pipeline.decoding.acceptance import Decision
from pipeline.decoding.drafters import NoDraftSource
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.drafters.suffix import SuffixSource
from pipeline.decoding.noise import SAMPLE, uniform
from pipeline.decoding.sampling import SamplingParams, request_seed, sample_at
from pipeline.decoding.speculative import decode
from pipeline.model import Model
from pipeline.protocol.messages import (
    AuditEvent,
    LaneSnapshot,
    RequestOpened,
    SpeculativeEvent,
    SpeculativeState,
    StepEvent,
    encode,
)

from .tinymodel import TinySpec, write_tiny_gguf

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=5, max_tokens=32, ignore_eos=True)
FILTERED = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=9, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Target and draft share a vocabulary but disagree on probabilities (as in test_speculative)."""
    root = tmp_path_factory.mktemp("audit")
    write_tiny_gguf(root / "target.gguf", TinySpec(seed=21, scale=1.2))
    write_tiny_gguf(root / "draft.gguf", TinySpec(seed=21, scale=0.8))
    return Model.load(root / "target.gguf"), Model.load(root / "draft.gguf"), root


def source(name: str, target: Model, draft: Model):
    return {
        "none": NoDraftSource(),
        "ngram": NgramSource(),
        "suffix": SuffixSource(),
        "model": ModelSource(draft, target),
        "self-model": ModelSource(target, target),
        "auto": make_draft_source("auto", target, draft),
    }[name]


PROMPT = [40, 41, 42, 43] * 4  # the tiny target soon repeats itself after it: n-grams find drafts


def audited_run(
    target: Model, params: SamplingParams, src, *, k: int | None = 3, request_id: str = "req", prompt=PROMPT
) -> list[AuditEvent]:
    """The in-process loop (`speculative.decode`) with the events the orchestrator records."""
    seed = request_seed(params.seed)
    params = msgspec.structs.replace(params, seed=seed)
    now = time.time()
    settings = {
        "params": msgspec.to_builtins(params), "drafter": src.name, "k": k, "seed": seed,
        "model": "", "draft_model": "",
    }  # fmt: skip
    events: list[AuditEvent] = [
        RequestOpened(event_id=f"{request_id}:opened", request_id=request_id, time=now,
                      settings=settings, prompt_tokens=prompt)
    ]  # fmt: skip

    def record(want: int, draft, verdict, draws: int) -> None:
        step = len(events) - 1
        events.append(StepEvent(
            event_id=f"{request_id}:step:{step}", request_id=request_id, time=now + step, step=step,
            drafter=draft.drafter, k=want, drafted=draft.tokens, emitted=verdict.tokens,
            decisions=verdict.decisions, final_u=verdict.final_u, draws=draws, batch_size=1,
            parents=draft.parents,
        ))  # fmt: skip

    done = decode(target, prompt, params, src, k=k, on_step=record)
    stats = done.stats
    events.append(
        SpeculativeEvent(
            event_id=f"{request_id}:summary", request_id=request_id, time=now + len(events),
            drafted=stats.drafted, accepted=stats.accepted, acceptance_rate=stats.acceptance_rate,
            iterations=stats.steps, content_length=len(done.text), finish_reason=done.finish_reason,
            stats=msgspec.to_builtins(stats), tokens=done.tokens,
        )
    )  # fmt: skip
    return events


def steps_of(events: list[AuditEvent]) -> list[StepEvent]:
    return [e for e in events if isinstance(e, StepEvent)]


def replace_step(events: list[AuditEvent], step: int, **changes) -> list[AuditEvent]:
    return [
        msgspec.structs.replace(e, **changes) if isinstance(e, StepEvent) and e.step == step else e
        for e in events
    ]


def replace_decision(
    events: list[AuditEvent], step: int, position: int, change: Callable[[Decision], Decision]
) -> list[AuditEvent]:
    event = next(e for e in steps_of(events) if e.step == step)
    decisions = [change(d) if d.position == position else d for d in event.decisions]
    return replace_step(events, step, decisions=decisions)


def assert_fails_at(report: Report, step: int, words: str) -> None:
    assert report.verdict == "fail", report
    assert report.failed_steps and report.failed_steps[0] == step, report.failed_steps
    first = next(s for s in report.steps if s.step == step)
    assert any(words in p for p in first.problems), first.problems


# --- pure checks -------------------------------------------------------------------------


def test_rule_on_recorded_numbers():
    assert rule_problem(Decision(0, 7, 1.0, 1.0, None, True, None)) is None
    assert rule_problem(Decision(0, 7, 0.5, 0.25, 0.4, True, None)) is None  # 0.4 * 0.5 < 0.25
    assert rule_problem(Decision(0, 7, 0.5, 0.25, 0.6, False, 3)) is None
    assert "opposite" in (rule_problem(Decision(0, 7, 0.5, 0.25, 0.6, True, None)) or "")
    assert "needs a uniform" in (rule_problem(Decision(0, 7, 0.5, 0.25, None, True, None)) or "")
    assert "certain" in (rule_problem(Decision(0, 7, 0.5, 0.75, 0.1, True, None)) or "")
    assert "must reject" in (rule_problem(Decision(0, 7, 1.0, 0.0, None, True, None)) or "")
    assert "must keep" in (rule_problem(Decision(0, 7, 0.5, 0.5, None, False, 1)) or "")


def test_draw_check_matches_sampling_and_tolerates_only_round_off_at_edges():
    dist = np.array([0.0, 0.2, 0.3, 0.0, 0.5])
    for position in range(200):
        token, u = sample_at(dist, 0, position)
        assert draw_problem(dist, u, token) is None
        assert u is not None and draw_problem(dist, u, (token % 4) + 1 if token != 1 else 2) is not None
    assert draw_problem(dist, 0.2 - DRAW_EPS / 2, 2) is None  # a hair below the 1|2 edge: either side
    assert draw_problem(dist, 0.19, 2) is not None
    assert "probability 0" in (draw_problem(dist, 0.5, 3) or "")
    assert draw_problem(np.array([0.0, 1.0]), None, 1) is None
    assert "without a draw" in (draw_problem(dist, None, 4) or "")


def test_keyed_numbers_name_each_recorded_u_by_position_and_purpose():
    from pipeline.audit.verify import keyed_numbers
    from pipeline.decoding.noise import ACCEPT, RESIDUAL

    step = StepEvent(
        event_id="e", request_id="r", time=0.0, step=3, drafter="ngram", k=3, drafted=[5, 6, 7],
        emitted=[5, 9], final_u=0.8, draws=2, batch_size=1,
        decisions=[Decision(0, 5, 1.0, 0.4, 0.1, True, None), Decision(1, 6, 1.0, 0.3, 0.8, False, 9)],
    )  # fmt: skip
    assert keyed_numbers(step, 40, False) == [(0.1, 40, SAMPLE), (0.8, 41, SAMPLE), (0.8, 41, SAMPLE)]
    assert keyed_numbers(step, 40, True) == [(0.1, 40, ACCEPT), (0.8, 41, ACCEPT), (0.8, 41, RESIDUAL)]
    assert uniform(123, 40, SAMPLE) != uniform(123, 41, SAMPLE)


# --- verify passes on honest records --------------------------------------------------------


@pytest.mark.parametrize("drafter", ["none", "ngram", "suffix", "model", "self-model", "auto"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED, FILTERED], ids=["greedy", "sampled", "filtered"])
def test_verify_passes_on_honest_records(models, drafter, params):
    target, draft, _ = models
    events = audited_run(target, params, source(drafter, target, draft))
    ref = decode(target, PROMPT, params, source(drafter, target, draft), k=3)
    summary = events[-1]
    assert isinstance(summary, SpeculativeEvent) and summary.tokens == ref.tokens  # the helper is `decode`
    draft_model = target if drafter == "self-model" else draft
    report = verify_request("req", events, target, draft_model)
    assert report.verdict == "pass", [(s.step, s.problems) for s in report.steps if s.problems] + [
        report.problems,
        report.unchecked,
    ]
    assert [s.step for s in report.steps] == list(range(len(steps_of(events))))
    if drafter != "none":
        assert sum(s.drafted for s in report.steps) > 0
    if not params.greedy:
        # The numpy reference's round-off between a batched forward and a prefill (up to 3e-5 on these
        # paths) stays well under the tolerance, Q_ABS = 1e-4.
        assert report.max_q_error < Q_ABS / 2


def test_sampled_model_drafter_exercises_draws_and_residuals(models):
    """The honest records above must include what the proof is about: draws, rejections with
    a residual from the draft's row, and bonus tokens."""
    target, draft, _ = models
    events = audited_run(target, SAMPLED, source("model", target, draft), k=4)
    steps = steps_of(events)
    decisions = [d for s in steps for d in s.decisions]
    assert any(d.u is not None for d in decisions)
    assert any(not d.kept for d in decisions)
    assert any(d.kept for d in decisions)
    assert any(uses_draft_rows(s, SAMPLED) for s in steps)
    assert verify_request("req", events, target, draft).verdict == "pass"


def test_without_the_draft_model_sampled_model_steps_are_unchecked_not_passed(models):
    target, draft, _ = models
    events = audited_run(target, SAMPLED, source("model", target, draft), k=4)
    report = verify_request("req", events, target, None)
    assert report.verdict == "incomplete"
    assert any("draft model is not available" in u for u in report.unchecked)


# --- verify fails, naming the step, on every kind of tampering ------------------------------


@pytest.fixture(scope="module")
def sampled_record(models):
    target, draft, _ = models
    return audited_run(target, SAMPLED, source("model", target, draft), k=4)


@pytest.fixture(scope="module")
def greedy_record(models):
    target, draft, _ = models
    return audited_run(target, GREEDY, source("ngram", target, draft), k=4)


def first_step(events: list[AuditEvent], where: Callable[[StepEvent], bool]) -> StepEvent:
    return next(s for s in steps_of(events) if s.step > 0 and where(s))


def with_draw(s: StepEvent) -> bool:
    return any(d.u is not None for d in s.decisions)


def rejected(s: StepEvent) -> bool:
    return bool(s.decisions) and not s.decisions[-1].kept


def test_tampered_q_is_caught(models, sampled_record):
    target, draft, _ = models
    step = first_step(sampled_record, with_draw)
    pos = next(d.position for d in step.decisions if d.u is not None)
    events = replace_decision(
        sampled_record, step.step, pos, lambda d: msgspec.structs.replace(d, q=d.q * 0.7)
    )
    assert_fails_at(verify_request("req", events, target, draft), step.step, "recorded q(x)")


def test_tampered_p_is_caught(models, sampled_record):
    target, draft, _ = models
    step = first_step(sampled_record, with_draw)
    pos = next(d.position for d in step.decisions if d.u is not None)
    events = replace_decision(
        sampled_record, step.step, pos, lambda d: msgspec.structs.replace(d, p=d.p * 1.3)
    )
    assert_fails_at(verify_request("req", events, target, draft), step.step, "recorded p(x)")


def test_flipped_kept_is_caught(models, sampled_record):
    target, draft, _ = models
    step = first_step(sampled_record, lambda s: with_draw(s) and s.decisions[-1].kept)
    d = step.decisions[-1]
    events = replace_decision(
        sampled_record, step.step, d.position, lambda d: msgspec.structs.replace(d, kept=False)
    )
    assert_fails_at(verify_request("req", events, target, draft), step.step, "")


def test_flipped_kept_with_a_consistent_emission_is_caught_by_the_rule(models, sampled_record):
    """A forger who also fixes up emitted and replacement still breaks the rule on (u, p, q)."""
    target, draft, _ = models
    step = first_step(
        sampled_record, lambda s: bool(s.decisions) and s.decisions[-1].kept and s.decisions[-1].u is not None
    )
    last = step.decisions[-1]
    decisions = [
        *step.decisions[:-1],
        msgspec.structs.replace(last, kept=False, replacement=step.emitted[-1]),
    ]
    emitted = [*step.emitted[: last.position], step.emitted[-1]]
    events = replace_step(sampled_record, step.step, decisions=decisions, emitted=emitted)
    assert_fails_at(verify_request("req", events, target, draft), step.step, "the rule says kept")


def test_changed_u_is_caught(models, sampled_record):
    target, draft, _ = models
    step = first_step(sampled_record, with_draw)
    pos = next(d.position for d in step.decisions if d.u is not None)
    events = replace_decision(
        sampled_record, step.step, pos, lambda d: msgspec.structs.replace(d, u=(d.u or 0.0) * 0.999)
    )
    assert_fails_at(verify_request("req", events, target, draft), step.step, "the number the seed gives")


def test_changed_final_u_is_caught(models, sampled_record):
    target, draft, _ = models
    step = first_step(sampled_record, lambda s: s.final_u is not None)
    assert step.final_u is not None
    events = replace_step(sampled_record, step.step, final_u=(step.final_u + 0.5) % 1.0)
    assert_fails_at(verify_request("req", events, target, draft), step.step, "")


def test_changed_replacement_is_caught(models, sampled_record):
    target, draft, _ = models
    step = first_step(sampled_record, rejected)
    last = step.decisions[-1]
    other = (last.replacement or 0) + 1
    decisions = [*step.decisions[:-1], msgspec.structs.replace(last, replacement=other)]
    events = replace_step(sampled_record, step.step, decisions=decisions, emitted=[*step.emitted[:-1], other])
    assert_fails_at(verify_request("req", events, target, draft), step.step, "replacement token")


def test_changed_greedy_bonus_is_caught(models, greedy_record):
    target, draft, _ = models
    step = first_step(greedy_record, lambda s: not s.decisions or s.decisions[-1].kept)  # a bonus token
    emitted = [*step.emitted[:-1], step.emitted[-1] + 1]
    events = replace_step(greedy_record, step.step, emitted=emitted)
    assert_fails_at(verify_request("req", events, target, draft), step.step, "argmax")


def test_changed_greedy_q_is_caught(models, greedy_record):
    target, draft, _ = models
    step = first_step(greedy_record, lambda s: bool(s.decisions))
    events = replace_decision(greedy_record, step.step, 0, lambda d: msgspec.structs.replace(d, q=1.0 - d.q))
    assert_fails_at(verify_request("req", events, target, draft), step.step, "q(x)")


@pytest.mark.parametrize("which", ["middle", "prefill"])
def test_dropped_step_is_caught(models, sampled_record, which):
    target, draft, _ = models
    gone = 0 if which == "prefill" else len(steps_of(sampled_record)) // 2
    events = [e for e in sampled_record if not (isinstance(e, StepEvent) and e.step == gone)]
    report = verify_request("req", events, target, draft)
    assert report.verdict == "fail" and report.failed_steps == [gone]
    assert any(f"step {gone} is missing" in p for s in report.steps for p in s.problems)


def test_dropped_last_step_is_caught_by_the_summary(models, sampled_record):
    target, draft, _ = models
    last = steps_of(sampled_record)[-1].step
    events = [e for e in sampled_record if not (isinstance(e, StepEvent) and e.step == last)]
    report = verify_request("req", events, target, draft)
    assert report.verdict == "fail"
    assert any(f"step {last} missing" in p for p in report.problems), report.problems


def test_tampered_served_tokens_and_seed_are_caught(models, sampled_record):
    target, draft, _ = models
    summary = sampled_record[-1]
    assert isinstance(summary, SpeculativeEvent)
    forged = [*sampled_record[:-1], msgspec.structs.replace(summary, tokens=[*summary.tokens[:-1], 5])]
    report = verify_request("req", forged, target, draft)
    assert report.verdict == "fail" and any("served" in p for p in report.problems)
    opened = sampled_record[0]
    assert isinstance(opened, RequestOpened)
    reseeded = msgspec.structs.replace(opened, settings={**opened.settings, "seed": 6})
    report = verify_request("req", [reseeded, *sampled_record[1:]], target, draft)
    problems = [p for s in report.steps for p in s.problems]
    assert report.verdict == "fail" and any("the number the seed gives" in p for p in problems)


def test_a_different_target_model_fails_verification(models, sampled_record):
    _, draft, _ = models
    report = verify_request("req", sampled_record, draft, draft)  # the draft is not the target
    assert report.verdict == "fail"


# --- the store: WAL reader next to the writer, retention ----------------------------------


def snapshot(t: float) -> LaneSnapshot:
    return LaneSnapshot(
        event_id=f"lane:verify:{t}", request_id="", time=t, lane="verify", pid=1, restarts=0,
        lane_state="up", totals=SpeculativeState(runs=3),
    )  # fmt: skip


def fake_request(request_id: str, t: float) -> list[AuditEvent]:
    opened = RequestOpened(
        event_id=f"{request_id}:opened", request_id=request_id, time=t, settings={}, prompt_tokens=[1]
    )
    step = StepEvent(
        event_id=f"{request_id}:step:0", request_id=request_id, time=t + 5, step=0, drafter="", k=0,
        drafted=[], emitted=[2], decisions=[], final_u=None, draws=0, batch_size=1,
    )  # fmt: skip
    return [opened, step]


def test_a_reader_sees_what_the_writer_committed_and_cannot_write(tmp_path):
    path = tmp_path / "audit.sqlite"
    writer = AuditStore(path)
    writer.add(fake_request("a", 100.0))
    reader = AuditStore(path, readonly=True)
    assert reader.request_ids() == ["a"]
    writer.add(fake_request("b", 200.0))  # while the reader's connection is open
    assert reader.request_ids() == ["a", "b"] and reader.resolve("b") == "b"
    with pytest.raises(sqlite3.OperationalError):
        reader.db.execute("DELETE FROM events")
    with pytest.raises(LookupError):
        reader.resolve("zz")
    with pytest.raises(FileNotFoundError):
        AuditStore(tmp_path / "missing.sqlite", readonly=True)
    reader.close()
    writer.close()


def test_retention_deletes_whole_requests_by_age_and_by_count(tmp_path):
    store = AuditStore(tmp_path / "audit.sqlite")
    for i, t in enumerate([1000.0, 2000.0, 3000.0, 4000.0]):
        store.add(fake_request(f"r{i}", t))
    store.add([snapshot(1000.0), snapshot(3900.0)])
    assert store.prune(max_age_seconds=0, max_requests=0, now=5000.0) == 0  # both limits off
    # r0's last event is at 1005: older than 5000 - 2500; r1's opened is old but its step is not.
    assert store.prune(max_age_seconds=3000.0, max_requests=0, now=5000.0) == 1
    assert store.request_ids() == ["r1", "r2", "r3"]
    assert [e.time for e in store.of_types(["LaneSnapshot"])] == [3900.0]
    assert store.prune(max_age_seconds=0, max_requests=2, now=5000.0) == 1
    assert store.request_ids() == ["r2", "r3"]
    assert all(len(store.events(r)) == 2 for r in ("r2", "r3"))  # nothing half-deleted
    assert store.counts() == {"requests": 2, "RequestOpened": 2, "StepEvent": 2, "LaneSnapshot": 1}
    store.close()


# --- the command line on a tiny model ------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["audit", *argv])
    return code, capsys.readouterr().out


def test_cli_list_show_stats_verify_and_a_tampered_record(models, sampled_record, tmp_path, capsys):
    _, _, root = models
    opened = sampled_record[0]
    assert isinstance(opened, RequestOpened)
    settings = {
        **opened.settings,
        "model": str(root / "target.gguf"),
        "draft_model": str(root / "draft.gguf"),
    }
    events = [msgspec.structs.replace(opened, settings=settings), *sampled_record[1:]]
    db = tmp_path / "audit.sqlite"
    store = AuditStore(db)
    store.add([*events, snapshot(time.time())])

    code, out = run_cli(capsys, "list", "--db", str(db), "--json")
    rows = msgspec.json.decode(out)
    assert code == 0 and [r["request_id"] for r in rows] == ["req"]
    assert rows[0]["steps"] == len(steps_of(events)) - 1 and rows[0]["drafter"] == "model"
    code, out = run_cli(capsys, "list", "--db", str(db))
    assert code == 0 and "req" in out and "model" in out
    code, out = run_cli(capsys, "show", "re", "--db", str(db), "--json")
    shown = msgspec.json.decode(out)
    assert code == 0 and len(shown["steps"]) == len(steps_of(events)) and shown["summary"]["tokens"]
    decided = [d for step in shown["steps"] for d in step["decisions"]]
    assert decided and {"draft_token", "p", "q", "u", "kept", "replacement"} <= set(decided[0])
    code, out = run_cli(capsys, "show", "req", "--db", str(db))
    assert code == 0 and "pos 0: draft" in out
    code, out = run_cli(capsys, "stats", "--db", str(db), "--json")
    stats = msgspec.json.decode(out)
    assert code == 0 and stats["events"]["requests"] == 1 and stats["lanes"]["verify"]["totals"]["runs"] == 3
    code, out = run_cli(capsys, "stats", "--db", str(db))
    assert code == 0 and "verify" in out

    code, out = run_cli(capsys, "verify", "req", "--db", str(db))
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("verdict: pass")
    code, out = run_cli(capsys, "verify", "req", "--db", str(db), "--json")
    assert code == 0 and msgspec.json.decode(out)["verdict"] == "pass"

    step = first_step(events, with_draw)
    tamper_stored_step(db, "req", step.step)
    code, out = run_cli(capsys, "verify", "req", "--db", str(db))
    assert code == 1, out
    assert f"step {step.step:>4}" in out and "FAIL" in out
    assert f"verdict: fail at step {step.step}" in out
    code, out = run_cli(capsys, "verify", "nope", "--db", str(db))
    assert code == 2
    store.close()


def tamper_stored_step(db_path, request_id: str, step: int) -> None:
    """Halve q(x) of the first drawn decision of a stored step (or flip a greedy decision)."""
    db = sqlite3.connect(db_path)
    try:
        (body,) = db.execute(
            "SELECT body FROM events WHERE request_id = ? AND step = ?", (request_id, step)
        ).fetchone()
        event = decode_event(body)
        assert isinstance(event, StepEvent) and event.decisions
        d = next((d for d in event.decisions if d.u is not None), event.decisions[0])
        forged = msgspec.structs.replace(d, q=d.q * 0.5 if d.u is not None else 1.0 - d.q)
        decisions = [forged if x.position == d.position else x for x in event.decisions]
        db.execute(
            "UPDATE events SET body = ? WHERE request_id = ? AND step = ?",
            (encode(msgspec.structs.replace(event, decisions=decisions)), request_id, step),
        )
        db.commit()
    finally:
        db.close()


# --- end to end: a real pipeline, the default model, the command ---------------------------


@pytest.mark.slow
def test_audit_verify_passes_on_real_requests_and_names_a_tampered_step(tmp_path, capsys):
    """A real greedy and a real sampled request (the model drafter: p rows) through a running
    pipeline; `speclanes audit` reads the store while the audit lane keeps writing it."""
    from pipeline.model import default_model_path

    from .pipeline_harness import running_pipeline

    settings = [
        f"model.draft_path={default_model_path()}",  # the target drafts for itself: sampled p rows
        "timeouts.draft=5.0",
        "audit.resend_after=0.5",
        "audit.snapshot_seconds=0.5",
    ]
    prompt = "Write a Python function that reverses a string, then explain it."
    runs = {
        "greedy": (SamplingParams(max_tokens=32), "auto"),
        "sampled": (SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32), "model"),
    }
    with running_pipeline(tmp_path / "run", settings) as pipeline:
        ids = {}
        with pipeline.client() as client:
            for name, (params, drafter) in runs.items():
                done = client.complete(prompt, chat=True, params=params, drafter=drafter, k=4)
                assert done.error is None, done
                ids[name] = done.request_id
        pipeline.wait_until(lambda r: r.audit_pending == 0, what="the audit outbox to empty")
        db = pipeline.config.audit.path

        for name, request_id in ids.items():
            code, out = run_cli(capsys, "verify", request_id, "--db", db)
            assert code == 0, (name, out)
            assert out.strip().splitlines()[-1].startswith("verdict: pass"), out
        code, out = run_cli(capsys, "verify", ids["sampled"], "--db", db, "--json")
        report = msgspec.json.decode(out)
        # The pipeline serves on a row-invariant backend and the record names it, so the recomputation
        # (the whole sequence in chunks of 64) gives the served numbers bit for bit: no round-off at all.
        assert report["verdict"] == "pass" and report["max_q_error"] == 0.0
        assert any(s["drafter"] == "model" and s["drafted"] for s in report["steps"])
        code, out = run_cli(capsys, "list", "--db", db, "--json")
        assert {r["request_id"] for r in msgspec.json.decode(out)} == set(ids.values())
        code, out = run_cli(capsys, "stats", "--db", db, "--json")
        stats = msgspec.json.decode(out)
        assert {"verify", "draft", "audit"} <= set(stats["lanes"]) and stats["finished_requests"] == 2

        store = AuditStore(db, readonly=True)
        steps = [e for e in store.events(ids["sampled"]) if isinstance(e, StepEvent)]
        store.close()
        target = next(s for s in steps if any(d.u is not None for d in s.decisions))
        tamper_stored_step(db, ids["sampled"], target.step)
        command = [sys.executable, "-m", "pipeline.cli", "audit", "verify", ids["sampled"], "--db", db]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 1, (result.stdout, result.stderr)
        assert f"verdict: fail at step {target.step}" in result.stdout, result.stdout


def test_the_audit_lane_applies_the_configured_limits(tmp_path):
    from types import SimpleNamespace

    from lanes.audit import retain
    from pipeline.protocol.config import load_config

    config = load_config(None, ["audit.max_requests=1", "audit.max_age_days=0", "audit.prune_seconds=7"], {})
    store = AuditStore(tmp_path / "audit.sqlite")
    store.add([*fake_request("old", 1000.0), *fake_request("new", 2000.0)])
    before = time.monotonic()
    due = retain(store, SimpleNamespace(config=config))  # type: ignore[arg-type]
    assert store.request_ids() == ["new"] and before + 7 <= due <= time.monotonic() + 7
    store.close()


def test_garbage_in_a_record_is_a_failure_not_a_crash(models, sampled_record):
    target, draft, _ = models
    step = first_step(sampled_record, lambda s: True)
    events = replace_step(sampled_record, step.step, emitted=[*step.emitted[:-1], 10**9])
    assert_fails_at(verify_request("req", events, target, draft), step.step, "vocabulary")
    opened = sampled_record[0]
    assert isinstance(opened, RequestOpened)
    for settings in (
        {},
        {**opened.settings, "params": {"temperature": -1}},
        {**opened.settings, "seed": "x"},
    ):
        forged = msgspec.structs.replace(opened, settings=settings)
        report = verify_request("req", [forged, *sampled_record[1:]], target, draft)
        assert report.verdict == "fail" and "settings" in report.problems[0]


def test_cli_finds_the_store_through_the_config(tmp_path, capsys):
    store = AuditStore(tmp_path / "audit.sqlite")
    store.add(fake_request("abc", 1000.0))
    code, out = run_cli(capsys, "list", "--json", "--set", f"run.dir={tmp_path}")
    assert code == 0 and [r["request_id"] for r in msgspec.json.decode(out)] == ["abc"]
    code = cli.main(["audit", "list", "--set", f"audit.path={tmp_path}/nothing.sqlite"])
    assert code == 2 and "no audit database" in capsys.readouterr().err
    store.close()


# --- token trees -------------------------------------------------------------------------


def branching_events(models, params):
    target, _, _ = models
    prompt = np.random.default_rng(2).integers(40, 47, size=60).tolist()  # n-grams recur, branching
    events = audited_run(target, params, NgramSource(1, 2), k=8, prompt=prompt)
    trees = [s for s in steps_of(events) if s.parents is not None and len(set(s.parents)) < len(s.parents)]
    return events, trees


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_tree_steps_verify_and_a_hidden_match_is_caught(models, params):
    """Honest tree steps pass; a step that claims no child carried the target's token while one
    did (the rejection the tree rule forbids) fails, as does a tree whose shape was altered."""
    target, _, _ = models
    events, trees = branching_events(models, params)
    assert trees, "the n-gram drafter proposed no branching tree here"
    assert verify_request("req", events, target, None).verdict == "pass"
    step = trees[0]
    root_children = [i for i, p in enumerate(step.parents) if p == -1]
    lying = step.emitted[0]
    forged = [*step.drafted]
    forged[root_children[-1]] = lying if lying not in [step.drafted[c] for c in root_children] else forged[0]
    tampered = replace_step(events, step.step, drafted=forged)
    report = verify_request("req", tampered, target, None)
    assert report.verdict == "fail"
    broken = replace_step(events, step.step, parents=[0, *step.parents[1:]])
    assert_fails_at(verify_request("req", broken, target, None), step.step, "parent")


@pytest.mark.parametrize("as_batch", [True, False])
def test_the_audit_lane_writes_a_batch_in_one_transaction_and_acknowledges_it_once(tmp_path, as_batch):
    """The orchestrator's AuditBatch (the events of `audit.batch_seconds`) is one commit and one
    AuditAck (one fsync for several steps); single events are each written and acknowledged too."""
    import msgspec
    import trio

    from lanes.audit import serve
    from lanes.lane import LaneContext
    from pipeline.protocol.config import load_config
    from pipeline.protocol.messages import AuditAck, AuditBatch, ControlInbox, encode
    from pipeline.protocol.transport import Inbox, Outbox

    from .telemetry_harness import MemoryTelemetry

    config = load_config(None, [f"run.dir={tmp_path}"], {})
    events = [*fake_request("a", 1000.0), *fake_request("b", 1001.0), *fake_request("c", 1002.0)]
    sent = [AuditBatch(events=[msgspec.Raw(encode(e)) for e in events])] if as_batch else events
    acks: list[AuditAck] = []

    async def scenario() -> None:
        control = Inbox(config.bind("control"), ControlInbox, config.tls)
        outbox = Outbox(config.addresses.audit, config.tls, buffer=len(events))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, LaneContext("audit", config, MemoryTelemetry()))
            with trio.fail_after(20):
                while not outbox.connected():
                    await trio.sleep(0.01)
                assert all(outbox.put_bytes_nowait(encode(message)) for message in sent)
                while sum(len(a.event_ids) for a in acks) < len(events):
                    if isinstance(ack := await control.next(), AuditAck):
                        acks.append(ack)
            nursery.cancel_scope.cancel()
        control.close()
        outbox.sock.close()

    trio.run(scenario)
    store = AuditStore(config.audit.path)
    assert sorted(store.request_ids()) == ["a", "b", "c"]
    store.close()
    assert sorted(i for a in acks for i in a.event_ids) == sorted(e.event_id for e in events)
    if as_batch:
        assert len(acks) == 1

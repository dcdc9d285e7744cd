"""`speclanes audit list|show|stats|verify`: read the audit store, tables for people, `--json`
for programs. A thin layer: the store answers queries, `audit_verify` does the checking.

The store is opened read-only next to a running audit lane (SQLite WAL: readers see a
consistent snapshot and never block the writer).
"""

from __future__ import annotations

import argparse
import datetime
import sqlite3
from pathlib import Path
from typing import Any

import msgspec

from pipeline.audit.store import AuditStore
from pipeline.observability.request_ids import AmbiguousId
from pipeline.protocol.messages import FaultEvent, LaneSnapshot, RequestOpened, SpeculativeEvent, StepEvent

EXIT_FAIL, EXIT_INCOMPLETE = 1, 3
REQUEST_HELP = "a request id, the HTTP response's id (chatcmpl-..., cmpl-...), or a unique prefix of either"
# A request's events reach the store up to `audit.batch_seconds` after they are decided (the orchestrator
# sends them in batches, journaled until the audit lane acknowledges them): one that just finished may not
# be there yet.
PENDING_HINT = (
    "a request's events are written within audit.batch_seconds of its steps; `speclanes status` shows"
    " how many wait"
)


def add_parser(sub: argparse._SubParsersAction, config_flags: Any) -> None:
    audit = sub.add_parser(
        "audit", help="read the audit trail; prove a request's decisions followed the rule"
    )
    audit_sub = audit.add_subparsers(dest="audit", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        p = audit_sub.add_parser(name, help=help_)
        config_flags(p)
        p.add_argument("--db", metavar="PATH", help="audit database (default: the config's audit.path)")
        p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
        return p

    listing = command("list", "recorded requests, newest first")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (0: all)")
    show = command("show", "one request: settings, prompt, every step and decision, summary")
    show.add_argument("request", help=REQUEST_HELP)
    command("stats", "totals over the store, and the latest snapshot of every lane")
    verify = command("verify", "re-run the target over the recorded tokens and check every decision")
    verify.add_argument("request", help=REQUEST_HELP)
    verify.add_argument("--model", metavar="PATH", help="target GGUF (default: the one recorded)")
    verify.add_argument("--draft-model", metavar="PATH", help="draft GGUF (default: the one recorded)")
    verify.add_argument(
        "--backend", metavar="KEY", help="runtime to recompute with (default: the one that served each step)"
    )


def _open(args: argparse.Namespace) -> AuditStore:
    path = args.db
    if path is None:
        from pipeline.protocol.config import load_config

        path = load_config(args.config, args.set).audit.path
    return AuditStore(path, readonly=True)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _print_json(data: object) -> None:
    print(msgspec.json.encode(data).decode())


def main(args: argparse.Namespace) -> int:
    try:
        store = _open(args)
    except sqlite3.Error as exc:
        raise ValueError(f"cannot open the audit database: {exc}") from None
    try:
        handler = {"list": cmd_list, "show": cmd_show, "stats": cmd_stats, "verify": cmd_verify}[args.audit]
        return handler(store, args)
    except AmbiguousId as exc:
        raise ValueError(str(exc.args[0])) from None
    except LookupError as exc:  # perhaps not yet written: the orchestrator holds events for a while
        raise ValueError(f"{exc.args[0]} ({PENDING_HINT})") from None
    except sqlite3.Error as exc:
        raise ValueError(f"audit database: {exc}") from None
    finally:
        store.close()


def request_rows(store: AuditStore, limit: int) -> list[dict[str, Any]]:
    events = store.of_types(["RequestOpened", "SpeculativeEvent"])
    steps = store.step_counts()
    rows: dict[str, dict[str, Any]] = {}
    for e in events:
        row = rows.setdefault(e.request_id, {"request_id": e.request_id, "time": e.time, "steps": 0})
        if isinstance(e, RequestOpened):
            params = e.settings.get("params", {})
            row.update(
                time=e.time, drafter=e.settings.get("drafter"), k=e.settings.get("k"),
                temperature=params.get("temperature"), seed=e.settings.get("seed"),
                prompt_tokens=len(e.prompt_tokens),
            )  # fmt: skip
        elif isinstance(e, SpeculativeEvent):
            row.update(
                output_tokens=len(e.tokens), drafted=e.drafted, accepted=e.accepted,
                acceptance_rate=e.acceptance_rate, finish_reason=e.finish_reason,
            )  # fmt: skip
    for request_id, row in rows.items():
        row["steps"] = max(steps.get(request_id, 0) - 1, 0)  # verify steps, the prefill not counted
    ordered = sorted(rows.values(), key=lambda r: r["time"], reverse=True)
    return ordered[:limit] if limit > 0 else ordered


def cmd_list(store: AuditStore, args: argparse.Namespace) -> int:
    rows = request_rows(store, args.limit)
    if args.json:
        _print_json(rows)
        return 0
    print(f"{'request':<34}{'started':<21}{'drafter':<9}{'temp':>6}{'prompt':>8}{'output':>8}"
          f"{'steps':>7}{'accept':>8}  finish")  # fmt: skip
    for r in rows:
        temp = "-" if r.get("temperature") is None else f"{r['temperature']:g}"
        accept = "-" if "acceptance_rate" not in r else f"{r['acceptance_rate']:.2f}"
        print(
            f"{r['request_id']:<34}{_when(r['time']):<21}{r.get('drafter') or '-':<9}{temp:>6}"
            f"{r.get('prompt_tokens', '-'):>8}{r.get('output_tokens', '-'):>8}{r['steps']:>7}{accept:>8}"
            f"  {r.get('finish_reason', '(running or failed)')}"
        )
    return 0


def cmd_show(store: AuditStore, args: argparse.Namespace) -> int:
    request_id = store.resolve(args.request)
    events = store.events(request_id)
    opened = next((e for e in events if isinstance(e, RequestOpened)), None)
    steps = sorted((e for e in events if isinstance(e, StepEvent)), key=lambda e: e.step)
    summary = next((e for e in events if isinstance(e, SpeculativeEvent)), None)
    faults = [e.fault for e in events if isinstance(e, FaultEvent)]
    if args.json:
        step_data = msgspec.to_builtins(steps)
        for data, step in zip(step_data, steps, strict=True):  # records, not positional arrays
            data["decisions"] = [msgspec.structs.asdict(d) for d in step.decisions]
        _print_json(
            {
                "request_id": request_id,
                "opened": opened,
                "steps": step_data,
                "summary": summary,
                "faults": faults,
            }
        )
        return 0
    print(f"request {request_id}")
    if opened is not None:
        print(f"  started   {_when(opened.time)}")
        print(f"  settings  {msgspec.json.encode(opened.settings).decode()}")
        print(f"  prompt    {len(opened.prompt_tokens)} tokens: {opened.prompt_tokens}")
    print(
        f"  {'step':>5} {'drafter':<8}{'k':>3}{'drafted':>8}{'kept':>5}  {'final u':<10}{'draws':>6}  emitted"
    )
    for s in steps:
        kept = sum(d.kept for d in s.decisions)
        u = "-" if s.final_u is None else f"{s.final_u:.6f}"
        print(
            f"  {s.step:>5} {s.drafter or '-':<8}{s.k:>3}{len(s.drafted):>8}{kept:>5}  {u:<10}{s.draws:>6}"
            f"  {s.emitted}"
        )
        for d in s.decisions:
            du = "-" if d.u is None else f"{d.u:.6f}"
            verdict = "kept" if d.kept else f"rejected -> {d.replacement}"
            print(
                f"        pos {d.position}: draft {d.draft_token}  p={d.p:.6g}  q={d.q:.6g}  u={du}"
                f"  {verdict}"
            )
    if summary is not None:
        print(
            f"  summary   {summary.finish_reason}; {len(summary.tokens)} tokens served, "
            f"{summary.iterations} steps, "
            f"{summary.drafted} drafted, {summary.accepted} accepted ({summary.acceptance_rate:.2f})"
        )
    else:
        print("  summary   none (the request failed or is still running)")
    for f in faults:
        print(f"  fault     {f.kind} on {f.lane}: {f.message}")
    return 0


def cmd_stats(store: AuditStore, args: argparse.Namespace) -> int:
    summaries = [e for e in store.of_types(["SpeculativeEvent"]) if isinstance(e, SpeculativeEvent)]
    latest: dict[str, LaneSnapshot] = {}
    for e in store.of_types(["LaneSnapshot"]):
        if isinstance(e, LaneSnapshot):
            latest[e.lane] = e  # oldest first: the last one wins
    finish: dict[str, int] = {}
    for s in summaries:
        finish[s.finish_reason] = finish.get(s.finish_reason, 0) + 1
    drafted, accepted = sum(s.drafted for s in summaries), sum(s.accepted for s in summaries)
    path = Path(store.db.execute("PRAGMA database_list").fetchone()[2])
    data = {
        "database": str(path),
        "bytes": sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file()),
        "events": store.counts(),
        "finished_requests": len(summaries),
        "finish_reasons": finish,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "output_tokens": sum(len(s.tokens) for s in summaries),
        "lanes": {name: msgspec.to_builtins(snap) for name, snap in sorted(latest.items())},
    }
    if args.json:
        _print_json(data)
        return 0
    print(f"database  {data['database']} ({data['bytes'] / 1e6:.1f} MB with its WAL)")
    print("events    " + ", ".join(f"{k} {v}" for k, v in data["events"].items()))
    print(f"finished  {len(summaries)} requests: " + ", ".join(f"{k} {v}" for k, v in sorted(finish.items())))
    print(
        f"tokens    {data['output_tokens']} served; {drafted} drafted, {accepted} accepted "
        f"(acceptance {data['acceptance_rate']:.2f})"
    )
    if latest:
        print(
            f"  {'lane':<13}{'state':<10}{'pid':>8}{'restarts':>10}{'runs':>8}{'drafted':>10}"
            f"{'accepted':>10}  as of"
        )
        for name, snap in sorted(latest.items()):
            t = snap.totals
            print(
                f"  {name:<13}{snap.lane_state:<10}{snap.pid or '-':>8}{snap.restarts:>10}{t.runs:>8}"
                f"{t.drafted:>10}{t.accepted:>10}  {_when(snap.time)}"
            )
    return 0


def _models(opened: RequestOpened | None, steps: list[StepEvent], args: argparse.Namespace):
    """The target (and, when some step's p is a draft-model row, the draft model) to re-run."""
    from pipeline.audit.verify import uses_draft_rows
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.model import load_model
    from pipeline.model.default import model_path

    settings = opened.settings if opened is not None else {}
    target_path = model_path(args.model or settings.get("model"))
    backend = args.backend or served_backend(steps)
    target = load_model(target_path, backend)
    params = msgspec.convert(settings.get("params", {}), SamplingParams)
    if not any(uses_draft_rows(s, params) for s in steps):
        return target, None
    draft_path = args.draft_model or settings.get("draft_model")
    if not draft_path or not Path(draft_path).is_file():
        return target, None
    if Path(draft_path).resolve() == target_path.resolve():
        return target, target
    return target, load_model(draft_path, backend)


def served_backend(steps: list[StepEvent]) -> str:
    """The runtime the verify lane recorded for the steps ("numpy:f32" for records made before
    backends were recorded). A request whose steps name two runtimes (a lane restarted with
    another setting) cannot be recomputed with one: that is an error, not a silent pick."""
    backends = {step.backend or "numpy:f32" for step in steps}
    if len(backends) > 1:
        raise ValueError(f"the steps were served by several runtimes ({', '.join(sorted(backends))}): "
                         "pass --backend to recompute with one of them")  # fmt: skip
    return backends.pop() if backends else "auto"


def cmd_verify(store: AuditStore, args: argparse.Namespace) -> int:
    from pipeline.audit.verify import verify_request

    request_id = store.resolve(args.request)
    events = store.events(request_id)
    opened = next((e for e in events if isinstance(e, RequestOpened)), None)
    steps = [e for e in events if isinstance(e, StepEvent)]
    target, draft = _models(opened, steps, args)
    report = verify_request(request_id, events, target, draft)
    code = {"pass": 0, "fail": EXIT_FAIL, "incomplete": EXIT_INCOMPLETE}[report.verdict]
    if args.json:
        data = msgspec.to_builtins(report)
        for step, verdict in zip(data["steps"], report.steps, strict=True):
            step["ok"] = verdict.ok
        data["failed_steps"] = report.failed_steps
        _print_json(data)
        return code
    print(f"request {request_id}: re-running {target.cfg.name} over {len(steps)} recorded steps")
    for s in report.steps:
        head = f"step {s.step:>4}  {s.drafter or '-':<7} drafted {s.drafted:>2} kept {s.accepted:>2}"
        if s.problems:
            for problem in s.problems:
                print(f"{head}  FAIL: {problem}")
        else:
            note = f"  (unchecked: {'; '.join(s.unchecked)})" if s.unchecked else ""
            print(f"{head}  ok{note}")
    for problem in report.problems:
        print(f"request: FAIL: {problem}")
    failed = report.failed_steps
    where = f" at step{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}" if failed else ""
    print(
        f"verdict: {report.verdict}{where} ({len(report.steps)} steps; largest |recorded - recomputed| "
        f"q(x) {report.max_q_error:.2g}, p(x) {report.max_p_error:.2g})"
    )
    return code

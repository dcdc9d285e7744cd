"""The HTTP rows of `speclanes bench peers`: speclanes' gateway against llama-server, HTTP against HTTP.

Every request is a streamed `/v1/completions` call (SSE, `stream_options.include_usage`) with the
same prompt token ids as every other row, greedy (`temperature: 0`), `max_tokens` new tokens with EOS
ignored (`ignore_eos`, which both servers take), timed by the client (`http_clients`). The gateway
rows name their drafter (`speculation.drafter`); llama-server's ask `cache_prompt: false`, so it
prefills every prompt as speclanes does (a slot would otherwise replay the repeat's cached prompt).

Single stream: each row runs each workload once a repeat, interleaved with the other rows of
`peers_bench`. Clients: N clients at once, each sending every workload in turn (client c starts at
the c-th), against one server: each gateway drafter on a pipeline of its own, started for the phase,
so `auto`'s cross-request cache has seen none of these prompts before the phase; llama-server is the
one the run started (`--parallel` N slots). Every gateway output must equal in-process `--drafter
none`'s text and length; llama-server's may differ on near-ties (other numerics), and its table says
where. It also differs from the reference's first end of sequence on: its `ignore_eos` bans EOS,
where speclanes (and every other row) takes the argmax even when it is EOS and goes on; the table
says "to EOS" where the text is the same up to there.
"""

from __future__ import annotations

import statistics
from typing import Any

from pipeline.bench import http_clients
from pipeline.bench.common import cpu_seconds, lane_pids, running_pipeline
from pipeline.protocol.client import Client

GATEWAY, LLAMA_SERVER = "gateway", "llama-server"
HTTP_SYSTEMS = (GATEWAY, LLAMA_SERVER)
SPEEDUP_TARGET = 1.5  # issue 25: the gateway's `none` at 1.5x llama-server's tok/s, single stream


def body(system: str, mode: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One request's body for either server (the SSE fields are added by `http_clients.stream`)."""
    out: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if system == GATEWAY:
        out["speculation"] = {"drafter": mode}
    else:
        out["cache_prompt"] = False
    return out


def gateway_settings(port: int) -> list[str]:
    """A benchmark pipeline's settings that turn its gateway on, on a port of the bench's own."""
    return ["gateway.enabled=true", f"gateway.port={port}"]


def client_workloads(workloads: list[str], clients: int) -> list[list[str]]:
    """The workloads each client sends in turn: all of them, client c starting at the c-th."""
    n = len(workloads)
    return [[workloads[(c + i) % n] for i in range(n)] for c in range(clients)]


def drive(
    url: str, system: str, mode: str, prompts: dict[str, list[int]], clients: int, max_tokens: int
) -> dict:
    """One clients phase against a running server: the outputs by workload and the aggregate rate."""
    plan = client_workloads(list(prompts), clients)
    work = [[body(system, mode, prompts[w], max_tokens) for w in names] for names in plan]
    results, wall = http_clients.concurrently(f"{url}/v1/completions", work)
    outputs = [
        (w, r) for names, rs in zip(plan, results, strict=True) for w, r in zip(names, rs, strict=True)
    ]
    count = sum(r["count"] for _, r in outputs)
    return {"outputs": outputs, "count": count, "seconds": wall, "tokens_per_second": count / wall}


def gateway_phase(
    settings: list[str], mode: str, prompts: dict[str, list[int]], clients: int, max_tokens: int
) -> tuple[dict, float]:
    """A clients phase on a pipeline started for it; also returns the CPU seconds its processes used."""
    port = http_clients.free_port()
    with running_pipeline([*settings, *gateway_settings(port)]) as config:
        url = f"http://127.0.0.1:{port}"
        http_clients.wait_healthy(url, 60.0)
        with http_clients.new_client() as client:  # one short untimed request: first calls pay extra
            http_clients.stream(client, f"{url}/v1/completions", body(GATEWAY, mode, [1], 4))
        with Client(config.addresses.client, timeout=60.0) as control:
            pids = list(lane_pids(control.status()).values())
        before = sum(cpu_seconds(pid) for pid in pids)
        phase = drive(url, GATEWAY, mode, prompts, clients, max_tokens)
        return phase, sum(cpu_seconds(pid) for pid in pids) - before


# --- summary --------------------------------------------------------------------------


def same(result: dict, reference: str, max_tokens: int) -> bool:
    return result["text"] == reference and result["count"] == max_tokens


def first_difference(text: str, reference: str) -> int | None:
    """The first character where `text` and `reference` differ (None if equal)."""
    index = next((i for i, (a, b) in enumerate(zip(text, reference, strict=False)) if a != b), None)
    if index is None and len(text) != len(reference):
        index = min(len(text), len(reference))
    return index


def agreement(texts: list[str], reference: str, eos_char: int | None) -> dict[str, Any]:
    """How far texts agree with the reference: the earliest first difference, and whether they agree
    up to the reference's first end of sequence (`eos_char`, the length of its text before it)."""
    diffs = [d for text in texts if (d := first_difference(text, reference)) is not None]
    first = min(diffs) if diffs else None
    to_eos = first is None or (eos_char is not None and first >= eos_char)
    return {"first_difference": first, "to_eos": to_eos}


def summarise(
    single: dict[str, dict[str, list[dict]]],
    phases: dict[str, list[dict]],
    references: dict[str, str],
    max_tokens: int,
    eos_chars: dict[str, int | None] | None = None,
) -> dict[str, dict]:
    """Per HTTP row ("gateway none", "llama-server plain"): per workload the median client-side
    tok/s and first-token time, whether every output equals the reference text, and where the first
    difference is (`agreement`); under load the median aggregate tok/s and the same check over every
    output."""
    eos_chars = eos_chars or {}
    names = [name for by_row in single.values() for name in by_row]
    out: dict[str, dict] = {}
    for name in dict.fromkeys(names):
        system, mode = name.split(" ", 1)
        workloads = {}
        for workload, by_row in single.items():
            runs = by_row[name]
            workloads[workload] = {
                "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
                "first_token_seconds": statistics.median(r["first_token_seconds"] for r in runs),
                "tokens_per_second_runs": [r["tokens_per_second"] for r in runs],
                "equal": all(same(r, references[workload], max_tokens) for r in runs),
                **agreement([r["text"] for r in runs], references[workload], eos_chars.get(workload)),
            }
        row: dict[str, Any] = {"system": system, "mode": mode, "workloads": workloads, "clients": None}
        if phases.get(name):
            row["clients"] = {
                "tokens_per_second": statistics.median(p["tokens_per_second"] for p in phases[name]),
                "tokens_per_second_runs": [p["tokens_per_second"] for p in phases[name]],
                "requests": len(phases[name][-1]["outputs"]),
                "equal": all(
                    same(r, references[w], max_tokens) for p in phases[name] for w, r in p["outputs"]
                ),
            }
        out[name] = row
    return out


def speedups(summary: dict[str, dict]) -> list[dict]:
    """Each gateway row against llama-server, per workload and under load."""
    server = summary.get(f"{LLAMA_SERVER} plain")
    if server is None:
        return []
    checks = []
    for name, row in summary.items():
        if row["system"] != GATEWAY:
            continue
        for workload, r in row["workloads"].items():
            ratio = r["tokens_per_second"] / server["workloads"][workload]["tokens_per_second"]
            checks.append({"ours": name, "workload": workload, "ratio": ratio})
        if row["clients"] and server["clients"]:
            ratio = row["clients"]["tokens_per_second"] / server["clients"]["tokens_per_second"]
            checks.append({"ours": name, "workload": "clients", "ratio": ratio})
    return checks


def gateway_equal(summary: dict[str, dict]) -> bool:
    """Whether every gateway output, single stream and under load, equals in-process `none`."""
    rows = [r for r in summary.values() if r["system"] == GATEWAY]
    return all(
        all(w["equal"] for w in r["workloads"].values()) and (r["clients"] is None or r["clients"]["equal"])
        for r in rows
    )


# --- report ---------------------------------------------------------------------------


def agreement_text(row: dict) -> str:
    """The `= reference` cell: "yes" where every output equals it, else per workload "yes", "to EOS"
    or "no", with the first differing character."""
    ws = row["workloads"]
    if all(w["equal"] for w in ws.values()) and (row["clients"] is None or row["clients"]["equal"]):
        return "yes"
    parts = []
    for name, w in ws.items():
        if w["equal"]:
            parts.append(f"{name} yes")
        else:
            parts.append(f"{name} {'to EOS' if w['to_eos'] else 'no'} (from char {w['first_difference']})")
    return ", ".join(parts)


def render(summary: dict[str, dict], clients: int) -> list[str]:
    """The HTTP table, the gateway's speed-ups over llama-server and the issue's single-stream goal."""
    if not summary:
        return []
    workloads = list(next(iter(summary.values()))["workloads"])
    head = " | ".join(f"{w} tok/s" for w in workloads)
    lines = [
        f"HTTP against HTTP: `/v1/completions` streamed (SSE, include_usage), tokens/s as the client "
        f"sees them; {clients} clients: each sends every workload in turn, aggregate tokens/s.",
        "",
        f"| system | mode | {head} | first token s | {clients} clients tok/s | = reference |",
        f"|---|---|{'---:|' * len(workloads)}---|---:|---|",
    ]
    for row in summary.values():
        ws = row["workloads"].values()
        rates = " | ".join(f"{w['tokens_per_second']:.1f}" for w in ws)
        first = " / ".join(f"{w['first_token_seconds']:.2f}" for w in ws)
        load = row["clients"]
        load_rate = f"{load['tokens_per_second']:.1f}" if load else "-"
        lines.append(
            f"| {row['system']} | {row['mode']} | {rates} | {first} | {load_rate} | {agreement_text(row)} |"
        )
    lines.append(
        "(= reference: every output's text and length equal in-process `--drafter none`'s for that prompt; "
        "the gateway must, llama-server's numerics may differ on near-ties; to EOS: the same text up to the "
        "reference's first end of sequence, which llama-server's ignore_eos bans and the others take.)"
    )
    return lines + render_goal(speedups(summary))


def render_goal(checks: list[dict]) -> list[str]:
    if not checks:
        return ["Goal: not checked (needs a gateway row and llama-server)."]
    lines = [""]
    for ours in dict.fromkeys(c["ours"] for c in checks):
        parts = ", ".join(f"{c['workload']} {c['ratio']:.2f}x" for c in checks if c["ours"] == ours)
        lines.append(f"- {ours} / llama-server: {parts}")
    single = [c for c in checks if c["ours"] == f"{GATEWAY} none" and c["workload"] != "clients"]
    if single:
        met = all(c["ratio"] >= SPEEDUP_TARGET for c in single)
        lines.append(
            f"Goal (issue 25): gateway `none` >= {SPEEDUP_TARGET:.1f}x llama-server single stream: "
            f"{'met' if met else 'NOT met'}."
        )
    return lines

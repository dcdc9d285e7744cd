"""The peer benchmark's pure helpers: row plan, skip logic, equality, summary, table.

The benchmark itself needs torch and llama-cpp-python and is not run here; importing its module
must not import them either."""

from __future__ import annotations

import subprocess
import sys

from pipeline.bench import peers_bench as pb


def run(tokens: list[int], seconds: float = 1.0, first: float = 0.5, steps: int = 3) -> dict:
    return {"tokens": tokens, "seconds": seconds, "first_token_seconds": first, "steps": steps}


def test_module_does_not_import_the_peers() -> None:
    code = "import sys, pipeline.bench.peers_bench; sys.exit(bool({'torch', 'llama_cpp'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_rows_reference_first_and_peers_paired() -> None:
    rows = pb.variants(["none", "auto"], pipeline=True, peers=["llama_cpp"])
    assert rows[0] == pb.REFERENCE
    assert [v.name for v in rows] == [
        "speclanes none", "speclanes auto", "pipeline none", "pipeline auto",
        "llama.cpp plain", "llama.cpp lookup",
    ]  # fmt: skip
    assert [v.speculative for v in rows] == [False, True, False, True, False, True]


def test_rotated_visits_every_row_once() -> None:
    items = [1, 2, 3, 4]
    for shift in range(6):
        assert sorted(pb.rotated(items, shift)) == items
    assert pb.rotated(items, 1) == [2, 3, 4, 1]
    assert pb.rotated([], 3) == []


def test_missing_peer_is_skipped_with_a_reason(monkeypatch) -> None:
    monkeypatch.setitem(pb.PEERS, "ghost", ("no_such_module_speclanes",))
    monkeypatch.setitem(pb.PEER_NAMES, "ghost", "ghost")
    reason = pb.peer_missing("ghost")
    assert reason is not None and "no_such_module_speclanes" in reason and "install_peers.sh" in reason
    skipped: dict[str, str] = {}
    assert pb.start_workers(["ghost"], pb.Path("x.gguf"), 2, 10, skipped) == {}
    assert skipped == {"ghost": reason}


def test_first_difference_and_equality() -> None:
    assert pb.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert pb.first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert pb.first_difference([1, 2], [1, 2, 3]) == 2
    check = pb.equality([run([1, 2, 3]), run([1, 2, 4])], [1, 2, 3])
    assert check == {"equal": False, "first_difference": 2}
    assert pb.equality([run([1, 2, 3])], [1, 2, 3])["equal"]


def test_summary_speedups_accepted_length_and_goal() -> None:
    rows = pb.variants(["none", "auto"], pipeline=False, peers=["hf"])
    ref = [5, 6, 7, 8, 9]
    runs = {
        "quote": {
            "speclanes none": [run(ref, seconds=2.0, steps=4)],
            "speclanes auto": [run(ref, seconds=1.0, steps=2)],
            "transformers plain": [run(ref, seconds=4.0, steps=4)],
            "transformers lookup": [run([5, 6, 0, 0, 0], seconds=2.0, steps=1)],
        }
    }
    summary = pb.summarise(runs, rows)
    auto, lookup = summary["quote"]["speclanes auto"], summary["quote"]["transformers lookup"]
    assert auto["speedup_vs_plain"] == 2.0 and auto["mean_accepted_length"] == 2.0
    assert lookup["speedup_vs_plain"] == 2.0 and lookup["speedup_vs_reference"] == 1.0
    assert lookup["mean_accepted_length"] == 4.0
    assert lookup["reference"] == {"equal": False, "first_difference": 2}
    assert summary["quote"]["transformers plain"]["own_plain"] is None
    [check] = pb.goal(summary)
    assert check["ours"] == "speclanes auto" and check["ratio"] == 2.0
    table = "\n".join(pb.render_table(summary))
    assert "| quote | transformers | lookup | 2.5 | 2.00x | 1.00x |" in table
    assert "no (from token 2)" in table
    assert "Goal met." in pb.render_goal(pb.goal(summary))

"""`speclanes bench speculative`: paired speed-ups and the tree-vs-chain column, on a tiny model."""

from __future__ import annotations

import pytest

from pipeline.bench import speculative_bench as sb
from pipeline.decoding.sampling import SamplingParams
from pipeline.model import load_model

from .tinymodel import TinySpec, write_tiny_gguf


def test_a_speed_up_pairs_the_runs_of_each_round():
    """Each round's ratio is kept, so a machine three times faster in its last two rounds does not
    let the plain runs of quick rounds be set against the drafter's runs of slow ones."""
    plain, drafted = [10.0, 30.0, 31.0], [25.0, 30.5, 62.0]  # 2.5x, a hiccup (1.02x), then 2x
    assert sb.paired(drafted, plain, lambda rate: rate) == 2.0
    assert sorted(drafted)[1] / sorted(plain)[1] == pytest.approx(30.5 / 30.0)  # what medians alone say


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=5))
    return load_model(path, "native")


def test_the_bench_reports_trees_against_their_chains(tiny, monkeypatch):
    monkeypatch.setattr(sb, "WORKLOADS", {"quote": "a b c a b c a b c a b c"})
    results = sb.run(tiny, ["none", "ngram", "ngram/linear"], None, 2, SamplingParams(max_tokens=12))
    rows = results["quote"]["drafters"]
    assert rows["none"]["speedup"] == 1.0 and rows["none"]["tree_vs_linear"] is None
    assert rows["ngram"]["tree_vs_linear"] > 0 and rows["ngram/linear"]["tree_vs_linear"] is None
    assert all(row["identical_to_none"] for row in rows.values())
    table = sb.render(results)
    assert "vs chain" in table.splitlines()[0]
    assert f"{rows['ngram']['tree_vs_linear']:.2f}x" in table.splitlines()[2]


def test_a_base_model_gets_the_completion_form_of_each_workload(tiny_tokenizer):
    """A model without a chat template (Gemma 3 270M is one) is benchmarked on completions."""
    from types import SimpleNamespace

    from pipeline.bench.common import COMPLETION_WORKLOADS, WORKLOADS, chat_prompt, workload_prompt
    from pipeline.model.tokenizer import Tokenizer

    chat_model = SimpleNamespace(tokenizer=tiny_tokenizer)
    base = Tokenizer(tiny_tokenizer.hf, {"eos_id": tiny_tokenizer.eos_id, "chat_template": None})
    base_model = SimpleNamespace(tokenizer=base)
    code = WORKLOADS["code"]
    assert workload_prompt(chat_model, "code", code) == chat_prompt(chat_model, code)
    assert base.decode(workload_prompt(base_model, "code", WORKLOADS["code"])) == COMPLETION_WORKLOADS["code"]
    assert sorted(COMPLETION_WORKLOADS) == sorted(WORKLOADS)

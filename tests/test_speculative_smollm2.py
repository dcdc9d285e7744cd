"""Greedy speculation on the real default model is token-identical to plain decoding
(and, on the reference prompts, to HF transformers' greedy output)."""

from __future__ import annotations

import functools
import json

import pytest

from pipeline.bench.common import WORKLOADS
from pipeline.decoding.drafters import NoDraftSource
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import Result, decode

from .conftest import FIXTURES

pytestmark = pytest.mark.slow

REFERENCE = json.loads((FIXTURES / "smollm2_reference.json").read_text())["prompts"]
CASES = [(p["name"], p["prompt_ids"], p["greedy_ids"]) for p in REFERENCE]


def chat_prompt(model, text: str) -> list[int]:
    return model.tokenizer.encode(model.tokenizer.render_chat([{"role": "user", "content": text}]))


@pytest.mark.parametrize(("drafter", "k"), [("ngram", None), ("ngram", 5), ("suffix", None), ("auto", 8)])
@pytest.mark.parametrize(("name", "prompt", "expected"), CASES, ids=[c[0] for c in CASES])
def test_reference_prompts_match_transformers(smollm2, drafter, k, name, prompt, expected):
    params = SamplingParams(max_tokens=len(expected), ignore_eos=True)
    out = decode(smollm2, prompt, params, make_draft_source(drafter, smollm2), k=k)
    assert out.tokens == expected


@pytest.fixture(scope="module", params=["numpy", "served"])
def target(request, smollm2, served_model):
    """The reference and the default (fast, row-invariant) backend."""
    return smollm2 if request.param == "numpy" else served_model


@functools.cache
def plain_decoding(target, workload: str) -> tuple[list[int], SamplingParams, Result]:
    """A workload's prompt, settings and plain greedy decoding on `target`: made once (per xdist
    worker) and compared with each drafter's run, as plain decoding is deterministic."""
    prompt = chat_prompt(target, WORKLOADS[workload])
    # The numpy reference takes about 0.2 s a token on these VMs: 16 tokens there, 32 on the served backend.
    params = SamplingParams(max_tokens=32 if target.row_invariant else 16)
    return prompt, params, decode(target, prompt, params, NoDraftSource(), k=0)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize(("drafter", "k"), [("ngram", None), ("suffix", 3), ("auto", None), ("model", 4)])
def test_workloads_match_plain_decoding(target, workload, drafter, k):
    prompt, params, plain = plain_decoding(target, workload)
    source = make_draft_source(drafter, target, target if drafter == "model" else None)
    out = decode(target, prompt, params, source, k=k)
    assert out.tokens == plain.tokens and out.text == plain.text
    if drafter == "model":  # the target drafting for itself: every greedy draft is kept
        assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("workload", ["quote", "code"])
def test_seeded_speculation_equals_plain_seeded_decoding_on_the_default_model(served_model, workload):
    """Token trees and chains, with the default model's own rows: seed for seed, plain decoding's."""
    prompt = chat_prompt(served_model, WORKLOADS[workload])
    params = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=20261123)
    plain = decode(served_model, prompt, params, NoDraftSource(), k=0)
    for drafter, tree in (("auto", True), ("auto", False), ("ngram", True)):
        out = decode(served_model, prompt, params, make_draft_source(drafter, served_model), tree=tree)
        assert out.tokens == plain.tokens, (drafter, tree)
        assert out.stats.accepted > 0  # the drafts were used, not skipped

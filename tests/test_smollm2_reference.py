"""The default model against HF transformers on the same GGUF (fixtures made once by
tests/fixtures/make_reference.py; no torch here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.model.store import content_hash

from .conftest import FIXTURES

REFERENCE = json.loads((FIXTURES / "smollm2_reference.json").read_text())
PROMPTS = {p["name"]: p for p in REFERENCE["prompts"]}

pytestmark = pytest.mark.slow


def test_fixture_is_for_this_model_file(smollm2):
    from pipeline.model import default_model_path

    assert content_hash(default_model_path()) == REFERENCE["model_sha256"]


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompt_tokenization_matches_transformers(smollm2, name):
    case = PROMPTS[name]
    assert smollm2.tokenizer.encode(case["text"]) == case["prompt_ids"]


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_logits_match_transformers(smollm2, name):
    """Feed the reference tokens; every stored logit agrees within 1e-3."""
    case = PROMPTS[name]
    sequence = case["prompt_ids"] + case["greedy_ids"]
    logits = smollm2.forward(smollm2.new_cache(), sequence)
    random_ids = REFERENCE["random_logit_ids"]
    worst = 0.0
    for row in case["logits"]:
        got = logits[row["position"]]
        worst = max(
            worst,
            np.abs(got[row["top_ids"]] - row["top_logits"]).max(),
            np.abs(got[random_ids] - row["random_logits"]).max(),
        )
    assert worst < 1e-3


def test_full_logit_row_matches_transformers(smollm2):
    want = np.load(FIXTURES / "smollm2_prompt_a_last_logits.npy")
    got = smollm2.forward(smollm2.new_cache(), PROMPTS["a"]["prompt_ids"], all_logits=False)[0]
    assert np.abs(got - want).max() < 1e-3


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_generation_matches_transformers(smollm2, name):
    from pipeline.decoding.drafters import NoDraftSource
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.speculative import decode

    case = PROMPTS[name]
    params = SamplingParams(max_tokens=len(case["greedy_ids"]), ignore_eos=True)
    assert decode(smollm2, case["prompt_ids"], params, NoDraftSource()).tokens == case["greedy_ids"]


@pytest.mark.parametrize("case", REFERENCE["tokenizer_cases"], ids=lambda c: c["text"][:12])
def test_tokenizer_matches_transformers(smollm2, case):
    tok = smollm2.tokenizer
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["decoded"] == case["text"]


def test_chat_template_matches_transformers(smollm2):
    case = REFERENCE["chat_template_case"]
    assert smollm2.tokenizer.render_chat(case["messages"]) == case["rendered"]

"""The torch target, which answers a head's training prompts on a GPU: the served model's answers
and features, in padded batches.

It is training data, not output: its features may differ from the served runtime's by rounding
(float32 here, int8 activations there), so these tests compare within a tolerance. Its answers
must be the model's own: the greedy answers equal the served runtime's token for token on the tiny
model, whatever the padding its batch-mates force on it.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model import load_model
from pipeline.model.store import load_prepared
from pipeline.training.distill import distill, load_shards, sampled
from pipeline.training.prompts import prompts
from pipeline.training.torch_target import TorchTarget, check_supported, torch_answerer

from .tinymodel import TinySpec, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("torch-target") / "target.gguf"
    write_tiny_gguf(path, TinySpec(seed=5, scale=1.0))
    cfg, weights, _ = load_prepared(path)
    return load_model(path, "numpy"), TorchTarget(cfg, weights, "cpu", taps=(0,))


def encoded(model, count: int) -> list[list[int]]:
    tok = model.tokenizer
    return [tok.encode(tok.render_chat([{"role": "user", "content": t}])) for t in prompts("train")[:count]]


def test_greedy_answers_and_features_are_the_model_s_whatever_the_padding(tiny):
    model, target = tiny
    batch = encoded(model, 5)
    assert len({len(p) for p in batch}) > 1  # unequal prompts: the shorter ones are padded
    answers = target.answer(batch, [False] * len(batch), max_new=12, eos=model.tokenizer.eos_id, seed=0)
    for prompt, (tokens, prompt_length, features) in zip(batch, answers, strict=True):
        assert prompt_length == len(prompt) and tokens[:prompt_length].tolist() == prompt
        cache, fed, plain = model.new_cache(64), list(prompt), []
        while len(plain) < len(tokens) - prompt_length:
            logits, _ = model.forward_features([(cache, fed)], all_logits=False)
            plain.append(int(np.argmax(logits[0][-1])))
            fed = plain[-1:]
        assert tokens[prompt_length:].tolist() == plain
        _, (reference,) = model.forward_features([(model.new_cache(64), tokens[:-1].tolist())])
        d = model.cfg.d_model
        assert features.shape == (len(tokens) - 1, 2 * d)  # the tap after layer 0, then the final norm's
        assert np.allclose(features[:, d:].astype(np.float32), reference, atol=2e-2 * np.abs(reference).max())


def test_sampled_answers_follow_the_seed_and_differ_from_greedy(tiny):
    model, target = tiny
    batch = encoded(model, 4)
    eos = model.tokenizer.eos_id

    def run(seed: int, flags: list[bool]) -> list[list[int]]:
        return [t.tolist() for t, _, _ in target.answer(batch, flags, max_new=16, eos=eos, seed=seed)]

    hot = [True] * len(batch)
    assert run(3, hot) == run(3, hot) and run(3, hot) != run(4, hot)
    assert run(3, hot) != run(3, [False] * len(batch))


def test_distill_with_the_torch_answerer_writes_shards_the_trainer_reads(tiny, tmp_path):
    model, target = tiny
    answerer = torch_answerer(target, max_new=8, batch=4, seed=0, samples=2, eos=model.tokenizer.eos_id,
                              report=lambda _: None)  # fmt: skip
    record = distill(model, prompts("train")[:3], tmp_path, samples=2, answerer=answerer, shard=2,
                     report=lambda _: None)  # fmt: skip
    found = load_shards(tmp_path)
    assert record["samples"] == 2 and record["shards"] == 2 and len(found) == 6
    assert [sampled(i, 2) for i in range(4)] == [False, True, False, True]
    greedy = [t.tolist() for i, (t, _, _) in enumerate(found) if not sampled(i, 2)]
    assert greedy[0][: found[0][1]] == encoded(model, 1)[0]  # answers in the prompts' order
    assert all(len(f) == len(t) - 1 for t, _, f in found)


def test_a_family_the_torch_target_does_not_compute_is_refused(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_tiny_gguf(path, TinySpec(architecture="gemma3", head_size=24, sliding_window=8, rope_theta=1e6))
    cfg, _, _ = load_prepared(path)
    with pytest.raises(ValueError, match="llama block only"):
        check_supported(cfg)

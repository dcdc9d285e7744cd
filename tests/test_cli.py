"""`speclanes generate` as a user runs it: a subprocess, the real default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import FIXTURES

REFERENCE = {p["name"]: p for p in json.loads((FIXTURES / "smollm2_reference.json").read_text())["prompts"]}

pytestmark = pytest.mark.slow


def speclanes(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_json_matches_reference():
    """The float32 reference backend against HF transformers' own greedy output."""
    case = REFERENCE["a"]
    args = ("generate", case["text"], "--max-tokens", "40", "--ignore-eos", "--json", "--backend", "numpy")
    args += ("--drafter", "none")  # plain decoding: the numpy reference is not row-invariant
    result = speclanes(*args)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["prompt_tokens"] == case["prompt_ids"]
    assert out["tokens"] == case["greedy_ids"]
    assert out["finish_reason"] == "length"
    assert set(out["stats"]) >= {"wall_seconds", "prefill_seconds", "tokens_per_second"}
    assert out["stats"]["tokens_per_second"] > 0


def test_streamed_text_equals_json_text(tmp_path):
    """The two outputs of `generate` (streamed text, JSON) are one greedy decode on the default backend:
    the chat template's ids are HF transformers', and the tokens the in-process decoder's. Not HF's
    tokens: the native backend quantizes activations and keeps a float16 KV cache, and at token 16 its
    top two logits are 0.005 apart, where it parts from float32 HF."""
    from pipeline.decoding.drafters import NoDraftSource
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.speculative import decode
    from pipeline.model import default_model_path, load_model

    messages = tmp_path / "m.json"
    messages.write_text(
        json.dumps([{"role": "user", "content": "What is the tallest mountain in the world?"}])
    )
    streamed = speclanes("generate", "--messages", str(messages), "--max-tokens", "24")
    as_json = speclanes(
        "generate", "--chat", "What is the tallest mountain in the world?", "--max-tokens", "24", "--json"
    )
    assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr + as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["prompt_tokens"] == REFERENCE["d"]["prompt_ids"]
    plain = decode(
        load_model(default_model_path()), out["prompt_tokens"], SamplingParams(max_tokens=24), NoDraftSource()
    )
    assert out["tokens"] == plain.tokens
    assert streamed.stdout == out["text"] + "\n"


def test_seeded_sampling_is_reproducible_from_the_cli():
    args = (
        "generate",
        "Once upon a time",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--max-tokens",
        "16",
        "--json",
    )
    first, second = (json.loads(speclanes(*args).stdout) for _ in range(2))
    assert first["tokens"] == second["tokens"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--temperature", "-1", "hi"), "temperature"),
        (("--top-p", "2", "hi"), "top_p"),
        (("--messages", "/nonexistent.json"), "cannot read messages"),
        (("x " * 9000,), "context"),
        (("",), "empty"),
        (("--backend", "gpu", "hi"), "unknown backend"),
        (("--backend", "torch:int3", "hi"), "no weight format"),
    ],
)
def test_bad_input_gets_one_clear_line(args, message):
    result = speclanes("generate", *args)
    assert result.returncode == 2
    assert result.stderr.startswith("speclanes: error:") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_speculative_flags_and_stats():
    case = REFERENCE["b"]
    result = speclanes(
        "generate",
        case["text"],
        "--max-tokens",
        "40",
        "--ignore-eos",
        "--drafter",
        "auto",
        "--k",
        "auto",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    plain = speclanes("generate", case["text"], "--max-tokens=40", "--ignore-eos", "--json", "--drafter=none")
    assert out["tokens"] == json.loads(plain.stdout)["tokens"]  # the default backend, without speculation
    assert {"steps", "drafted", "accepted", "acceptance_rate", "mean_accepted_length"} <= set(out["stats"])
    numpy_run = speclanes(
        "generate", case["text"], "--max-tokens", "40", "--ignore-eos", "--drafter", "auto", "--json",
        "--backend", "numpy",
    )  # fmt: skip
    assert json.loads(numpy_run.stdout)["tokens"] == case["greedy_ids"]  # the reference against HF


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--k", "33"), "--k"),
        (("--k", "many"), "--k"),
        (("--drafter", "model"), "--draft-model"),
        (("--max-iterations", "0"), "max-iterations"),
    ],
)
def test_bad_speculation_flags(args, message):
    result = speclanes("generate", "hi", *args)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.parametrize("command", ["status", "stop", "stream"])
def test_with_nothing_running_status_stop_and_stream_say_so_at_once(tmp_path, command):
    import time

    args = [command, "--set", f"run.dir={tmp_path / 'run'}"] + (["Hi"] if command == "stream" else [])
    started = time.monotonic()
    out = speclanes(*args, timeout=30)
    assert out.returncode == 2 and "no pipeline is running in" in out.stderr, out.stderr
    assert time.monotonic() - started < 2

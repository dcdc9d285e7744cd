"""Model files that cannot be served give one clear line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from pipeline.model import Model, ModelFileError

from .tinymodel import TinySpec, random_weights


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        Model.load(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        Model.load(path)


def test_truncated_gguf(tiny_model_file):
    path, _ = tiny_model_file()
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ModelFileError):
        Model.load(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="unsupported architecture 'mamba'"):
        Model.load(path)


def test_missing_tensor(tiny_model_file):
    spec = TinySpec(seed=11)
    weights = random_weights(spec)
    del weights["blk.1.ffn_up.weight"]
    path, _ = tiny_model_file(TinySpec(seed=11, weights=weights))
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.1\.ffn_up\.weight' is missing"):
        Model.load(path)


def test_wrong_tensor_shape(tiny_model_file):
    spec = TinySpec(seed=12)
    weights = random_weights(spec)
    weights["blk.0.attn_v.weight"] = weights["blk.0.attn_v.weight"][:, :32]
    path, _ = tiny_model_file(TinySpec(seed=12, weights=weights))
    with pytest.raises(ModelFileError, match=r"attn_v\.weight' has shape"):
        Model.load(path)


def test_cli_prints_one_clear_line(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 64)
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "generate", "--model", str(path), "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speclanes: error:") and "GGUF" in lines[0]

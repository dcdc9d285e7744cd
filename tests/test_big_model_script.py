"""`ops/bench/big_model.py` on tiny shapes: the file its writer makes loads with this project's own
GGUF reader and runtime, with the requested shapes and the source's tokenizer, the same bytes on
every run; and its tensor plan names and shapes tensors as the default model's file does.
(The 1.7B run and llama-quantize are not exercised here.)

The tokenizer source is a tiny GGUF (tests/tinymodel.py, a few hundred tokens), not the default
model: parsing the default model's 49,152-token metadata costs over a second per read."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from pipeline.model import default_model_path, load_model
from pipeline.model.gguf_file import read_config, read_tokenizer_metadata

from .tinymodel import TinySpec, write_tiny_gguf

SCRIPT = Path(__file__).resolve().parents[1] / "ops" / "bench" / "big_model.py"


def _script():
    spec = importlib.util.spec_from_file_location("big_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up while the class is built
    spec.loader.exec_module(module)
    return module


big_model = _script()


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.gguf"
    write_tiny_gguf(path, TinySpec())
    return path


def _tiny(source: Path, **changes: int):
    vocab = len(gguf.GGUFReader(source).fields["tokenizer.ggml.tokens"].data)
    shapes = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128, vocab=vocab, context=256)
    return dataclasses.replace(big_model.SMOLLM2_1_7B, **(shapes | changes))


def test_the_written_file_loads_with_the_requested_shapes_and_the_source_tokenizer(
    tmp_path: Path, source: Path
) -> None:
    path = tmp_path / "random.gguf"
    shapes = _tiny(source)
    big_model.write_random_model(path, shapes, source)
    reader = gguf.GGUFReader(path)
    cfg = read_config(reader)
    assert (cfg.architecture, cfg.n_layers, cfg.d_model, cfg.d_ff) == ("llama", 2, 64, 128)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 4, 16, shapes.vocab)
    assert (cfg.context_length, cfg.rope_theta, cfg.tied_embeddings) == (256, 130000.0, True)
    assert cfg.rms_eps == pytest.approx(1e-5)
    source_reader = gguf.GGUFReader(source)
    assert read_tokenizer_metadata(reader) == read_tokenizer_metadata(source_reader)
    assert {k for k in source_reader.fields if k.startswith("tokenizer.")} <= set(reader.fields)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.1.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.1.ffn_down.weight"] == gguf.GGMLQuantizationType.F16
    assert "output.weight" not in types

    model = load_model(path, backend="numpy")
    assert (model.cfg.n_layers, model.cfg.d_model) == (2, 64)
    assert model.tokenizer is not None
    logits = model.forward(model.new_cache(capacity=16), model.tokenizer.encode("the cat"))
    assert np.all(np.isfinite(logits))


def test_the_file_is_reproducible(tmp_path: Path, source: Path) -> None:
    digests = []
    for name in ("a.gguf", "b.gguf"):
        big_model.write_random_model(tmp_path / name, _tiny(source, n_layers=1), source)
        digests.append(hashlib.sha256((tmp_path / name).read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_a_vocabulary_other_than_the_tokenizers_is_refused(tmp_path: Path, source: Path) -> None:
    with pytest.raises(ValueError, match="vocab"):
        big_model.write_random_model(tmp_path / "x.gguf", _tiny(source, vocab=1000), source)


def test_the_plan_names_and_shapes_tensors_as_the_default_model_does() -> None:
    reader = gguf.GGUFReader(default_model_path())
    cfg = read_config(reader)
    shapes = dataclasses.replace(
        big_model.SMOLLM2_1_7B,
        d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        d_ff=cfg.d_ff, vocab=cfg.vocab_size,
    )  # fmt: skip
    actual = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors]
    plan = big_model.tensor_plan(shapes)
    assert len(plan) == len(actual) and dict(plan) == dict(actual)  # the file sorts blk.10 before blk.2
    block = [name for name, _ in actual if name.startswith("blk.0.")]
    assert [name for name, _ in plan if name.startswith("blk.0.")] == block
    assert big_model.SMOLLM2_1_7B.vocab == len(reader.fields["tokenizer.ggml.tokens"].data)

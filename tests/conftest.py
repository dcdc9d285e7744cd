"""Shared fixtures: a private weight cache, tiny GGUF models, and the real default model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import pipeline  # noqa: F401  (sets the OpenBLAS environment before numpy loads)

from .pipeline_harness import Pipeline, running_pipeline
from .tinymodel import TinySpec, write_tiny_gguf

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session", autouse=True)
def weight_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tests prepare weights into their own cache unless SPECLANES_CACHE says otherwise."""
    if not os.environ.get("SPECLANES_CACHE"):
        os.environ["SPECLANES_CACHE"] = str(tmp_path_factory.mktemp("speclanes-cache"))
    return Path(os.environ["SPECLANES_CACHE"])


@pytest.fixture
def tiny_model_file(tmp_path: Path):
    """Write a tiny GGUF for a spec; returns (path, reference weights)."""

    def make(spec: TinySpec | None = None, name: str = "tiny.gguf"):
        spec = spec or TinySpec()
        path = tmp_path / name
        return path, write_tiny_gguf(path, spec)

    return make


@pytest.fixture(scope="session")
def smollm2():
    """The default model on the numpy float32 reference backend (the oracle)."""
    from pipeline.model import Model, default_model_path

    return Model.load(default_model_path())


@pytest.fixture(scope="session")
def served_model():
    """The default model on the backend a pipeline serves it with by default (`model.backend=auto`)."""
    from pipeline.model import default_model_path, load_model

    return load_model(default_model_path())


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from pipeline.model import Model

    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    return Model.load(path).tokenizer


@pytest.fixture(scope="session")
def portable_kernels(tmp_path_factory: pytest.TempPathFactory):
    """The native kernels built for a plain x86-64-v2 CPU (no AVX2, no AVX-512, no VNNI): the
    portable C path, which must give the same bits as this machine's build."""
    import platform

    from pipeline.model import native
    from pipeline.model.backends import backend_problem

    if platform.machine() != "x86_64" or backend_problem("native"):
        pytest.skip("the portable build is tested on x86-64 with a C compiler")
    target = tmp_path_factory.mktemp("portable") / "portable.so"
    native._build(target, (*(f for f in native.FLAGS if f != "-march=native"), "-march=x86-64-v2"))
    lib = native.load_library(target)
    assert lib.has_vnni() == 0
    return lib


@pytest.fixture(scope="session")
def gateway_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """One real pipeline with the default model behind its HTTP gateway, shared by every module that
    talks to it as a client would (test_gateway.py, test_tools_gateway.py): each start costs seconds."""
    # A long client_idle: a request freed sooner was cancelled by the gateway, not by the orchestrator.
    settings = ["restart.initial_backoff=0.1", "timeouts.draft=5.0", "timeouts.client_idle=60"]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # spans reach the trace files within a moment
    with running_pipeline(tmp_path_factory.mktemp("gateway"), settings, env) as p:
        yield p


@pytest.fixture(scope="session")
def gateway_client(gateway_pipeline: Pipeline) -> openai.OpenAI:
    # No retries: a status must reach the test as the gateway sent it.
    url = f"{gateway_pipeline.gateway_url}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)

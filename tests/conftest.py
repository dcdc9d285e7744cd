"""Shared fixtures: a private weight cache, tiny GGUF models, and the real default model.

Under pytest-xdist the workers share one run's weight cache, and what is costly to make in it (the
default model's float32 reference, its native form, each runtime's t(rows) curve) is made by the
first worker that asks while the other waits on a lock (`made_once`), then read back in
milliseconds: the store's forms are keyed by content and published atomically, so sharing them is
what two lanes on one machine do anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import pipeline  # noqa: F401  (sets the OpenBLAS environment before numpy loads)

from . import USER_OMP_THREADS, USER_OPENBLAS_THREADS
from .pipeline_harness import Pipeline, running_pipeline
from .tinymodel import TinySpec, write_tiny_gguf

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_configure(config: pytest.Config) -> None:
    """One OpenBLAS and one OpenMP thread per pytest-xdist worker when the workers fill the cores,
    set here in the controller before it starts them (they inherit its environment, and load numpy,
    the native kernels and torch later). A user's own setting wins; the lanes that tests start
    inherit it too.

    Both kinds of thread spin while they wait for each other, and with two workers on two cores the
    one waited for is often descheduled:
    - OpenBLAS: with two workers' numpy oracles at two threads each on the 2-core VM, a 24-token
      greedy decode took 22 s, and 2 s at one thread each.
    - OpenMP (the native kernels, torch): the whole suite took 637 s at two threads (1,050 s of user
      CPU) and 421 s at one (651 s) on the 2-core AMD VM.

    Neither changes a bit: OpenBLAS splits a product's outputs between its threads, never a sum, and
    so do the native kernels (`test_row_invariance.test_the_thread_count_changes_no_bit` runs them
    at 1, 2 and 3 threads)."""
    workers = config.getoption("numprocesses", None)
    if not (isinstance(workers, int) and workers > 1):
        return
    share = str(max(1, (os.cpu_count() or 1) // workers))
    if USER_OPENBLAS_THREADS is None:
        os.environ["OPENBLAS_NUM_THREADS"] = share
    if USER_OMP_THREADS is None:
        os.environ["OMP_NUM_THREADS"] = share


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temp root, the one all xdist workers share (their own roots are inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def made_once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[None]:
    """Hold this run's lock `name` (across xdist workers): whoever makes a shared artifact under it
    makes it alone, and whoever comes next finds it made."""
    with (run_root(tmp_path_factory) / f"{name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session", autouse=True)
def weight_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tests prepare weights into this run's own cache, shared by its xdist workers, unless
    SPECLANES_CACHE says otherwise."""
    if not os.environ.get("SPECLANES_CACHE"):
        cache = run_root(tmp_path_factory) / "speclanes-cache"
        cache.mkdir(mode=0o700, exist_ok=True)
        os.environ["SPECLANES_CACHE"] = str(cache)
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
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    """The default model on the numpy float32 reference backend (the oracle), with its t(rows) curve
    measured (for `decode`'s controller) once per run."""
    from pipeline.model import Model, default_model_path
    from pipeline.model.calibration import stored_row_seconds

    with made_once(tmp_path_factory, "smollm2-numpy"):
        model = Model.load(default_model_path())
        stored_row_seconds(model, default_model_path())
    return model


@pytest.fixture(scope="session")
def gemma3_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Gemma 3 270M Q4_K_M file (ops/setup.sh installs its packages), assembled once per run
    into the private weight cache; the test is skipped, saying why, where the packages are absent."""
    from pipeline.model.default import gemma3_path
    from pipeline.model.errors import ModelFileError

    with made_once(tmp_path_factory, "gemma3-file"):
        try:
            return gemma3_path()
        except ModelFileError as exc:
            pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma3_served(tmp_path_factory: pytest.TempPathFactory, gemma3_file: Path):
    """Gemma 3 270M on the backend `load_model` picks (the one users run), loaded once per run; its
    prepared forms are made by one xdist worker while the others wait."""
    from pipeline.model import load_model

    with made_once(tmp_path_factory, "gemma3-served"):
        return load_model(gemma3_file)


@pytest.fixture(scope="session")
def served_model(tmp_path_factory: pytest.TempPathFactory):
    """The default model on the backend a pipeline serves it with by default (`model.backend=auto`),
    with its t(rows) curve measured once per run (the verify lanes of tests' pipelines read it too)."""
    from pipeline.model import default_model_path, load_model
    from pipeline.model.calibration import stored_row_seconds

    with made_once(tmp_path_factory, "smollm2-served"):
        model = load_model(default_model_path())
        stored_row_seconds(model, default_model_path())
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from pipeline.model import Model

    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec())
    return Model.load(path).tokenizer


@pytest.fixture(scope="session")
def native_lib():
    """This machine's build of the native kernels (skipped where it cannot be built)."""
    from pipeline.model import native
    from pipeline.model.errors import BackendUnavailable

    try:
        return native.row_kernels()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def portable_kernels(tmp_path_factory: pytest.TempPathFactory):
    """The native kernels built for a plain x86-64-v2 CPU (no AVX2, no AVX-512, no VNNI): the
    portable C path, which must give the same bits as this machine's build."""
    import platform

    from pipeline.model import native
    from pipeline.model.backends import backend_problem

    if platform.machine() != "x86_64" or backend_problem("native"):
        pytest.skip("the portable build is tested on x86-64 with a C compiler")
    target = run_root(tmp_path_factory) / "portable" / "portable.so"
    with made_once(tmp_path_factory, "portable-kernels"):  # built once a run, for every xdist worker
        if not target.exists():  # `_build` publishes it whole (os.replace)
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

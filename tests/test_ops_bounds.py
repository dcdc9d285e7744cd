"""The measuring scripts behind the bounds the docs quote (`ops/bench/tree_bound.py`, `coupling.py`,
`per_step_bound.py`, `helper_core.py`): their arithmetic, so a figure they print cannot come from a
wrong count, the patch `per_step_bound.py` applies and the pinning `helper_core.py` does, so each
still measures what it says."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.decoding.drafters import Proposal
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.drafters.suffix import SuffixSource
from pipeline.decoding.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "ops" / "bench"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tree_bound, coupling = script("tree_bound"), script("coupling")


def test_a_tree_keeps_its_best_path_and_a_chain_its_prefix():
    # root children 5 and 7; 7 -> 8 -> 9, 5 -> 6
    tree = Proposal([5, 7, 6, 8, 9], None, "t", parents=[-1, -1, 0, 1, 3])
    assert tree_bound.kept(tree, [7, 8, 9, 1]) == 3
    assert tree_bound.kept(tree, [5, 6, 9]) == 2
    assert tree_bound.kept(tree, [4]) == 0
    assert tree_bound.kept(Proposal([1, 2, 3]), [1, 2, 4]) == 2


def test_any_pair_counts_tokens_whose_pair_with_the_previous_one_was_seen():
    context = [1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 2, 3]
    assert tree_bound.any_pair(context, [4, 5, 6, 7]) == 3  # 3 4, 4 5, 5 6 occur; 6 7 does not
    assert tree_bound.any_pair(context, [9, 9, 2, 3, 4]) == 5  # pairs from two occurrences, spliced
    assert tree_bound.any_pair(context, [8]) == 0


def test_any_pair_holds_every_path_of_the_drafters_trees():
    """The bound is above what the n-gram and suffix drafters' trees can hold, on a context with
    repeats."""
    context = [1, 2, 3, 4, 1, 2, 5, 6, 2, 3, 4, 7, 1, 2, 3]
    truth = [4, 1, 2, 5, 6, 2]
    for source in (NgramSource(), SuffixSource()):
        drafter = source.start(context, SamplingParams(), 0)
        drafter.accept(context)
        proposal = drafter.propose(context, 32, True)
        assert 0 < tree_bound.kept(proposal, truth) <= tree_bound.any_pair(context, truth)


def test_a_walk_verifies_exactly_what_it_keeps():
    steps, rows = tree_bound.walk([0, 0], [1, 2, 3, 4, 5], lambda context, truth: len(truth), depth=2)
    assert (steps, rows) == (2, [3, 2])  # 1 from the prefill, then 2 + bonus, then 1 + bonus


def distributions(size: int):
    weights = st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=size, max_size=size)
    return weights.filter(lambda w: sum(w) > 1e-3).map(lambda w: np.array(w) / sum(w))


@given(st.integers(2, 12).flatmap(lambda n: st.tuples(distributions(n), distributions(n))))
def test_shared_u_couples_no_better_than_the_rule(pair):
    """No coupling agrees more often than the maximal one, whose agreement is sum(min(p, q))."""
    p, q = pair
    assert coupling.coupled_acceptance(p, q) <= coupling.rule_acceptance(p, q) + 1e-9
    assert abs(coupling.coupled_acceptance(p, p) - 1.0) < 1e-9


def test_shared_u_agreement_counts_interval_overlaps():
    p, q = np.array([0.5, 0.5, 0.0]), np.array([0.25, 0.5, 0.25])
    # u in [0, 0.25) picks 0 from both, [0.5, 0.75) picks 1 from both: half the time
    assert coupling.coupled_acceptance(p, q) == 0.5
    assert coupling.rule_acceptance(p, q) == 0.75


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout"
)
def test_the_per_step_bound_patch_applies_and_switches_only_the_record_keeping():
    """`per_step_bound.py` applies its patch to HEAD: one that no longer applies would stop the script,
    and one that switched more than the record keeping would bound something else."""
    patch = BENCH / "per_step_bound.patch"
    check = subprocess.run(
        ["git", "-C", str(ROOT), "apply", "--check", str(patch)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    text = patch.read_text()
    files = sorted(line.split(" b/")[-1] for line in text.splitlines() if line.startswith("diff --git"))
    assert files == [
        "pipeline/lean_mode.py", "pipeline/orchestration/hub.py", "pipeline/workers/driver.py",
        "pipeline/workers/verifier.py",
    ]  # fmt: skip
    switched = [line for line in text.splitlines() if line.startswith("+ ") and "lean()" in line]
    # the orchestrator's audit event, journal row and metrics; the verify lane's audit event and span entry
    assert len(switched) == 5


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move threads between")
def test_helper_core_pins_every_thread_of_a_process():
    """`helper_core.py` moves whole processes between CPUs: a thread left behind (nng's, a pool's)
    would still take the forward's CPU in the `spare` layout."""
    pin = script("helper_core").pin
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        tasks = Path(f"/proc/{child.pid}/task")
        while len(list(tasks.iterdir())) < 2:
            time.sleep(0.01)
        first, *_ = cpus = sorted(os.sched_getaffinity(0))
        pin([child.pid], {first})
        assert [os.sched_getaffinity(int(t.name)) for t in tasks.iterdir()] == [{first}, {first}]
        pin([child.pid], set(cpus))
        assert all(os.sched_getaffinity(int(t.name)) == set(cpus) for t in tasks.iterdir())
    finally:
        child.kill()
        child.wait()

"""The drafter table (`drafters/kinds.py`) and its factories (`drafters/registry.py`). They cover
the same names. Every name builds a source. The queries answer what each kind declares. No module
compares a drafter's name with "model" instead of asking the table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline.decoding.drafters import kinds, registry
from pipeline.decoding.drafters.composite import CompositeSource
from pipeline.decoding.drafters.kinds import (
    DRAFTERS,
    KINDS,
    DrafterKind,
    kind,
    needs_draft_model,
    needs_features,
    needs_head,
    parts,
    reads_features,
    samples,
)
from pipeline.decoding.drafters.registry import (
    FACTORIES,
    make_draft_source,
    make_draft_sources,
    split_by_lane,
)
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculation import Speculation, SpeculationError
from pipeline.model import Model
from pipeline.model.draft_head import DraftHead

from .tinyhead import tiny_head
from .tinymodel import TinySpec, write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
# What today's kinds declare: (samples, needs_features, needs_draft_model). A kind added later
# declares its own values, and `test_the_queries_answer_what_each_kind_declares` checks them.
TODAY = {
    "none": (False, False, False),
    "ngram": (False, False, False),
    "suffix": (False, False, False),
    "learned": (False, True, False),
    "model": (True, False, True),
    "auto": (False, False, False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Model, Model, DraftHead]:
    """A tiny target, a draft model with the same vocabulary and a draft head trained for the target."""
    root = tmp_path_factory.mktemp("registry")
    write_tiny_gguf(root / "target.gguf", TinySpec(seed=21, scale=1.2))
    write_tiny_gguf(root / "draft.gguf", TinySpec(seed=21, scale=0.8))
    target = Model.load(root / "target.gguf")
    return target, Model.load(root / "draft.gguf"), tiny_head(target, root / "target.gguf", root)


# --- the table and its factories --------------------------------------------------------------


def test_the_factories_cover_the_table_names():
    composites = {name for name, declared in KINDS.items() if declared.members}
    assert set(FACTORIES) == set(KINDS) - composites
    assert tuple(KINDS) == DRAFTERS and registry.DRAFTERS is DRAFTERS
    assert all(name == declared.name for name, declared in KINDS.items())
    for name in composites:
        members = KINDS[name].members
        assert members and all(m in FACTORIES for m in members), f"{name}: {members}"


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_name_builds_a_source_that_drafts(models, name):
    target, draft, head = models
    source = make_draft_source(name, target, draft, head)
    assert source.name == name
    prompt = [40, 41, 42, 43] * 3
    drafter = source.start(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=8), 3)
    proposal = drafter.propose([*prompt, 40], 4)
    assert len(proposal.tokens) <= 4
    assert (proposal.probs is not None) == (samples(proposal.drafter) and bool(proposal.tokens))


@pytest.mark.parametrize("name", [n for n in DRAFTERS if needs_draft_model(n)])
def test_a_kind_that_needs_a_draft_model_refuses_to_build_without_one(models, name):
    with pytest.raises(ValueError, match=f"--drafter {name} needs --draft-model PATH"):
        make_draft_source(name, models[0])


@pytest.mark.parametrize("name", [n for n in DRAFTERS if needs_head(n)])
def test_a_kind_that_needs_a_head_refuses_to_build_without_one(models, name):
    with pytest.raises(ValueError, match=f"--drafter {name} needs a draft head trained for this model"):
        make_draft_source(name, models[0])


def test_auto_chains_the_free_drafters_then_the_head_and_the_model_when_given(models):
    target, draft, head = models
    without = make_draft_source("auto", target)
    assert isinstance(without, CompositeSource)
    assert [s.name for s in without.sources] == ["ngram", "suffix"]
    with_model = make_draft_source("auto", target, draft)
    assert isinstance(with_model, CompositeSource)
    assert [s.name for s in with_model.sources] == ["ngram", "suffix", "model"]
    assert parts("auto", draft_model=False) == ("ngram", "suffix")
    assert parts("auto", draft_model=True) == ("ngram", "suffix", "model")
    assert parts("model", draft_model=False) == ("model",)
    with_head = make_draft_source("auto", target, None, head)  # then the head, which reads features
    assert isinstance(with_head, CompositeSource) and with_head.needs_features
    assert [s.name for s in with_head.sources] == ["ngram", "suffix", "learned"]
    assert parts("auto", draft_model=True, head=True) == ("ngram", "suffix", "learned", "model")


def test_a_lane_serves_every_drafter_it_can_and_shares_their_parts(models):
    target, draft, head = models
    assert list(make_draft_sources(target)) == ["none", "ngram", "suffix", "auto"]
    assert list(make_draft_sources(target, draft)) == ["none", "ngram", "suffix", "model", "auto"]
    assert list(make_draft_sources(target, None, head)) == ["none", "ngram", "suffix", "learned", "auto"]
    sources = make_draft_sources(target, draft, head)
    assert list(sources) == list(DRAFTERS)
    auto = sources["auto"]
    assert isinstance(auto, CompositeSource)
    # One cross-request suffix table, one draft model source: the same objects as the named ones.
    assert [id(s) for s in auto.sources] == [id(sources[n]) for n in ("ngram", "suffix", "learned", "model")]
    # A single request's source shares nothing with another's.
    one, two = make_draft_source("auto", target), make_draft_source("auto", target)
    assert isinstance(one, CompositeSource) and isinstance(two, CompositeSource)
    assert one.sources[1] is not two.sources[1]


def test_a_lane_serves_a_drafter_that_reads_the_target_features(models, monkeypatch):
    """The verify lane computes the target's features and the orchestrator passes them on with each
    draft request, so a lane serves a kind that reads them; the orchestrator asks for them for a
    request whose drafter, or one of whose parts, reads them."""
    target = models[0]
    monkeypatch.setitem(kinds.KINDS, "featured", DrafterKind("featured", needs_features=True))
    monkeypatch.setitem(registry.FACTORIES, "featured", registry.FACTORIES["ngram"])
    assert needs_features("featured") and reads_features("featured", draft_model=False, head=False)
    assert "featured" in make_draft_sources(target)
    assert make_draft_source("featured", target).name == "ngram"
    monkeypatch.setitem(kinds.KINDS, "mix", DrafterKind("mix", members=("ngram", "featured")))
    assert reads_features("mix", draft_model=False, head=False)
    assert reads_features("auto", draft_model=True, head=True)  # its head does
    assert not reads_features("auto", draft_model=True, head=False)
    plain = ("none", "ngram", "suffix", "model")
    assert not any(reads_features(n, draft_model=True, head=True) for n in plain)


# --- the queries ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DRAFTERS)
def test_the_queries_answer_what_each_kind_declares(name):
    declared = kind(name)
    assert samples(name) == declared.samples
    assert needs_features(name) == declared.needs_features
    assert needs_draft_model(name) == declared.needs_draft_model


@pytest.mark.parametrize("name", sorted(TODAY))
def test_todays_kinds_keep_their_declarations(name):
    assert (samples(name), needs_features(name), needs_draft_model(name)) == TODAY[name]


@pytest.mark.parametrize("label", ["grammar", "", "self-model", "MODEL"])
def test_a_label_that_no_kind_declares_declares_nothing(label):
    """A step's label can be one that no kind declares (the grammar drafter's, a plain step's "")."""
    assert not samples(label) and not needs_features(label) and not needs_draft_model(label)


def test_an_unknown_name_lists_the_choices(models):
    for call in (lambda: kind("magic"), lambda: make_draft_source("magic", models[0])):
        with pytest.raises(ValueError, match="unknown drafter 'magic'") as caught:
            call()
        assert f"(choose from {', '.join(DRAFTERS)})" in str(caught.value)
    with pytest.raises(SpeculationError, match="choose from") as refused:
        Speculation(drafter="magic")
    assert all(name in str(refused.value) for name in DRAFTERS)
    with pytest.raises(ValueError, match="choose from"):
        parts("magic", draft_model=True)


# --- no name comparisons ----------------------------------------------------------------------


def _is_model(node: ast.AST) -> bool:
    """The literal "model", or a tuple, list or set literal that holds it."""
    if isinstance(node, ast.Constant):
        return node.value == "model"
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_is_model(e) for e in node.elts)


def test_no_module_compares_a_name_with_model():
    """Whether a drafter samples, or needs a draft model, is asked of `drafters.kinds`. A comparison
    with "model" in one place would be missed when a new kind declares the same thing."""
    found = []
    for path in sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "lanes").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                compared = [node.left, *node.comparators]
            elif isinstance(node, ast.MatchValue):
                compared = [node.value]
            else:
                continue
            if any(_is_model(n) for n in compared):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


@pytest.mark.parametrize("draft_model", [False, True], ids=["no-draft-model", "draft-model"])
def test_drafters_that_run_no_draft_model_draft_in_the_verify_lane_unless_told_otherwise(draft_model):
    here, there = split_by_lane(draft_model=draft_model, in_verify_lane=True)
    assert set(here) | set(there) == set(DRAFTERS) and not set(here) & set(there)
    assert "model" in there and {"none", "ngram", "suffix", "learned"} <= set(here)
    assert ("auto" in there) == draft_model  # with a draft model among its members, it drafts there
    assert split_by_lane(draft_model=draft_model, in_verify_lane=False) == ([], list(DRAFTERS))

"""How each drafter kind (`kinds.py`) is built: one factory per name, from the same table.

A factory reads `Inputs`: the target, which is a Runtime, or a Front where only its vocabulary
is read, and the optional draft model. A drafter that needs more (its own weights, say) adds a
field to `Inputs`, and the other factories stay as they are. A composite kind has no factory. It
is built from its members' sources. Both entry points build through `_build`, so there is only
one map from names to sources. `make_draft_source` builds one source for a request;
`make_draft_sources` builds every source that a long-lived lane serves. Within one call,
each name is built at most once. So the sources that a lane serves share their parts. For
example, `auto`'s suffix source is the lane's `suffix` source, so all requests update one
cross-request table.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from pipeline.decoding.drafters import DraftSource, NoDraftSource
from pipeline.decoding.drafters.composite import CompositeSource
from pipeline.decoding.drafters.kinds import DRAFTERS, KINDS, drafts_with_model, kind, parts
from pipeline.decoding.drafters.learned import LearnedSource
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.drafters.suffix import SuffixSource
from pipeline.model import Runtime
from pipeline.model.draft_head import DraftHead
from pipeline.model.store import Front

__all__ = ["DRAFTERS", "FACTORIES", "Inputs", "make_draft_source", "make_draft_sources", "split_by_lane"]


@dataclass(frozen=True)
class Inputs:
    target: Runtime | Front
    draft_model: Runtime | None = None
    draft_head: DraftHead | None = None


Factory = Callable[[Inputs], DraftSource]


def _model(inputs: Inputs) -> DraftSource:
    assert inputs.draft_model is not None  # `_build` refuses a kind that needs one without it
    return ModelSource(inputs.draft_model, inputs.target)


def _learned(inputs: Inputs) -> DraftSource:
    assert inputs.draft_head is not None  # `_build` refuses a kind that needs one without it
    return LearnedSource(inputs.draft_head)


# Every kind in `kinds.KINDS` that is not a composite, and no other name.
FACTORIES: dict[str, Factory] = {
    "none": lambda inputs: NoDraftSource(),
    "ngram": lambda inputs: NgramSource(),
    "suffix": lambda inputs: SuffixSource(),
    "learned": _learned,
    "model": _model,
}


def _build(name: str, inputs: Inputs, built: dict[str, DraftSource]) -> DraftSource:
    """`name`'s source, taken from `built` when this call has already made it."""
    if name in built:
        return built[name]
    declared = kind(name)  # an unknown name: a ValueError that lists the choices
    if declared.needs_draft_model and inputs.draft_model is None:
        raise ValueError(f"--drafter {name} needs --draft-model PATH")
    if declared.needs_head and inputs.draft_head is None:
        raise ValueError(
            f"--drafter {name} needs a draft head trained for this model: run `speclanes drafter train`, "
            "or name one with --draft-head PATH"
        )
    if declared.members:
        members = parts(name, draft_model=inputs.draft_model is not None, head=inputs.draft_head is not None)
        source: DraftSource = CompositeSource([_build(m, inputs, built) for m in members], name)
    else:
        source = FACTORIES[name](inputs)
    built[name] = source
    return source


def make_draft_source(
    name: str, target: Runtime | Front, draft_model: Runtime | None = None,
    draft_head: DraftHead | None = None,
) -> DraftSource:  # fmt: skip
    """A request's source. `auto` tries the n-gram drafter, then the cross-request suffix cache, then
    the draft model when there is one."""
    return _build(name, Inputs(target, draft_model, draft_head), {})


def make_draft_sources(
    target: Runtime | Front, draft_model: Runtime | None = None, draft_head: DraftHead | None = None,
    only: Collection[str] | None = None,
) -> dict[str, DraftSource]:  # fmt: skip
    """Every drafter a long-lived lane serves (those of `only`, if given), in table order. The sources
    share their parts, so there is one suffix table. A lane leaves out a kind that needs a draft model
    or a head when it has none (`auto` then drafts without it). A kind that reads the target's
    features is served: the verify lane computes them for the requests whose drafter reads them."""
    inputs = Inputs(target, draft_model, draft_head)
    built: dict[str, DraftSource] = {}
    return {
        name: _build(name, inputs, built)
        for name, declared in KINDS.items()
        if (only is None or name in only)
        and (draft_model is not None or not declared.needs_draft_model)
        and (draft_head is not None or not declared.needs_head)
    }


def split_by_lane(*, draft_model: bool, in_verify_lane: bool) -> tuple[list[str], list[str]]:
    """(the drafters the verify lane answers itself, those the draft lane serves). With
    `run.draft_in_verify_lane`, every drafter that runs no draft model drafts beside the target: its
    proposal is ready the moment a forward ends, with no round trip and no second process taking
    the forward's cores (docs/design.md, "Where drafts are made"). `draft_model`: one is configured."""
    here = [n for n in DRAFTERS if in_verify_lane and not drafts_with_model(n, draft_model=draft_model)]
    return here, [n for n in DRAFTERS if n not in here]

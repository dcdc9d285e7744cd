"""Drafter names as the CLI and configuration spell them."""

from __future__ import annotations

from pipeline.decoding.drafters import DraftSource, NoDraftSource
from pipeline.decoding.drafters.composite import CompositeSource
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.drafters.suffix import SuffixSource
from pipeline.model import Runtime
from pipeline.model.store import Front

DRAFTERS = ("none", "ngram", "suffix", "model", "auto")


def make_draft_source(name: str, target: Runtime, draft_model: Runtime | None = None) -> DraftSource:
    """`auto` chains the free drafters (n-gram, then the cross-request cache), then the model if given."""
    if name == "none":
        return NoDraftSource()
    if name == "ngram":
        return NgramSource()
    if name == "suffix":
        return SuffixSource()
    if name == "model":
        if draft_model is None:
            raise ValueError("--drafter model needs --draft-model PATH")
        return ModelSource(draft_model, target)
    if name == "auto":
        sources: list[DraftSource] = [NgramSource(), SuffixSource()]
        if draft_model is not None:
            sources.append(ModelSource(draft_model, target))
        return CompositeSource(sources)
    raise ValueError(f"unknown drafter {name!r} (choose from {', '.join(DRAFTERS)})")


def make_draft_sources(target: Runtime | Front, draft_model: Runtime | None = None) -> dict[str, DraftSource]:
    """Every drafter a long-lived draft lane serves, sharing one cross-request suffix table. Of the
    target only its vocabulary is read (a draft model must share it): its front will do."""
    suffix = SuffixSource()
    free: list[DraftSource] = [NgramSource(), suffix]
    model = [ModelSource(draft_model, target)] if draft_model is not None else []
    sources: dict[str, DraftSource] = {
        "none": NoDraftSource(),
        "ngram": free[0],
        "suffix": suffix,
        "auto": CompositeSource([*free, *model]),
    }
    if model:
        sources["model"] = model[0]
    return sources

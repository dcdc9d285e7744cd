"""What each drafter is: the one table of drafter kinds, as declarations.

Code that depends on a drafter's nature asks this table instead of comparing its name with a
string. The session asks a sampling drafter for the chain that pays (`Controller.budget`); the
orchestrator and the audit read which steps carry the draft rows p(x) that the acceptance rule
used (`samples`); admission refuses a drafter whose draft model or head is not configured
(`needs_draft_model`, `needs_head`); the orchestrator asks the verify lane for the target's features
for a request whose drafter reads them (`reads_features`), which that lane hands to the drafter.

How each kind is built lives in `registry.py`, keyed by the same names. This module is kept apart
and imports nothing, so the session, the cost model and the audit can read it without loading
drafter code or model runtimes (a drafter that needs features may import the decoding loop,
which imports the session). A new drafter is a file in this package, one `DrafterKind` line here
and its factory line in `registry.py`; `tests/test_drafter_registry.py` checks that both cover
the same names.

The queries (`samples`, `needs_features`, `needs_draft_model`) accept any label, not only a
kind's name: a step's drafter label can be one that no kind declares (the grammar drafter's
"grammar", "" for a plain step), and such a label declares nothing. `kind` is the strict lookup.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterKind:
    name: str
    # Draws its drafts from rows p and sends them along, so the rule keeps a draft with probability
    # min(1, q/p) and the audit recomputes p. The others are deterministic: p(x) = 1.
    samples: bool = False
    needs_features: bool = False  # reads the target's hidden states: it runs next to the target
    needs_draft_model: bool = False  # drafts with a smaller model (`model.draft_path`, `--draft-model`)
    needs_head: bool = False  # drafts with a trained head (`model.draft_head`; `drafter train`)
    # Each draft costs the drafter a forward (a draft model's, a head's): the controller asks it for
    # the chain length that pays (`Controller.budget`), and times its drafts per token.
    paid_per_draft: bool = False
    # A composite: these kinds tried in order, cheapest first. A member that needs a draft model is
    # left out when none is given. A composite's own label marks only its merged trees, which come
    # from its deterministic members; a member's chain keeps that member's label.
    members: tuple[str, ...] = ()
    # In a composite's tree, its candidates merge with the other members' into one tree; if not, it is
    # asked for a proposal of its own (a tree, when trees are asked for) only when those have none.
    merged: bool = True


KINDS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind("none"),
        DrafterKind("ngram"),
        DrafterKind("suffix"),
        DrafterKind("learned", needs_features=True, needs_head=True, paid_per_draft=True, merged=False),
        DrafterKind("model", samples=True, needs_draft_model=True, paid_per_draft=True),
        # The head (where there is one) drafts only the steps the n-gram and suffix drafters have nothing
        # for, a chain of its own: open chat gains, quote and code keep their speed. Merged into their
        # trees it made chat and code slower (docs/learned_drafter.md, "`auto` and the head").
        DrafterKind("auto", members=("ngram", "suffix", "learned", "model")),
    )
}
DRAFTERS = tuple(KINDS)  # the names, in table order, as the CLI and the configuration spell them


def kind(name: str) -> DrafterKind:
    """`name`'s declaration. Any other name raises a ValueError that lists the choices."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r} (choose from {', '.join(DRAFTERS)})") from None


def _declares(name: str, what: str) -> bool:
    """Whether `name` is a kind declaring `what`: a label no kind declares declares nothing."""
    declared = KINDS.get(name)
    return declared is not None and bool(getattr(declared, what))


def samples(name: str) -> bool:
    """Whether drafts labelled `name` were sampled, with rows p sent along (see `DrafterKind`)."""
    return _declares(name, "samples")


def needs_features(name: str) -> bool:
    """Whether `name` reads the target's hidden states (in a pipeline, the verify lane sends them)."""
    return _declares(name, "needs_features")


def needs_draft_model(name: str) -> bool:
    """Whether `name` cannot draft without a draft model."""
    return _declares(name, "needs_draft_model")


def merged(name: str) -> bool:
    """Whether a composite merges `name`'s candidates with its other members' (see `DrafterKind`); a
    label no kind declares is merged, as every drafter with candidates was before the flag."""
    declared = KINDS.get(name)
    return declared is None or declared.merged


def paid_per_draft(name: str) -> bool:
    """Whether each of `name`'s drafts costs it a forward (see `DrafterKind`)."""
    return _declares(name, "paid_per_draft")


def needs_head(name: str) -> bool:
    """Whether `name` cannot draft without a trained draft head."""
    return _declares(name, "needs_head")


def parts(name: str, *, draft_model: bool, head: bool = False) -> tuple[str, ...]:
    """The kinds that draft when `name` is asked for: the kind itself, or a composite's members
    without those that need a draft model or a head when there is none (`draft_model` and `head`
    say whether there is)."""
    members = kind(name).members
    if not members:
        return (name,)
    return tuple(
        m for m in members if (draft_model or not needs_draft_model(m)) and (head or not needs_head(m))
    )


def drafts_with_model(name: str, *, draft_model: bool) -> bool:
    """Whether asking for `name` runs a draft model: it needs one, or it is a composite with a draft
    model among its `parts` (given that there is one: `draft_model`). Those drafters run in the draft
    lane; the others can run beside the target, in the verify lane (`run.draft_in_verify_lane`)."""
    return any(needs_draft_model(part) for part in parts(name, draft_model=draft_model, head=True))


def reads_features(name: str, *, draft_model: bool, head: bool) -> bool:
    """Whether drafting `name` reads the target's features: it, or one of a composite's `parts`, does."""
    return any(needs_features(part) for part in parts(name, draft_model=draft_model, head=head))

"""How a request speculates (drafter, k, k_max, step limit): one validated struct.

This is the single home of these rules. The configuration's `[speculation]` section is this
struct; a request's overrides make a new one (`overridden`); the CLI, the HTTP API and the
orchestrator turn its `SpeculationError` into their own error form, naming the field.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pipeline.decoding.adaptive import K_LIMIT
from pipeline.decoding.drafters.kinds import DRAFTERS


class SpeculationError(ValueError):
    """A speculation setting out of range. `field` names it (k, k_max, drafter, max_iterations), and
    the message starts with that name, so a caller can prefix its own section ("speculation.k ...")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Speculation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    drafter: str = "auto"
    k: int | Literal["auto"] = "auto"  # draft nodes per step, or the cost-model controller's choice
    k_max: int = 16  # the controller's ceiling
    max_iterations: int | None = None  # verify steps before the request ends (None: no limit)
    tree: bool = True  # n-gram and suffix drafts as token trees (False: one linear draft a step)

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise SpeculationError(
                "drafter", f"drafter {self.drafter!r} is unknown (choose from {', '.join(DRAFTERS)})"
            )
        if isinstance(self.k, int) and not 0 <= self.k <= K_LIMIT:
            raise SpeculationError("k", f"k must be 0..{K_LIMIT} or 'auto', got {self.k}")
        if not 1 <= self.k_max <= K_LIMIT:
            raise SpeculationError("k_max", f"k_max must be 1..{K_LIMIT}, got {self.k_max}")
        if self.max_iterations is not None and self.max_iterations < 1:
            raise SpeculationError(
                "max_iterations", f"max_iterations must be >= 1, got {self.max_iterations}"
            )

    def overridden(
        self, *, drafter: str | None = None, k: int | str | None = None, max_iterations: int | None = None,
        tree: bool | None = None,
    ) -> Speculation:  # fmt: skip
        """A request's choices over these defaults (None keeps the default), validated again."""
        return Speculation(
            drafter=self.drafter if drafter is None else drafter,
            k=self.k if k is None else k,  # type: ignore[arg-type]
            k_max=self.k_max,
            max_iterations=self.max_iterations if max_iterations is None else max_iterations,
            tree=self.tree if tree is None else tree,
        )

    @property
    def fixed_k(self) -> int | None:
        """k for every step, or None for the controller's choice; the `none` drafter drafts nothing."""
        return 0 if self.drafter == "none" else None if self.k == "auto" else self.k

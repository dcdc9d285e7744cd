"""Plain (non-speculative) generation: the reference every speed-up must match.

It is the speculative loop with no drafter, so every step verifies zero drafts and
samples one token from the target's own distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .drafters import NoDraftSource
from .model import Model
from .sampling import SamplingParams
from .speculative import Completion, PromptError, check_prompt, decode

__all__ = ["Completion", "PromptError", "check_prompt", "generate"]


def generate(
    model: Model,
    prompt_tokens: Sequence[int],
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
) -> Completion:
    return decode(model, prompt_tokens, params, NoDraftSource(), k=0, on_text=on_text)

"""One request's place in its grammar: which tokens may come next, and moving through drafts and back.

Two llguidance behaviours shape this wrapper:
- a token the grammar forbids puts llguidance's matcher in an error state it never leaves, even after a
  roll-back, so every token is checked before it is consumed and a forbidden one raises instead;
- consuming the end-of-sequence token once the grammar is complete is not counted as a step, so
  `rollback(1)` would then undo the token before it. EOS is therefore kept here, never passed on: after
  it the only allowed token is EOS again, and rolling back pops it first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only `compiler` imports llguidance: requests without a format never load it
    import llguidance


class GrammarViolation(ValueError):
    """A token the grammar does not allow at this point."""


class GrammarMatcher:
    def __init__(
        self, inner: llguidance.LLMatcher, eos_id: int, tokenizer_vocab: int, vocab_size: int
    ) -> None:
        self._inner, self.eos_id, self.vocab_size = inner, eos_id, vocab_size
        self._words = np.zeros((tokenizer_vocab + 31) // 32, np.int32)
        self._width = min(tokenizer_vocab, vocab_size)  # ids beyond either vocabulary are never allowed
        self._eos = 0  # end-of-sequence tokens consumed (kept out of llguidance: see the module docstring)
        self.position = 0  # tokens consumed since the start of the output

    def allowed_mask(self) -> np.ndarray:
        """(vocab_size,) bool: True where the next token may be that id."""
        mask = np.zeros(self.vocab_size, dtype=bool)
        if self._eos:
            mask[self.eos_id] = True
            return mask
        self._inner.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self._raise_if_broken()
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        mask[: self._width] = bits[: self._width]
        if not mask.any():  # the rows would be all -inf: a grammar that cannot go on and cannot end
            raise GrammarViolation("the grammar allows no token here (and no end of sequence)")
        return mask

    def advance(self, token: int) -> None:
        """Consume one token; GrammarViolation (and no change) if the grammar forbids it."""
        if token == self.eos_id:
            if not self.eos_allowed():
                raise GrammarViolation("the end of sequence comes before the grammar is complete")
            self._eos += 1
        elif self._eos or not 0 <= token < self._width or self._inner.validate_tokens([token]) != 1:
            raise GrammarViolation(f"token {token} is not allowed by the grammar here")
        elif not self._inner.consume_token(token):
            self._raise_if_broken()
        self.position += 1

    def rollback(self, n: int) -> None:
        """Undo the last n tokens consumed."""
        if not 0 <= n <= self.position:
            raise ValueError(f"cannot roll back {n} tokens after {self.position}")
        undo_eos = min(n, self._eos)
        self._eos -= undo_eos
        if n > undo_eos and not self._inner.rollback(n - undo_eos):
            self._raise_if_broken()
        self.position -= n

    def rollback_to(self, position: int) -> None:
        """Back to the state after `position` tokens (a checkpoint is just a position)."""
        self.rollback(self.position - position)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (their bytes are the only way on): free drafts. Once the
        grammar is complete that is the end of sequence."""
        if self.is_finished():
            return [self.eos_id]
        return [t for t in self._inner.compute_ff_tokens() if t < self._width]

    def eos_allowed(self) -> bool:
        """Whether the output may end here (the grammar is satisfied)."""
        return self._eos > 0 or self._inner.is_accepting()

    def is_finished(self) -> bool:
        """Whether the grammar is complete: nothing but the end of sequence may follow."""
        return self._eos > 0 or self._inner.is_stopped()

    def _raise_if_broken(self) -> None:
        if self._inner.is_error():
            raise GrammarViolation(f"grammar matcher failed: {self._inner.get_error()}")

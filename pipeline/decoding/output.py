"""From sampled ids to the text a client sees: EOS, stop strings, max tokens.

Text that might be the start of a stop string is held back until it is known not to
be, so a streamed response never shows characters that the final text drops.
"""

from __future__ import annotations

from pipeline.decoding.sampling import SamplingParams
from pipeline.model.tokenizer import Tokenizer


class OutputStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.params = params
        self.eos_id = None if params.ignore_eos else tokenizer.eos_id
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._decoder = tokenizer.stream()
        self._text = ""  # everything decoded, stop strings not yet cut
        self._emitted = 0  # how much of _text has been handed out
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text so far, including what is still held back."""
        return self._text

    def push(self, token: int) -> str:
        """Accept one sampled token; return the text that may be shown now."""
        if self.done:
            raise RuntimeError("the output is already finished")
        self.tokens.append(token)
        if token == self.eos_id:
            return self.finish("stop")
        searched_from = max(0, len(self._text) - self._hold)
        self._text += self._decoder.push(token)
        cut = min((i for s in self.params.stop if (i := self._text.find(s, searched_from)) >= 0), default=-1)
        if cut >= 0:
            self._text = self._text[:cut]
            return self.finish("stop")
        if len(self.tokens) >= self.params.max_tokens:
            return self.finish("length")
        return self._release(len(self._text) - self._hold)

    def finish(self, reason: str) -> str:
        """End the output (also used when the context is full); flush held-back text."""
        self.finish_reason = reason
        return self._release(len(self._text))

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece, self._emitted = self._text[self._emitted : upto], upto
        return piece

"""Formats compiled into grammars bound to one tokenizer, with llguidance.

Why llguidance (measured in docs/structured_output.md): a JSON schema compiles in about a millisecond
whatever its length bounds (its lexer is built lazily), masks cost tens of microseconds a token, roll-back
is cheap, and its CPU wheel is 3 MB with no dependencies. xgrammar needs torch, transformers and triton
and took seconds on schemas with `maxLength`; outlines-core took 17 s for `json_object`.

Binding a tokenizer costs about half a second (llguidance reads every token's bytes), so it is done
once per tokenizer; a compiled format is cached by its canonical text, and every request starts from a
copy of the compiled matcher.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from functools import lru_cache

import llguidance

from pipeline.decoding.grammar.format import ResponseFormat, ResponseFormatError, parse_response_format
from pipeline.decoding.grammar.matcher import GrammarMatcher
from pipeline.model.tokenizer import Tokenizer

# No free whitespace between JSON tokens: a small model let loose on "any whitespace" can spend its
# whole budget on newlines, and fixed separators are tokens the grammar forces (drafts for free).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_CACHE = 64

_bound: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_bind_lock = threading.Lock()


def bound_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (every token's bytes), made once per tokenizer."""
    with _bind_lock:
        if tokenizer not in _bound:
            if tokenizer.eos_id is None:
                raise ResponseFormatError("response_format needs a model with an end-of-sequence token")
            _bound[tokenizer] = llguidance.LLTokenizer(tokenizer.hf.to_str(), eos_token=tokenizer.eos_id)
        return _bound[tokenizer]


def warm_up(tokenizer: Tokenizer) -> threading.Thread:
    """Bind `tokenizer` in the background, as a process that may serve structured output starts: the
    first request with a format then finds it bound (or waits for the lock) instead of stalling its
    lane for half a second (llguidance holds the GIL while it binds, so the process pauses once, at
    start-up). A model without an end-of-sequence token is left unbound: its requests are refused."""

    def bind() -> None:
        with contextlib.suppress(ResponseFormatError):
            bound_tokenizer(tokenizer)

    thread = threading.Thread(target=bind, name="grammar-warm-up", daemon=True)
    thread.start()
    return thread


def grammar_source(fmt: ResponseFormat) -> str:
    """The format as an llguidance grammar (text it compiles; not yet checked)."""
    if fmt.kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", fmt.grammar)  # Lark, or GBNF converted to Lark
        except ValueError as exc:
            raise ResponseFormatError(f"response_format grammar: {exc}") from None
    schema = fmt.schema if fmt.kind == "json_schema" else {"type": "object"}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]


class CompiledGrammar:
    """One format compiled for one tokenizer, producing masks `vocab_size` wide (the model's logits
    may be wider than the tokenizer's vocabulary: the extra ids are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, fmt: ResponseFormat, vocab_size: int) -> None:
        bound = bound_tokenizer(tokenizer)
        source = grammar_source(fmt)
        error = llguidance.LLMatcher.validate_grammar(source, bound)
        if error:
            raise ResponseFormatError(f"response_format is not a grammar this server can follow: {error}")
        self._template = llguidance.LLMatcher(bound, source, log_level=0)
        if self._template.is_error():
            raise ResponseFormatError(f"response_format failed to compile: {self._template.get_error()}")
        self.eos_id: int = bound.eos_token
        self.tokenizer_vocab: int = bound.vocab_size
        self.vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the output, for one request."""
        return GrammarMatcher(self._template.deep_copy(), self.eos_id, self.tokenizer_vocab, self.vocab_size)


@lru_cache(maxsize=COMPILED_CACHE)
def _compiled(tokenizer: Tokenizer, text: str, vocab_size: int) -> CompiledGrammar:
    fmt = parse_response_format(text)
    if fmt is None:
        raise ResponseFormatError('response_format {"type": "text"} has no grammar')
    return CompiledGrammar(tokenizer, fmt, vocab_size)


def compile_format(tokenizer: Tokenizer, response_format: str, vocab_size: int) -> CompiledGrammar:
    """The grammar for `SamplingParams.response_format` text, from the cache when it was seen before."""
    return _compiled(tokenizer, response_format, vocab_size)

"""Measure the three grammar libraries the structured-output issue names (llguidance, xgrammar,
outlines-core) with the default model's real tokenizer, on the work speculation asks of them.

Not part of the package: it needs all three installed, which the project does not (xgrammar alone
pulls torch, transformers and triton). Run it in a scratch environment that also sees speclanes:

    python -m venv /tmp/gbench && echo "$PWD" > /tmp/gbench/lib/python3.11/site-packages/speclanes.pth
    /tmp/gbench/bin/pip install numpy gguf tokenizers jinja2 msgspec llguidance xgrammar outlines-core
    /tmp/gbench/bin/python ops/bench/grammar_libraries.py

For each library and grammar it prints (a) compile time, (b) mean per-token mask time walking a valid
document, (c) one speculative step's grammar work: compute a mask at each of k+1 rows while advancing
through k drafts, then roll back the k/2 rejected ones; and the parts of it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from grammar_cases import DOCUMENTS, SCHEMAS  # noqa: E402

from pipeline.model.default import default_model_path  # noqa: E402
from pipeline.model.gguf_file import _open, read_tokenizer_metadata  # noqa: E402
from pipeline.model.tokenizer import Tokenizer  # noqa: E402

K = 8  # drafts per speculative step in (c)
REPEATS = 5


def load_tokenizer() -> Tokenizer:
    return Tokenizer.from_metadata(read_tokenizer_metadata(_open(default_model_path())))


def byte_vocab(tok: Tokenizer) -> list[bytes]:
    """Every token's bytes (byte-level BPE: each character of a token stands for one byte)."""
    from tokenizers.decoders import ByteLevel

    decoder = ByteLevel()
    size = tok.vocab_size
    return [decoder.decode([tok.hf.id_to_token(i)]).encode("utf-8", "surrogateescape") for i in range(size)]


class Llguidance:
    name = module = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok.hf.to_str(), eos_token=tok.eos_id)
        self.words = (tok.vocab_size + 31) // 32

    def compile(self, schema: dict | None) -> object:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema or {"type": "object"})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: object) -> object:
        return compiled.deep_copy()  # type: ignore[attr-defined]

    def mask(self, m: object, out: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)  # type: ignore[attr-defined]

    def advance(self, m: object, token: int) -> None:
        assert m.consume_token(token), m.get_error()  # type: ignore[attr-defined]

    def rollback(self, m: object, n: int) -> None:
        m.rollback(n)  # type: ignore[attr-defined]


class Xgrammar:
    name = module = "xgrammar"

    def __init__(self, tok: Tokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(
            byte_vocab(tok), xgrammar.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id]
        )
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.words = (tok.vocab_size + 31) // 32

    def compile(self, schema: dict | None) -> object:
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: object) -> object:
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=64)

    def mask(self, m: object, out: np.ndarray) -> None:
        m.fill_next_token_bitmask(out[None, :])  # type: ignore[attr-defined]

    def advance(self, m: object, token: int) -> None:
        assert m.accept_token(token)  # type: ignore[attr-defined]

    def rollback(self, m: object, n: int) -> None:
        m.rollback(n)  # type: ignore[attr-defined]


class OutlinesCore:
    name, module = "outlines-core", "outlines_core"

    def __init__(self, tok: Tokenizer) -> None:
        import outlines_core

        self.oc = outlines_core
        mapping: dict[bytes, list[int]] = {}
        for i, text in enumerate(byte_vocab(tok)):
            if i != tok.eos_id and text:
                mapping.setdefault(text, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tok.eos_id, mapping)
        self.words = (tok.vocab_size + 31) // 32

    def compile(self, schema: dict | None) -> object:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema or {"type": "object"}))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: object) -> object:
        return self.oc.Guide(compiled, max_rollback=64)

    def mask(self, m: object, out: np.ndarray) -> None:
        m.write_mask_into(out.ctypes.data, out.size, 4)  # type: ignore[attr-defined]

    def advance(self, m: object, token: int) -> None:
        m.advance(token, return_tokens=False)  # type: ignore[attr-defined]

    def rollback(self, m: object, n: int) -> None:
        m.rollback_state(n)  # type: ignore[attr-defined]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def walk(lib, compiled, tokens: list[int]) -> tuple[float, float, float]:
    """A walk through a valid document: seconds in all, mean seconds per mask, per advance (each
    token is also checked to be allowed by its mask)."""
    m, out, masks, advances = lib.matcher(compiled), np.zeros(lib.words, np.int32), 0.0, 0.0
    start = time.perf_counter()
    for token in tokens:
        seconds, _ = timed(lambda: lib.mask(m, out))
        masks += seconds
        assert out[token // 32] >> (token % 32) & 1, f"{lib.name}: valid token {token} masked out"
        seconds, _ = timed(lambda token=token: lib.advance(m, token))
        advances += seconds
    return time.perf_counter() - start, masks / len(tokens), advances / len(tokens)


def speculative_steps(lib, compiled, tokens: list[int]) -> tuple[float, float]:
    """Mean seconds of one step's grammar work (k+1 masks while advancing k drafts, then roll back
    k/2), and of the roll-back alone."""
    m, out, steps, rollbacks = lib.matcher(compiled), np.zeros(lib.words, np.int32), [], []
    position = 0
    while position + K < len(tokens):
        start = time.perf_counter()
        for token in tokens[position : position + K]:
            lib.mask(m, out)
            lib.advance(m, token)
        lib.mask(m, out)
        seconds, _ = timed(lambda: lib.rollback(m, K // 2))
        rollbacks.append(seconds)
        steps.append(time.perf_counter() - start)
        position += K // 2
    return statistics.mean(steps), statistics.mean(rollbacks)


def measure(lib, tok: Tokenizer) -> list[tuple[str, ...]]:
    rows = []
    for name, schema in SCHEMAS.items():
        tokens = tok.encode(json.dumps(DOCUMENTS[name]))
        compile_s, compiled = timed(lambda schema=schema: lib.compile(schema))  # cold: the first time
        cold_s = walk(lib, compiled, tokens)[0]
        warm = min((walk(lib, compiled, tokens) for _ in range(REPEATS)), key=lambda w: w[1])
        step_s, rollback_s = min(speculative_steps(lib, compiled, tokens) for _ in range(REPEATS))
        rows.append((
            name, f"{compile_s * 1e3:.1f}", f"{cold_s * 1e3:.1f} ({len(tokens)} tok)",
            f"{warm[1] * 1e6:.0f}", f"{warm[2] * 1e6:.0f}", f"{rollback_s * 1e6:.1f}", f"{step_s * 1e6:.0f}",
        ))  # fmt: skip
    return rows


def main() -> None:
    tok = load_tokenizer()
    print(f"vocab {tok.vocab_size}, k={K}, warm numbers best of {REPEATS}")
    print(
        "| library | grammar | compile (ms) | first walk (ms) | mask (µs/token) | advance (µs/token) "
        "| roll back 4 (µs) | step k=8 (µs) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for make in (Llguidance, Xgrammar, OutlinesCore):
        import_s, _ = timed(lambda make=make: __import__(make.module))
        setup_s, lib = timed(lambda make=make: make(tok))
        print(f"| {make.name} | import {import_s * 1e3:.0f} ms, tokenizer set-up {setup_s * 1e3:.0f} ms |")
        for row in measure(lib, tok):
            print(f"| {make.name} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

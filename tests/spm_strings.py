"""The 10,000 strings the SentencePiece tokenizer is compared with llama.cpp on, made from a seed.

ops/bench/spm_agreement.py tokenizes them with llama.cpp into tests/fixtures/gemma3_spm_ids.npz,
and tests/test_spm_tokenizer.py makes them again (the fixture keeps their SHA-256, so a generator
or a fixed-text change shows as a stale fixture, not as disagreement). Only numpy's PCG64
`integers` draws are used: their streams are fixed for a seed across numpy versions.

Kinds, so each failure says what it was: spans of the fixed text (pipeline/bench/quality_text.txt),
random code points from many scripts, code, emoji sequences, CJK, whitespace runs, and text with
the vocabulary's user-defined and control token strings (whole and broken) inside.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

SEED = 20261126
FIXED_TEXT = Path(__file__).resolve().parents[1] / "pipeline" / "bench" / "quality_text.txt"
# fmt: off
COUNTS = {
    "fixed": 1500, "unicode": 2000, "code": 1500, "emoji": 1000, "cjk": 1000, "space": 1500, "special": 1500
}

# Code point ranges random text draws from: ASCII, Latin-1 and Latin Extended, combining marks,
# Greek, Cyrillic, Hebrew, Arabic, Devanagari, Thai, Hangul syllables, CJK, Hiragana/Katakana,
# symbols and arrows, private use, emoji, mathematical alphanumerics, rare CJK extension B, and
# some unassigned ones.
RANGES = [
    (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF),
    (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0xAC00, 0xD7A3), (0x4E00, 0x9FFF),
    (0x3040, 0x30FF), (0x2000, 0x2BFF), (0xE000, 0xE0FF), (0x1F300, 0x1FAFF), (0x1D400, 0x1D7FF),
    (0x20000, 0x2A6DF), (0x0378, 0x037F), (0x10FFF0, 0x10FFFD),
]
WORDS = [
    "the", "of", "and", "token", "tokenizer", "speculative", "decoding", "Hello", "World", "naïve",
    "café", "Zürich", "straße", "año", "déjà", "вода", "λόγος", "مرحبا", "שלום", "नमस्ते", "ภาษา",
    "1234567", "3.14159", "x", "I'm", "don't", "e-mail", "U.S.A.", "http://example.com/a?b=c",
]
CODE = [
    "def", "return", "class", "import", "for", "in", "if", "else:", "while", "lambda", "self",
    "print(", ")", "(", "[", "]", "{", "}", "==", "!=", "+=", "->", "::", "&&", "||", "//", "/*",
    "*/", "#", ";", ",", ".", ":", "'", '"', "`", "\\n", "0x1F", "1e-9", "i++", "<=", ">=", "=>",
    "std::vector<int>", "fn main()", "let mut", "const", "async", "await", "None", "True", "_x1",
    "snake_case", "camelCase", "SCREAMING", "====", "----", "....", "____", "~~~~", "****", "####",
]
EMOJI = [
    "🙂", "👍", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🇫🇷", "🇯🇵", "❤️", "🏳️‍🌈", "✨", "🔥", "🤖", "🧑🏿‍🚀",
    "☕", "🍣", "😀", "😂", "🥲", "🫠", "🦀", "🐍", "👋🏻", "✊🏾", "🎉", "#️⃣", "1️⃣", "©️",
]
CJK = [
    "日本語", "中文", "漢字", "東京", "北京", "한국어", "안녕하세요", "こんにちは", "カタカナ",
    "。", "、", "「", "」", "！", "？", "（", "）", "：", "𠀋", "𪚲", "龘", "々", "ー", "〜",
]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", " \n", "\n ", "\u00a0",
          "\u3000", "\u2009", "\u200b", " \t ", "\v", "\f", "\u2581", "\u2581\u2581"]
SPECIAL = [
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<unused0>",
    "<unused10>", "<unused6241>", "<start_of_image>", "<end_of_image>", "[multimodal]", "<table>",
    "</table>", "<tr>", "<td>", "</td>", "<h1>", "</h1>", "<blockquote>", "<strong>", "<em>", "<b>",
    "<s>", "</s>", "<code>", "</code>", "<a>", "<div>", "<img>", "<bbox>", "<span>", "<li>",
    # broken, nested, or near misses
    "<start_of_turn", "start_of_turn>", "<start_of_<end_of_turn>turn>", "<unused", "<unused62410>",
    "< table>", "<TABLE>", "<0x41>", "<0xE4><0xB8>", "<0x0A>", "<<bos>>", "<tab<table>le>", "</",
]
# fmt: on


def _pick(rng: np.random.Generator, items: list[str]) -> str:
    return items[int(rng.integers(len(items)))]


def _join(rng: np.random.Generator, pools: list[list[str]], n: int) -> str:
    parts = []
    for _ in range(n):
        parts.append(_pick(rng, pools[int(rng.integers(len(pools)))]))
        if rng.integers(3) == 0:
            parts.append(_pick(rng, [" ", " ", " ", "", "\n", "  ", "\t"]))
    return "".join(parts)


def _random_unicode(rng: np.random.Generator) -> str:
    chars = []
    for _ in range(int(rng.integers(1, 40))):
        low, high = RANGES[int(rng.integers(len(RANGES)))]
        code = int(rng.integers(low, high + 1))
        chars.append(chr(code) if not 0xD800 <= code <= 0xDFFF else "?")
    return "".join(chars)


def _fixed_span(rng: np.random.Generator, text: str) -> str:
    start = int(rng.integers(len(text)))
    return text[start : start + int(rng.integers(1, 200))]


def _make(kind: str, rng: np.random.Generator, text: str) -> str:
    if kind == "fixed":
        return _fixed_span(rng, text)
    if kind == "unicode":
        return _random_unicode(rng)
    n = int(rng.integers(1, 24))
    if kind == "code":
        return _join(rng, [CODE, CODE, WORDS, ["    ", "\n    ", "\n\t", "\n"]], n)
    if kind == "emoji":
        return _join(rng, [EMOJI, EMOJI, WORDS], n)
    if kind == "cjk":
        return _join(rng, [CJK, CJK, CJK, WORDS], n)
    if kind == "space":
        return _join(rng, [SPACES, SPACES, WORDS, CODE], n)
    return _join(rng, [SPECIAL, SPECIAL, WORDS, SPACES, CODE, CJK, EMOJI], n)


def spm_strings(seed: int = SEED) -> list[tuple[str, str]]:
    """(kind, string) pairs, COUNTS of each kind, the same for a seed."""
    rng = np.random.default_rng(seed)
    text = FIXED_TEXT.read_text()
    out = [("fixed", line) for line in text.splitlines() if line]
    for kind, count in COUNTS.items():
        have = sum(1 for k, _ in out if k == kind)
        out += [(kind, _make(kind, rng, text)) for _ in range(count - have)]
    return out


def digest(strings: list[tuple[str, str]]) -> str:
    """Names the strings exactly (kinds included), for the fixture to say which strings it answers."""
    h = hashlib.sha256()
    for kind, s in strings:
        h.update(kind.encode() + b"\0" + s.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()

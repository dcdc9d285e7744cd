"""Does speclanes tokenize a SentencePiece-style vocabulary as llama.cpp does? Ids side by side.

Tokenizes the 10,000 seeded strings of tests/spm_strings.py with llama.cpp (`Llama(vocab_only=True)`,
`tokenize(..., add_bos=False)`) from the Gemma 3 270M file, in both special-token modes:
special=True is how speclanes encodes every prompt (control-token text in a rendered chat template
is those tokens), special=False is how llama.cpp encodes text it is told is plain. It then compares
speclanes' ids with them and prints, per kind of string, how many differ, with the first few.

With --write it stores llama.cpp's answers in tests/fixtures/gemma3_spm_ids.npz (what
tests/test_spm_tokenizer.py checks in CI, where llama.cpp is not installed): the strings' digest,
every string's special=True ids, and the special=False ids of the strings where the two modes differ.

    .venv/bin/python ops/bench/spm_agreement.py [--model PATH] [--write]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.model.default import gemma3_path
from pipeline.model.gguf_file import _open, read_tokenizer_metadata
from pipeline.model.tokenizer import Tokenizer
from tests.spm_strings import SEED, digest, spm_strings

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "gemma3_spm_ids.npz"


def llama_cpp_ids(path: Path, strings: list[str], special: bool) -> list[list[int]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return [llm.tokenize(s.encode(), add_bos=False, special=special) for s in strings]


def flat(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ids end to end, and where each list ends."""
    ids = np.array([t for one in lists for t in one], dtype=np.int32)
    return ids, np.cumsum([len(one) for one in lists]).astype(np.int32)


def write_fixture(strings: list[tuple[str, str]], special: list[list[int]], plain: list[list[int]]) -> None:
    differ = [i for i, (a, b) in enumerate(zip(special, plain, strict=True)) if a != b]
    ids, ends = flat(special)
    plain_ids, plain_ends = flat([plain[i] for i in differ])
    np.savez_compressed(
        FIXTURE,
        digest=np.array(digest(strings)),
        seed=np.array(SEED),
        ids=ids,
        ends=ends,
        plain_index=np.array(differ, dtype=np.int32),
        plain_ids=plain_ids,
        plain_ends=plain_ends,
    )
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes, {len(ids)} ids, {len(differ)} differ by mode)")


def ours(tokenizer: Tokenizer, strings: list[str], special: bool) -> list[list[int]]:
    tokenizer.hf.encode_special_tokens = not special
    try:
        return [tokenizer.encode(s, add_bos=False) for s in strings]
    finally:
        tokenizer.hf.encode_special_tokens = False


def report(
    kinds: list[str], strings: list[str], mine: list[list[int]], theirs: list[list[int]], mode: str
) -> int:
    bad = [i for i in range(len(strings)) if mine[i] != theirs[i]]
    by_kind = dict(Counter(kinds[i] for i in bad))
    print(f"special={mode}: {len(bad)} of {len(strings)} differ; by kind {by_kind}")
    for i in bad[:5]:
        print(f"  {kinds[i]} {strings[i]!r}\n    ours      {mine[i]}\n    llama.cpp {theirs[i]}")
    return len(bad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--write", action="store_true", help=f"store llama.cpp's ids in {FIXTURE}")
    args = parser.parse_args()
    path = args.model or gemma3_path()
    pairs = spm_strings()
    kinds, strings = [k for k, _ in pairs], [s for _, s in pairs]
    special, plain = llama_cpp_ids(path, strings, True), llama_cpp_ids(path, strings, False)
    tokenizer = Tokenizer.from_metadata(read_tokenizer_metadata(_open(path)))
    differ = report(kinds, strings, ours(tokenizer, strings, True), special, "True")
    differ += report(kinds, strings, ours(tokenizer, strings, False), plain, "False")
    lossy = [s for s in strings if tokenizer.decode(tokenizer.encode(s, add_bos=False)) != s]
    print(f"decode(encode(s)) != s for {len(lossy)} strings: {lossy[:3]!r}")
    if args.write:
        write_fixture(pairs, special, plain)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

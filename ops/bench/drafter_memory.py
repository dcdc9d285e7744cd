"""What the token-keyed drafters hold with a large vocabulary: the cross-request suffix table and the
per-request n-gram index, fed Gemma 3's ids (262,144 tokens) and the default model's (49,152).

Both are dictionaries keyed by tuples of ids, so their size should follow the number of distinct
n-grams, not the vocabulary; this measures it (tracemalloc: bytes Python allocated and still holds)
on a realistic workload: REQUESTS requests of TOKENS tokens drawn from each tokenizer's encoding of
the fixed text (pipeline/bench/quality_text.txt, cycled), each request starting at its own offset,
every one finished into one shared `SuffixTable` (the suffix drafter's cross-request cache), and each
request's own `NgramIndex` and `SuffixDrafter` table built as a request's drafter builds them.

    .venv/bin/python ops/bench/drafter_memory.py [--requests 200] [--tokens 500]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.decoding.drafters.ngram import NgramIndex
from pipeline.decoding.drafters.suffix import SuffixDrafter, SuffixTable
from pipeline.model import default_model_path
from pipeline.model.default import gemma3_path
from pipeline.model.gguf_file import _open, read_tokenizer_metadata
from pipeline.model.tokenizer import Tokenizer

TEXT = Path(__file__).resolve().parents[2] / "pipeline" / "bench" / "quality_text.txt"


def workload(tokenizer: Tokenizer, requests: int, tokens: int, varied: bool) -> list[list[int]]:
    """Windows of the fixed text (overlapping: repeated traffic), or with `varied` consecutive
    windows of the 10,000 strings of tests/spm_strings.py (code, CJK, emoji...: n-grams rarely
    repeat, the table's worst case)."""
    if varied:
        from tests.spm_strings import spm_strings

        ids = tokenizer.encode("\n".join(s for _, s in spm_strings()), add_bos=False)
        return [ids[i * tokens : (i + 1) * tokens] for i in range(requests)]
    ids = tokenizer.encode(TEXT.read_text(), add_bos=False)
    cycled = ids * (1 + (requests * 37 + tokens) // len(ids))
    return [cycled[(i * 37) % len(ids) :][:tokens] for i in range(requests)]


def held(build) -> tuple[int, int, object]:
    """(bytes held after, peak bytes while building, what was built)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    built = build()
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return now - before, peak - before, built


def _indexed(tokens: list[int]) -> NgramIndex:
    index = NgramIndex(5)  # NgramSource's default max_n
    index.update(tokens)
    return index


def measure(name: str, tokenizer: Tokenizer, requests: int, tokens: int, varied: bool) -> None:
    load = workload(tokenizer, requests, tokens, varied)
    largest = max(max(r) for r in load)

    def shared() -> SuffixTable:
        table = SuffixTable()
        for request in load:
            table.add(request)
        return table

    start = time.process_time()
    table_bytes, table_peak, table = held(shared)
    table_cpu = time.process_time() - start
    index_bytes, _, index = held(lambda: _indexed(load[0]))
    drafter_bytes, _, _ = held(lambda: SuffixDrafter(table, load[0]))  # type: ignore[arg-type]
    assert isinstance(table, SuffixTable) and index is not None
    print(
        f"{name} ({'varied' if varied else 'fixed text'}): vocab {tokenizer.vocab_size}, "
        f"largest id {largest}, {requests} x {tokens} tokens; "
        f"shared suffix table {len(table)} n-grams, {table_bytes / 2**20:.1f} MiB held "
        f"({table_bytes / max(1, len(table)):.0f} B/n-gram, peak {table_peak / 2**20:.1f} MiB, "
        f"{table_cpu:.2f} s CPU); one request's n-gram index {index_bytes / 2**10:.0f} KiB, "
        f"its suffix drafter's own table {drafter_bytes / 2**10:.0f} KiB; load {os.getloadavg()[0]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=500)
    args = parser.parse_args()
    for name, path in (("gemma-3-270m", gemma3_path()), ("smollm2-135m", default_model_path())):
        tokenizer = Tokenizer.from_metadata(read_tokenizer_metadata(_open(path)))
        for varied in (False, True):
            measure(name, tokenizer, args.requests, args.tokens, varied)


if __name__ == "__main__":
    main()

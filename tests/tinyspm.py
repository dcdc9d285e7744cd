"""Tiny SentencePiece-style ('llama' tokenizer model) vocabularies in GGUF files, a port of llama.cpp's
SPM tokenizer to check them against, and tiny model files with their chat template taken out.

Kept apart from tests/tinymodel.py (the byte-level vocabulary and the float64 reference) so the two
evolve separately; a model file here is tinymodel's file with its metadata rewritten.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any

import gguf

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"
# fmt: off
HEAD = [
    ("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
    ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED), ("  ", USER_DEFINED),
    ("<b>", USER_DEFINED), ("</s>", USER_DEFINED),
]
# Normal pieces, most frequent (highest score) first. "日" and "本" alone are pieces but "é" is not,
# so it falls back to bytes; "a"/"aa"/"aaa", "ab"/"ba"/"aba" and "<b" give overlapping merges.
PIECES = [
    SPACE, "e", "h", "l", "o", "t", "a", "b", "<", ">", "x", "日", "本", "he", "ll", f"{SPACE}t", "aa",
    f"{SPACE}the", "llo", f"{SPACE}he", "ab", "hello", f"{SPACE}hello", "aaa", "ba", "日本", "aba",
    f"{SPACE}{SPACE}", "<b", "th", "the", "o>", "lo",
]
# fmt: on
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types: control/user-defined first (score -1000, as Gemma's), the 256 byte
    tokens (score 0), then the pieces with score -rank."""
    tokens = [t for t, _ in HEAD] + BYTES + PIECES
    scores = [-1000.0] * len(HEAD) + [0.0] * 256 + [-float(i) for i in range(len(PIECES))]
    types = [k for _, k in HEAD] + [BYTE] * 256 + [NORMAL] * len(PIECES)
    return tokens, scores, types


def write_spm_gguf(path: Path, *, add_space_prefix: bool = False, chat_template: str | None = None) -> Path:
    """A GGUF holding only the tiny SPM tokenizer (no tensors): what the tokenizer reads."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_spm_tokenizer(writer, add_space_prefix=add_space_prefix, chat_template=chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_spm_tokenizer(writer: Any, *, add_space_prefix: bool, chat_template: str | None) -> None:
    tokens, scores, types = spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def rewrite_gguf(
    source: Path, target: Path, *, drop_chat_template: bool = True, chat_template: str | None = None
) -> Path:
    """`source` (a tiny model file) copied to `target` without its chat template (a base model), or
    with `chat_template` in its place."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if (drop_chat_template or chat_template is not None) and name == "tokenizer.chat_template":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]
        writer.add_tensor(tensor.name, tensor.data, raw_shape=shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def llama_cpp_spm(
    text: str, tokens: list[str], scores: list[float], types: list[int], special: bool
) -> list[int]:
    """llama.cpp's SPM tokenization (llama-vocab.cpp: tokenizer_st_partition, then
    llm_tokenizer_spm_session per fragment, add_space_prefix off), ported line by line as the oracle
    the `tokenizers` BPE is checked against: special tokens split the text longest first, then each
    fragment's characters merge by the best-scoring pair, leftmost on ties; leftovers become bytes."""
    ids = {t: i for i, t in enumerate(tokens)}
    kinds = (CONTROL, UNKNOWN, USER_DEFINED) if special else (USER_DEFINED,)
    # llama.cpp makes "</s>" a control token by its text (its end-of-generation list)
    types = [CONTROL if t == "</s>" else k for t, k in zip(tokens, types, strict=True)]
    specials = sorted((i for i, k in enumerate(types) if k in kinds), key=lambda i: -len(tokens[i]))
    fragments: list[str | int] = [text]
    for sid in specials:
        out: list[str | int] = []
        for frag in fragments:
            while isinstance(frag, str) and tokens[sid] in frag:
                at = frag.index(tokens[sid])
                out += [frag[:at], sid] if at else [sid]
                frag = frag[at + len(tokens[sid]) :]
            if frag != "":
                out.append(frag)
        fragments = out
    result: list[int] = []
    for frag in fragments:
        result += [frag] if isinstance(frag, int) else _spm_session(frag.replace(" ", SPACE), ids, scores)
    return result


def _spm_session(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    symbols = list(text)  # merged symbols keep their text; "" marks one merged away
    nxt, prv = [*range(1, len(text)), -1], list(range(-1, len(text) - 1))
    queue: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (token := ids.get(symbols[left] + symbols[right])) is not None:
            heapq.heappush(queue, (-scores[token], left, right, len(symbols[left] + symbols[right])))

    for i in range(1, len(text)):
        push(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
            continue
        symbols[left], symbols[right] = symbols[left] + symbols[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    out, i = [], 0
    while i != -1 and text:
        piece = symbols[i]
        out += [ids[piece]] if piece in ids else [ids[f"<0x{b:02X}>"] for b in piece.encode()]
        i = nxt[i]
    return out

"""The SentencePiece-style tokenizer (pipeline/model/spm_vocab.py): a tiny vocabulary checked against
a port of llama.cpp's SPM tokenizer, and Gemma 3's real one against llama.cpp's own ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.model.errors import ModelFileError
from pipeline.model.gguf_file import _open, read_tokenizer_metadata
from pipeline.model.tokenizer import Tokenizer

from .spm_strings import digest, spm_strings
from .tinyspm import SPACE, llama_cpp_spm, spm_vocab, write_spm_gguf

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_spm_ids.npz"


def spm_tokenizer(tmp_path: Path, **options) -> Tokenizer:
    """Through a GGUF file and the metadata reader, as a model's tokenizer is built."""
    path = write_spm_gguf(tmp_path / "spm.gguf", **options)
    return Tokenizer.from_metadata(read_tokenizer_metadata(_open(path)))


@pytest.fixture(scope="module")
def tiny_spm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return spm_tokenizer(tmp_path_factory.mktemp("spm"))


def ids_of(*pieces: str) -> list[int]:
    tokens = spm_vocab()[0]
    return [tokens.index(p) for p in pieces]


def encode(tok: Tokenizer, text: str, *, special: bool = True) -> list[int]:
    tok.hf.encode_special_tokens = not special  # llama.cpp's special=False: control text is text
    try:
        return tok.encode(text, add_bos=False)
    finally:
        tok.hf.encode_special_tokens = False


def test_merges_follow_scores_and_bytes_fall_back(tiny_spm):
    assert tiny_spm.encode("hello the") == [2, *ids_of("hello", f"{SPACE}the")]  # add_bos from the file
    assert encode(tiny_spm, " hello") == ids_of(f"{SPACE}hello")
    assert encode(tiny_spm, "aaaa") == ids_of("aa", "aa")  # "aa" outranks "aaa": leftmost pair first
    assert encode(tiny_spm, "é") == ids_of("<0xC3>", "<0xA9>")  # no piece: its UTF-8 bytes
    assert encode(tiny_spm, "日本") == ids_of("日本")


def test_special_and_user_defined_tokens(tiny_spm):
    text = "<start_of_turn>x\n  <b></s>"
    assert encode(tiny_spm, text) == ids_of("<start_of_turn>", "x", "\n", "  ", "<b>", "</s>")
    # special=False: control text (and "</s>", which llama.cpp makes control) is merged as text;
    # user-defined tokens are still matched
    plain = encode(tiny_spm, text, special=False)
    assert ids_of("<start_of_turn>")[0] not in plain and ids_of("\n", "  ", "<b>")[0] in plain
    assert plain == llama_cpp_spm(text, *spm_vocab(), special=False)


# What random texts are made of: the tiny vocabulary's pieces, its special strings, and text it lacks.
TEXT_PARTS = [
    "a", "b", "h", "e", "l", "o", "t", "x", " ", "  ", "\n", "日", "本", "é", "<", ">", "<b>", "</s>",
    "<start_of_turn>", "<unk>", SPACE, "🙂",
]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(TEXT_PARTS),
        max_size=24,
    ).map("".join),
    special=st.booleans(),
)
def test_equals_llama_cpp_spm_port(tiny_spm, text, special):
    """The BPE built from scores merges as llama.cpp's SPM loop does, on text made of the pieces'
    characters (overlapping merges, ties of one piece split two ways, bytes, special tokens)."""
    assert encode(tiny_spm, text, special=special) == llama_cpp_spm(text, *spm_vocab(), special=special)


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)).filter(lambda c: c != SPACE), max_size=40))
def test_any_text_round_trips_and_streams(tiny_spm, text):
    ids = tiny_spm.encode(text, add_bos=False)
    assert tiny_spm.decode(ids) == text
    assert b"".join(tiny_spm.token_bytes(i) for i in ids) == text.encode()
    stream = tiny_spm.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_streaming_holds_back_split_characters(tiny_spm):
    ids = tiny_spm.encode("日é本", add_bos=False)
    assert ids == ids_of("日", "<0xC3>", "<0xA9>", "本")
    stream = tiny_spm.stream()
    assert [stream.push(i) for i in ids] == ["日", "", "é", "本"]


def test_space_prefix(tmp_path):
    """add_space_prefix: a space before each stretch of text (after a special token too, as
    llama.cpp does), and decoding takes the first one off again."""
    tok = spm_tokenizer(tmp_path, add_space_prefix=True)
    assert encode(tok, "hello") == ids_of(f"{SPACE}hello")
    assert encode(tok, "he<start_of_turn>he") == ids_of(f"{SPACE}he", "<start_of_turn>", f"{SPACE}he")
    assert tok.decode(encode(tok, "hello the")) == "hello the"


def test_a_file_without_the_flags_gets_llama_cpps_spm_defaults(tmp_path):
    """A file with no add_space_prefix / add_bos_token key (SPM files converted before the keys
    existed, Llama 2's era) reads as llama.cpp's SPM defaults, both on: a space prefix and a BOS.
    An absent key reads as None (`read_tokenizer_metadata`)."""
    meta = read_tokenizer_metadata(_open(write_spm_gguf(tmp_path / "spm.gguf")))
    tok = Tokenizer.from_metadata(
        {**meta, "tokenizer.ggml.add_space_prefix": None, "tokenizer.ggml.add_bos_token": None}
    )
    assert tok.encode("hello the") == [2, *ids_of(f"{SPACE}hello", f"{SPACE}the")]
    assert tok.decode(encode(tok, "hello the")) == "hello the"
    # a key that is there decides, as before
    assert spm_tokenizer(tmp_path, add_space_prefix=False).encode("hello") == [2, *ids_of("hello")]


def test_cached_form_is_the_same_tokenizer(tiny_spm):
    again = Tokenizer.from_json(*tiny_spm.to_json())
    text = "hello <b>日é\n"
    assert again.encode(text) == tiny_spm.encode(text) and again.pieces == "sentencepiece"
    ids = again.encode(text)
    assert [again.token_bytes(i) for i in ids] == [tiny_spm.token_bytes(i) for i in ids]


def test_scores_are_required(tmp_path):
    meta = read_tokenizer_metadata(_open(write_spm_gguf(tmp_path / "spm.gguf")))
    with pytest.raises(ModelFileError, match="scores"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.scores": None})


# --- Gemma 3's real vocabulary (262,144 tokens) against llama.cpp ---


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_file: Path) -> Tokenizer:
    return Tokenizer.from_metadata(read_tokenizer_metadata(_open(gemma3_file)))


def split(ids: np.ndarray, ends: np.ndarray) -> list[list[int]]:
    return [part.tolist() for part in np.split(ids, ends[:-1])] if len(ends) else []


@pytest.mark.slow
def test_gemma3_equals_llama_cpp_on_10000_strings(gemma3_tokenizer):
    """llama.cpp's ids (ops/bench/spm_agreement.py, both special-token modes) for every string."""
    fixture = np.load(FIXTURE)
    pairs = spm_strings(int(fixture["seed"]))
    stale = "the strings changed: rerun ops/bench/spm_agreement.py --write"
    assert digest(pairs) == str(fixture["digest"]), stale
    strings = [s for _, s in pairs]
    special = split(fixture["ids"], fixture["ends"])
    differ = split(fixture["plain_ids"], fixture["plain_ends"])
    plain = dict(zip(fixture["plain_index"].tolist(), differ, strict=True))
    wrong = [i for i, s in enumerate(strings) if encode(gemma3_tokenizer, s) != special[i]]
    assert not wrong, f"{len(wrong)} differ, first {strings[wrong[0]]!r}"
    mine = [encode(gemma3_tokenizer, s, special=False) for s in strings]
    wrong = [i for i in range(len(strings)) if mine[i] != plain.get(i, special[i])]
    assert not wrong, f"{len(wrong)} differ with special=False, first {strings[wrong[0]]!r}"
    assert len(plain) > 0  # the modes do differ somewhere: the comparison saw control-token text


@pytest.mark.slow
def test_gemma3_decodes_what_it_encodes(gemma3_tokenizer):
    """decode(encode(s)) == s, except that a literal U+2581 comes back as a space (922 of the
    strings have one): SentencePiece writes a space as U+2581, so the two are the same token
    (llama.cpp's ids agree) and no decoder can tell them apart."""
    assert gemma3_tokenizer.encode("a\u2581b") == gemma3_tokenizer.encode("a b")
    for _, s in spm_strings():
        ids = gemma3_tokenizer.encode(s, add_bos=False)
        s = s.replace(SPACE, " ")
        assert gemma3_tokenizer.decode(ids) == s
        assert b"".join(gemma3_tokenizer.token_bytes(i) for i in ids) == s.encode()


@pytest.mark.slow
def test_gemma3_streams_characters_split_into_byte_tokens(gemma3_tokenizer):
    text = "東京 \u0378𠀋🫠 ok"  # an unassigned code point and a rare CJK one have no piece: bytes
    ids = gemma3_tokenizer.encode(text, add_bos=False)
    byte_tokens = [i for i in ids if gemma3_tokenizer.token_text(i).startswith("<0x")]
    assert len(byte_tokens) >= 4
    stream = gemma3_tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 2  # held back until the character was whole

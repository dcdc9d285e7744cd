"""Tokenizer and chat template rebuilt from GGUF metadata.

Encoding is HF `tokenizers` (a BPE model from the file's vocabulary and merges, or for a
SentencePiece-style vocabulary from its scores: pipeline/model/spm_vocab.py),
streaming decoding is its `DecodeStream` (it holds bytes back until they form whole
UTF-8 characters), and chat templates render with jinja2 configured the way
transformers' `apply_chat_template` configures it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pipeline.model.errors import ModelFileError
from pipeline.model.spm_vocab import SPACE, build_spm_tokenizer, spm_flag
from pipeline.model.tool_templates import renders_hermes_tools

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), _byte_level(False)]
    )


# Texts longer than this are encoded with the GIL released (`encode_batch` of one text), so an
# orchestrator tokenizing a long prompt in a worker thread keeps its event loop, and every other
# stream, running (1 MB takes about 0.8 s). Shorter ones take the cheaper `encode`.
GIL_FREE_CHARS = 16384

# llama.cpp's `tokenizer.ggml.pre` names -> the pre-tokenizer that reproduces them.
PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level(True)]
    ),
    "gpt2": lambda: _byte_level(True),
    "default": lambda: _byte_level(True),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


def build_hf_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """A `tokenizers.Tokenizer` equivalent to the one the GGUF describes."""
    kind = meta["tokenizer.ggml.model"]
    if kind == "llama":
        return build_spm_tokenizer(meta)
    if kind != "gpt2":
        supported = "byte-level BPE 'gpt2', SentencePiece-style 'llama'"
        raise ModelFileError(f"unsupported tokenizer model {kind!r} (supported: {supported})")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ModelFileError(f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(PRE_TOKENIZERS)})")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"] or []]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(tokens[i], special=True) for i, t in enumerate(types) if t == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False) for i, t in enumerate(types) if t == USER_DEFINED])
    return tok


# A base model (Gemma 3 270M) has no template: chat messages are refused with this, in one line
# from the CLI (`--chat`, `--messages`) and as a 400 from the gateway's chat and responses APIs.
NO_CHAT_TEMPLATE = (
    "this model has no chat template (it is a base model, which continues plain text): give it a "
    "prompt to complete (no --chat or --messages; /v1/completions over HTTP), not chat messages"
)


class NoChatTemplate(ValueError):
    """Chat messages for a model without a chat template; a ValueError, as every refused prompt is."""


class Tokenizer:
    """Text <-> ids for one model, plus its chat template and special ids."""

    def __init__(self, hf: HFTokenizer, info: dict[str, Any]) -> None:
        self.hf = hf
        self.bos_id: int | None = info.get("bos_id")
        self.eos_id: int | None = info.get("eos_id")
        self.add_bos: bool = bool(info.get("add_bos"))
        self.add_eos: bool = bool(info.get("add_eos"))
        # How a token's text stands for bytes: "byte_level" (GPT-2's alphabet) or "sentencepiece"
        # (U+2581 for a space, <0xNN> byte tokens). Caches written before the key existed are byte-level.
        self.pieces: str = info.get("pieces", "byte_level")
        self.chat_template: str | None = info.get("chat_template")
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._added_tokens: dict[int, str] | None = None  # special and user-defined tokens, by id

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        return cls(build_hf_tokenizer(meta), _info_from_metadata(meta))

    @classmethod
    def from_json(cls, tokenizer_json: str, info_json: str) -> Tokenizer:
        return cls(HFTokenizer.from_str(tokenizer_json), json.loads(info_json))

    def to_json(self) -> tuple[str, str]:
        info = {
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "pieces": self.pieces,
            "chat_template": self.chat_template,
        }
        return self.hf.to_str(), json.dumps(info)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Control-token text in `text` is parsed as those tokens (a rendered chat template is
        text), as llama.cpp's `tokenize(..., special=True)` parses it. `add_bos` None adds what the
        file asks for (its BOS, and its EOS where `add_eos_token` is set), as llama.cpp does with
        `add_special`; True or False decides the BOS alone."""
        if len(text) > GIL_FREE_CHARS:  # the same ids; `encode` would hold the GIL throughout
            ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if add_bos is None and self.add_eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.hf.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. Byte-level BPE splits UTF-8 characters across tokens,
        so a token's text alone can be a lone part of a character; its bytes are exact (what
        llama-server's `/tokenize` with `with_pieces` shows for such a piece)."""
        added = self._added().get(token_id)
        if added is not None:
            return added.encode()
        if self.pieces == "sentencepiece":
            return _sentencepiece_bytes(self.token_text(token_id))
        return bytes(_BYTE_OF_CHAR[char] for char in self.token_text(token_id))

    def _added(self) -> dict[int, str]:
        if self._added_tokens is None:
            self._added_tokens = {i: t.content for i, t in self.hf.get_added_tokens_decoder().items()}
        return self._added_tokens

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:  # fmt: skip
        """The prompt the model's template makes of `messages`. With `tools` (only where
        `renders_tools`), the messages are OpenAI-shaped, tool calls and results included, and the
        template renders the tools itself (`tool_templates`)."""
        if not self.chat_template:
            raise NoChatTemplate(NO_CHAT_TEMPLATE)
        # A structured assistant turn that only calls tools has no content (OpenAI's null).
        contents = (str, type(None)) if tools is not None else str
        for m in messages:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), contents)
            ):
                raise ValueError('each chat message must be an object {"role": str, "content": str}')
        if tools is not None and not self.renders_tools:
            raise ValueError("this model's chat template does not render tools")
        return self._chat_template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
            eos_token=self.token_text(self.eos_id) if self.eos_id is not None else "",
            **({"tools": tools} if tools is not None else {}),
        )

    @functools.cached_property
    def _chat_template(self) -> jinja2.Template:
        """Compiled once: compiling it cost every chat request 1.5 ms of the orchestrator's CPU before
        its prefill could start, a hundred times the render. A compiled Jinja template renders safely from
        several admission threads at once."""
        return _chat_environment().from_string(self.chat_template)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tools in the call format the server constrains: a parse
        of the template, made once (admission asks for every tool request, and the template is fixed)."""
        return renders_hermes_tools(self.chat_template)

    def stream(self, *, skip_special: bool = False) -> TextStream:
        return TextStream(self, skip_special)


class TextStream:
    """Turns ids into text as they arrive, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool) -> None:
        self._hf = tokenizer.hf
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._hf, token_id) or ""


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's `bytes_to_unicode`), reversed:
    printable Latin-1 bytes stand for themselves, the other 68 are shifted past U+00FF."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


def _sentencepiece_bytes(piece: str) -> bytes:
    """<0xNN> is the byte NN; elsewhere U+2581 is a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(SPACE, " ").encode()


def _info_from_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_id": meta.get("tokenizer.ggml.eos_token_id"),
        "add_bos": spm_flag(meta, "tokenizer.ggml.add_bos_token")
        if meta.get("tokenizer.ggml.model") == "llama"
        else bool(meta.get("tokenizer.ggml.add_bos_token")),
        "add_eos": bool(meta.get("tokenizer.ggml.add_eos_token")),
        "pieces": "sentencepiece" if meta.get("tokenizer.ggml.model") == "llama" else "byte_level",
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    """transformers' `tojson`: plain JSON in the given key order. Jinja's own escapes <, > and & and
    sorts keys, so a tool's schema would reach the model unlike the text it was trained on."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _chat_environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env

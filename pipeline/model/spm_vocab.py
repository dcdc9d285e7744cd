"""A SentencePiece-style ('llama') GGUF vocabulary rebuilt as an HF `tokenizers` BPE model.

llama.cpp's SPM tokenizer starts from the UTF-8 characters of each stretch of text between special
tokens (spaces escaped to U+2581, a space prepended first when the file says `add_space_prefix`),
then repeatedly merges the adjacent pair whose concatenation is a token with the highest score,
the leftmost on ties; a final symbol that is no token becomes its byte tokens <0xNN>.

That is a BPE whose merges are every split of every token into two tokens, ranked by the merged
token's score: what HF's own SentencePiece converter builds, and what this module builds, so the
merge loop is the `tokenizers` library's, not ours. Every token type takes part in the merges (as
llama.cpp's `text_to_token` looks up any token). Control tokens are special added tokens (matched
when a prompt is encoded, skippable when decoding); user-defined ones ("\\n", runs of spaces, HTML
tags) are plain added tokens, always matched: both on the raw text, before spaces are escaped, as
llama.cpp's partition matches them. Ties between two different merges with the same score are
ranked by token ids where llama.cpp takes the leftmost: the agreement test on 10,000 strings
(tests/test_spm_tokenizer.py) is what says that never showed.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from pipeline.model.errors import ModelFileError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
SPACE = "\u2581"  # SentencePiece's whitespace marker

# Tokens llama.cpp makes control tokens by their text whatever the file says (its end-of-generation
# list in llama-vocab.cpp, 0.3.36): with special-token parsing off they are text, not tokens.
# Gemma 3 marks "</s>" user-defined; llama.cpp keeps it normal only beside these markers.
# fmt: off
CONTROL_LOOKING = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
# fmt: on
NORMAL_S_MARKERS = ("<|tool_response>", "<|plamo:eos|>")


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens whose concatenation is a token, best merged score first
    (ties: by the merged token's id, then the left token's)."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int]] = []
    for merged, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left = ids.get(token[:cut])
            if left is None:
                continue
            right = ids.get(token[cut:])
            if right is not None:
                ranked.append((-scores[merged], merged, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, _, left, right in ranked]


def build_spm_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """The `tokenizers.Tokenizer` that tokenizes as llama.cpp does with this SPM vocabulary."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelFileError("a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    known = set(tokens)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in known]
    if missing:
        raise ModelFileError(f"a SentencePiece vocabulary needs all 256 byte tokens ({missing[0]} is absent)")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=spm_merges(tokens, [float(s) for s in scores]),
        byte_fallback=True,
        unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
    )
    tok = HFTokenizer(model)
    escape = normalizers.Replace(" ", SPACE)
    space_prefix = spm_flag(meta, "tokenizer.ggml.add_space_prefix")
    if space_prefix:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape])
    else:
        tok.normalizer = escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the prefix space encoding added
    tok.decoder = decoders.Sequence(steps)
    added = _added_tokens(tokens, types)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i, s in added if s])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, s in added if not s])
    return tok


def spm_flag(meta: dict[str, Any], key: str) -> bool:
    """add_space_prefix or add_bos_token of an SPM vocabulary: the file's value, else llama.cpp's
    SPM default, on (llama-vocab.cpp; files converted before the keys existed carry neither)."""
    value = meta.get(key)
    return True if value is None else bool(value)


def _added_tokens(tokens: list[str], types: list[int]) -> list[tuple[int, bool]]:
    """(id, special) of the tokens matched before the merges: control and unknown ones are special,
    user-defined ones are not, and any with a control-looking text is special (llama.cpp adds the
    control attribute to them, whatever their type)."""
    control_looking = set(CONTROL_LOOKING)
    known = set(tokens)
    if any(marker in known for marker in NORMAL_S_MARKERS):
        control_looking.discard("</s>")
    kinds = {CONTROL: True, UNKNOWN: True, USER_DEFINED: False}
    return [
        (i, kinds.get(t, False) or tokens[i] in control_looking)
        for i, t in enumerate(types)
        if t in kinds or tokens[i] in control_looking
    ]

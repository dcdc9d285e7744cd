"""The orchestrator's answers to `Tokenize` and `Detokenize`: the served model's tokenizer and chat
template, as a client sees them through the HTTP API's `/tokenize` and `/detokenize`.

The orchestrator answers because it is what tokenizes every prompt (`admission.admit`): the ids
`/tokenize` returns for a text or a list of messages are exactly the prompt a completion of it
would be given, so its count is that completion's `usage.prompt_tokens`. Pure functions of the
message and the tokenizer, so the lane runs them in a worker thread like a Submit's tokenizing.
"""

from __future__ import annotations

from pipeline.model.tokenizer import Tokenizer
from pipeline.protocol.messages import Detokenize, ErrorReply, Text, Tokenize, Tokens


def tokenize(msg: Tokenize, tokenizer: Tokenizer, context_length: int) -> Tokens | ErrorReply:
    if (msg.text is None) == (msg.messages is None):
        return ErrorReply(
            kind="bad_request", message="give a text or a list of messages, not both or neither"
        )
    try:
        text = msg.text
        if msg.messages is not None:  # the chat template, as `admission.admit` renders it
            text = tokenizer.render_chat(msg.messages, add_generation_prompt=msg.add_generation_prompt)
        tokens = tokenizer.encode(text or "", add_bos=msg.add_special)  # None: as a prompt is encoded
    except (ValueError, KeyError, TypeError) as exc:  # a template that refuses these messages
        return ErrorReply(kind="bad_request", message=f"cannot build the prompt: {exc}")
    pieces = [tokenizer.token_bytes(t) for t in tokens] if msg.with_pieces else []
    return Tokens(tokens=tokens, pieces=pieces, context_length=context_length)


def detokenize(msg: Detokenize, tokenizer: Tokenizer) -> Text | ErrorReply:
    """Special tokens are kept in the text, as llama-server's `/detokenize` keeps them."""
    for index, token in enumerate(msg.tokens):
        if not 0 <= token < tokenizer.vocab_size:
            message = (
                f"tokens[{index}] = {token} is not a token id of this model (0..{tokenizer.vocab_size - 1})"
            )
            return ErrorReply(kind="bad_request", message=message)
    return Text(text=tokenizer.decode(msg.tokens))

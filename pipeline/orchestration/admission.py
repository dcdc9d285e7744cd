"""Whether a Submit can become a request, and with what: a pure function of the message,
the configured defaults and the served model."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.decoding.sampling import request_seed
from pipeline.decoding.session import PromptError, check_prompt
from pipeline.decoding.speculation import Speculation, SpeculationError
from pipeline.model.prompts import prompt_tokens
from pipeline.model.tokenizer import Tokenizer
from pipeline.protocol.messages import ErrorReply, Submit


@dataclass(frozen=True)
class Admitted:
    tokens: list[int]
    speculation: Speculation
    seed: int


def admit(
    msg: Submit, defaults: Speculation, tokenizer: Tokenizer, context_length: int, *, has_draft_model: bool
) -> Admitted | ErrorReply:
    try:
        speculation = defaults.overridden(drafter=msg.drafter, k=msg.k, max_iterations=msg.max_iterations)
    except SpeculationError as exc:
        return ErrorReply(kind="bad_request", message=str(exc))
    if speculation.drafter == "model" and not has_draft_model:
        return ErrorReply(
            kind="bad_request", message="the model drafter needs model.draft_path in the configuration"
        )
    try:
        tokens = prompt_tokens(tokenizer, msg.prompt, chat=msg.chat, messages=msg.messages)
    except (ValueError, KeyError, TypeError) as exc:
        return ErrorReply(kind="bad_request", message=f"cannot build the prompt: {exc}")
    try:
        check_prompt(tokens, context_length)
    except PromptError as exc:
        return ErrorReply(kind="prompt_too_long" if tokens else "bad_request", message=str(exc))
    seed = request_seed(msg.params.seed)
    return Admitted(tokens, speculation, seed)

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

# What a request keeps for as long as it is retained (`timeouts.retain` after it ends, however many
# there are): its key, owner and stop strings must be small, or a client that submits near-cap
# messages and cancels them holds megabytes per request in the orchestrator (issue 13).
MAX_KEY_CHARS = 256  # idempotency_key, owner ("gateway:<pid>")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


def oversized(msg: Submit) -> str | None:
    """Why a field the request would keep is too large to keep, if one is."""
    for name in ("idempotency_key", "owner"):
        if len(getattr(msg, name)) > MAX_KEY_CHARS:
            return f"{name} must be at most {MAX_KEY_CHARS} characters, got {len(getattr(msg, name))}"
    stop = msg.params.stop
    if len(stop) > MAX_STOP_STRINGS:
        return f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}"
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        return f"each stop string must be at most {MAX_STOP_CHARS} characters"
    return None


@dataclass(frozen=True)
class Admitted:
    tokens: list[int]
    speculation: Speculation
    seed: int


def admit(
    msg: Submit, defaults: Speculation, tokenizer: Tokenizer, context_length: int, *, has_draft_model: bool
) -> Admitted | ErrorReply:
    if (problem := oversized(msg)) is not None:
        return ErrorReply(kind="bad_request", message=problem)
    if msg.params.response_format is not None:  # the lanes do not apply grammars yet: refuse, never ignore
        return ErrorReply(
            kind="bad_request",
            message="response_format is not served by the pipeline yet (speclanes generate has it)",
        )
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

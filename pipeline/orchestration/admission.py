"""Whether a Submit can become a request, and with what: a pure function of the message,
the configured defaults and the served model."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.decoding.controls import vocabulary_problem
from pipeline.decoding.drafters.kinds import needs_draft_model, needs_head
from pipeline.decoding.grammar.format import ResponseFormatError
from pipeline.decoding.sampling import request_seed
from pipeline.decoding.session import PromptError, check_prompt
from pipeline.decoding.speculation import Speculation, SpeculationError
from pipeline.model.prompts import prompt_tokens
from pipeline.model.tokenizer import Tokenizer
from pipeline.observability.request_ids import CHOICE_ID
from pipeline.protocol.messages import ErrorReply, Submit

# What a request keeps for as long as it is retained (`timeouts.retain` after it ends, however many
# there are): its key, owner and stop strings must be small, or a client that submits near-cap
# messages and cancels them holds megabytes per request in the orchestrator (issue 13).
MAX_KEY_CHARS = 256  # idempotency_key, owner ("gateway:<pid>")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # token ids a logit_bias may name (a few hundred cover any practical use)
# A response_format's canonical JSON (a schema or grammar): as much as the stop strings may take.
# Realistic schemas are a few KiB; a 135M-parameter model follows nothing near this size.
MAX_FORMAT_CHARS = MAX_STOP_STRINGS * MAX_STOP_CHARS


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
    if len(msg.params.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, got {len(msg.params.logit_bias)}"
    if len(fmt := msg.params.response_format or "") > MAX_FORMAT_CHARS:
        return f"response_format must be at most {MAX_FORMAT_CHARS} characters of JSON here, got {len(fmt)}"
    return None


def requested_id_problem(msg: Submit) -> str | None:
    """A Submit may name its id only in the form of a choice's (`observability.request_ids`)."""
    if msg.request_id and not CHOICE_ID.fullmatch(msg.request_id):
        given = msg.request_id[:80]
        return f"request_id must be empty or 32 hex digits, '-' and a choice index; got {given!r}"
    return None


def request_tokens(msg: Submit, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: given as such, or built from the text or the chat messages (a tool
    request's structured turns where the model's template renders tools itself). ValueError says
    why there are none."""
    if msg.prompt_token_ids is None:
        if msg.tools is not None and msg.tool_messages is not None and tokenizer.renders_tools:
            return tokenizer.encode(tokenizer.render_chat(msg.tool_messages, tools=msg.tools))
        return prompt_tokens(tokenizer, msg.prompt, chat=msg.chat, messages=msg.messages)
    if msg.prompt is not None or msg.messages is not None or msg.chat:
        raise ValueError("give the prompt as text, chat messages or token ids, not several")
    vocab = tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in msg.prompt_token_ids):
        raise ValueError(f"a prompt token id is outside the vocabulary [0, {vocab})")
    return list(msg.prompt_token_ids)


def format_problem(response_format: str | None, tokenizer: Tokenizer) -> str | None:
    """Why the grammar library refuses the request's format (a schema it cannot follow), if it does:
    compiled once here, so the client hears it as a 400 before the request is admitted rather than
    as a failure from a lane. The lanes compile the same text again (cached per process)."""
    if response_format is None:
        return None
    from pipeline.decoding.grammar.compiler import compile_format  # llguidance loads only when used

    try:
        compile_format(tokenizer, response_format, tokenizer.vocab_size)
    except ResponseFormatError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class Admitted:
    tokens: list[int]
    speculation: Speculation
    seed: int


def admit(
    msg: Submit, defaults: Speculation, tokenizer: Tokenizer, context_length: int, *, has_draft_model: bool,
    has_head: bool = False,
) -> Admitted | ErrorReply:  # fmt: skip
    if (problem := oversized(msg) or requested_id_problem(msg)) is not None:
        return ErrorReply(kind="bad_request", message=problem)
    try:
        speculation = defaults.overridden(drafter=msg.drafter, k=msg.k, max_iterations=msg.max_iterations)
    except SpeculationError as exc:
        return ErrorReply(kind="bad_request", message=str(exc))
    if needs_draft_model(speculation.drafter) and not has_draft_model:
        return ErrorReply(
            kind="bad_request",
            message=f"the {speculation.drafter} drafter needs model.draft_path in the configuration",
        )
    if needs_head(speculation.drafter) and not has_head:
        return ErrorReply(
            kind="bad_request",
            message=f"the {speculation.drafter} drafter needs a draft head trained for this model: none is "
            "configured (model.draft_head) or found (`speclanes drafter train` makes one)",
        )
    try:
        tokens = request_tokens(msg, tokenizer)
    except (ValueError, KeyError, TypeError) as exc:
        return ErrorReply(kind="bad_request", message=f"cannot build the prompt: {exc}")
    if (problem := vocabulary_problem(msg.params, tokenizer.vocab_size)) is not None:
        return ErrorReply(kind="bad_request", message=problem)
    if (problem := format_problem(msg.params.response_format, tokenizer)) is not None:
        return ErrorReply(kind="bad_request", message=problem)
    try:
        check_prompt(tokens, context_length)
    except PromptError as exc:
        return ErrorReply(kind="prompt_too_long" if tokens else "bad_request", message=str(exc))
    seed = request_seed(msg.params.seed)
    return Admitted(tokens, speculation, seed)

"""Turning what a user typed (text, one chat turn, or a messages file) into prompt ids."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.model.tokenizer import Tokenizer


def load_messages(path: str | Path) -> list[dict[str, str]]:
    try:
        messages = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read messages from {path}: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{path} must hold a non-empty JSON list of {{'role', 'content'}} objects")
    return messages


def prompt_tokens(
    tokenizer: Tokenizer,
    prompt: str | None,
    *,
    chat: bool = False,
    messages: list[dict[str, str]] | None = None,
) -> list[int]:
    if messages is not None and prompt is not None:
        raise ValueError("give either a PROMPT or --messages, not both")
    if messages is None and chat:
        if prompt is None:
            raise ValueError("--chat needs a PROMPT")
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        return tokenizer.encode(tokenizer.render_chat(messages))
    if prompt is None:
        raise ValueError("give a PROMPT (or --messages FILE)")
    return tokenizer.encode(prompt)

"""The text a tool call is written as, the grammar that makes the model write exactly that, and the
parser that reads it back, whole or as it streams.

One call is the block Hermes-style and Qwen models emit (and which the fallback prompt teaches,
api/chat_messages.py):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are blocks joined by a newline. The head up to the arguments is fixed text in the grammar
and the arguments are `%json` of the function's schema with fixed separators, so the parser never
guesses: it reads the name, then the arguments up to the brace that closes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.api.errors import ApiError
from pipeline.api.tools import FunctionDef, ToolPlan, arguments_schema
from pipeline.decoding.grammar.compiler import JSON_OPTIONS
from pipeline.decoding.grammar.format import parse_response_format
from pipeline.observability.request_ids import request_key

OPEN = '<tool_call>\n{"name": "'
MID = '", "arguments": '
CLOSE = "}\n</tool_call>"
SEP = "\n"
# The most calls one answer holds. A small model can repeat a call for ever; with no max_tokens (the
# default) it would run to the end of its context, so the grammar ends the answer here instead.
MAX_CALLS = 16
START = OPEN.split("\n")[0]  # what marks an answer that calls, rather than text
# The parser's states after each fixed piece of text.
NEXT = {"open": "name", "mid": "args", "close": "between", "between": "open"}


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (and as an earlier call is shown to it in the history)."""
    return f"{OPEN}{name}{MID}{arguments}{CLOSE}"


def _rule(function: FunctionDef, index: int) -> list[str]:
    schema = arguments_schema(function) | {"x-guidance": JSON_OPTIONS}
    head, tail = json.dumps(f"{OPEN}{function.name}{MID}"), json.dumps(CLOSE)
    return [f"call_{index}: {head} args_{index} {tail}", f"args_{index}: %json {json.dumps(schema)}"]


def grammar(plan: ToolPlan, answer: dict[str, Any] | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of an answer under `plan`: calls of the allowed
    functions (one, or up to MAX_CALLS when parallel), or, for tool_choice auto, text that does not
    start like a call: JSON valid against `answer` where the request's response_format gives a schema."""
    rules = [line for i, function in enumerate(plan.allowed) for line in _rule(function, i)]
    call = " | ".join(f"call_{i}" for i in range(len(plan.allowed)))
    calls = f"call ({json.dumps(SEP)} call){{0,{MAX_CALLS - 1}}}" if plan.parallel else "call"
    if plan.choice != "auto":
        start, other = "calls", []
    elif answer is not None:  # JSON starts with "{", never like a call
        schema = json.dumps(answer | {"x-guidance": JSON_OPTIONS})
        start, other = "calls | answer", [f"answer: %json {schema}"]
    else:
        start, other = "calls | TEXT", [f"TEXT: /(?s:.+)/ & ~/{START}(?s:.*)/"]  # text that is not a call
    return "\n".join([f"start: {start}", f"calls: {calls}", f"call: {call}", *rules, *other]) + "\n"


def answer_schema(response_format: str | None, param: str) -> dict[str, Any] | None:
    """The schema a text answer beside tool calls follows: the request's json_schema, any object for
    json_object, None for free text. A grammar cannot be joined to the calls' grammar: a 400."""
    fmt = parse_response_format(response_format)
    if fmt is None:
        return None
    if fmt.kind == "grammar":
        message = f"{param} of type grammar cannot be combined with callable tools; give tool_choice none"
        raise ApiError(400, message, param=param)
    return dict(fmt.schema) if fmt.kind == "json_schema" else {"type": "object"}


@dataclass
class Call:
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class Delta:
    """What one piece of output adds: text, or a call's start (`name` set) or more of its arguments."""

    content: str = ""
    calls: list[tuple[int, str | None, str]] = field(default_factory=list)  # (index, name, arguments)


class CallParser:
    """Reads an answer as it comes. Under tool_choice auto the answer is text or calls, which its
    first characters tell (`START`); text is passed on at once unless it might still be that start."""

    def __init__(self, decided: bool) -> None:
        self.mode = "calls" if decided else "undecided"  # then "text" or "calls"
        self.state = "open"  # open, name, mid, args, close, between
        self.buffer = ""
        self.calls: list[Call] = []
        self._depth, self._in_string, self._escape = 0, False, False

    @property
    def complete(self) -> bool:
        """Every call written whole (an answer cut by max_tokens is not)."""
        return self.mode == "calls" and self.state == "between"

    def feed(self, text: str) -> Delta:
        self.buffer += text
        delta = Delta()
        if self.mode == "undecided":
            if self.buffer.startswith(START):
                self.mode = "calls"
            elif not START.startswith(self.buffer):
                self.mode = "text"
        if self.mode == "text":
            delta.content, self.buffer = self.buffer, ""
        elif self.mode == "calls":
            self._calls(delta)
        return delta

    def finish(self) -> Delta:
        """The end of the answer: text held back because it might have started a call is text."""
        if self.mode == "undecided":
            self.mode = "text"
            return self.feed("")
        return Delta()

    def _literal(self, literal: str) -> bool | None:
        """Consume `literal` if the buffer starts with it; None: not enough text yet."""
        if self.buffer.startswith(literal):
            self.buffer = self.buffer[len(literal) :]
            return True
        if literal.startswith(self.buffer):
            return None
        self.state = "broken"  # not the grammar's output (it was not constrained): parse no further
        return False

    def _calls(self, delta: Delta) -> None:
        while self.buffer and self.state != "broken":
            index = len(self.calls) - 1
            if self.state in ("open", "mid", "close", "between"):
                literal = {"open": OPEN, "mid": MID, "close": CLOSE, "between": SEP}[self.state]
                if not self._literal(literal):
                    return
                self.state = NEXT[self.state]
                if self.state == "between":
                    self.calls[index].complete = True
            elif self.state == "name":
                end = self.buffer.find('"')
                if end < 0:
                    return
                self.calls.append(Call(self.buffer[:end]))
                delta.calls.append((index + 1, self.buffer[:end], ""))
                self.buffer, self.state = self.buffer[end:], "mid"
            else:  # args
                taken = self._arguments()
                self.calls[index].arguments += taken
                if taken:
                    delta.calls.append((index, None, taken))

    def _arguments(self) -> str:
        """The arguments' characters in the buffer, up to the brace that closes them."""
        for i, char in enumerate(self.buffer):
            if self._in_string:
                self._escape, self._in_string = (False, True) if self._escape else (char == "\\", char != '"')
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    taken, self.buffer, self.state = self.buffer[: i + 1], self.buffer[i + 1 :], "close"
                    return taken
        taken, self.buffer = self.buffer, ""
        return taken


def parse(text: str, plan: ToolPlan) -> list[Delta]:
    """A whole answer, parsed as a stream of it would be."""
    parser = CallParser(decided=plan.choice == "required")
    return [parser.feed(text), parser.finish()]


def merged(deltas: Iterable[Delta]) -> Delta:
    """Several deltas as one, arguments of the same call joined."""
    out = Delta()
    for delta in deltas:
        out.content += delta.content
        for index, name, arguments in delta.calls:
            if out.calls and out.calls[-1][0] == index and name is None:
                last = out.calls[-1]
                out.calls[-1] = (index, last[1], last[2] + arguments)
            else:
                out.calls.append((index, name, arguments))
    return out


def call_id(response_id: str, index: int) -> str:
    """A call's id: the request's (what `audit show` takes), and the call's place in the answer."""
    return f"call_{request_key(response_id)}_{index}"


def arguments_object(arguments: Any) -> Any:
    """A call's arguments as JSON, or the text as given when it is not JSON (a client's history)."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments

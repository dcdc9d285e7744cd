"""The Responses API's answer: the response object, and the typed events a stream of it is made of.

A stream opens with `response.created` and `response.in_progress`. Text comes as a message item:
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` per
piece, then `.done` events in reverse order. A tool call is a `function_call` item: added, its
`response.function_call_arguments.delta` pieces, the arguments' `.done`, the item's `.done`. The
stream ends with `response.completed` (`response.incomplete` when max_output_tokens cut it), or an
`error` event when the pipeline failed. Each event is `event: <type>` and `data: <json>` with a
`sequence_number`, as OpenAI's; there is no `[DONE]`. Where the request asked for logprobs, each
text delta carries its tokens' entries and the output_text part holds them all (chat's entry shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.api import core, tool_calls
from pipeline.api.errors import ApiError
from pipeline.api.tools import ToolPlan
from pipeline.decoding.logprobs import TokenLogprobs
from pipeline.decoding.result import Result
from pipeline.observability.request_ids import RESPONSE_PREFIXES

_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class Echo:
    """The request's settings, which every response object repeats."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    metadata: dict[str, str] = field(default_factory=dict)
    top_logprobs: int | None = None


class ResponseFormatter(core.Formatter):
    """One response's object and events. The output items are built as the answer streams (and
    from the whole answer, the same way, for a response that is not streamed)."""

    chat_logprobs = True  # the Responses API's entries are chat's: token, logprob, bytes, top_logprobs

    def __init__(
        self, request_id: str, model: str, created: int, prompt_tokens: int, *, echo: Echo,
        plan: ToolPlan | None = None, logprobs: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(RESPONSE_PREFIXES["responses"] + request_id, model, created, prompt_tokens, logprobs)
        self.entries: list[dict[str, Any]] = []  # logprobs whose text has not been sent yet
        self.request_id, self.echo = request_id, echo
        self.plan = plan if plan is not None and plan.calls else None
        decided = self.plan is not None and self.plan.choice == "required"
        self.parser = tool_calls.CallParser(decided) if self.plan is not None else None
        self.items: list[dict[str, Any]] = []  # the output so far
        self.sequence = 0

    # --- the response object -----------------------------------------------------------

    def _object(self, status: str, done: Result | None = None) -> dict[str, Any]:
        e = self.echo
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.items, "error": None, "incomplete_details": incomplete,
            "instructions": e.instructions, "max_output_tokens": e.max_output_tokens,
            "temperature": e.temperature, "top_p": e.top_p, "tools": e.tools, "tool_choice": e.tool_choice,
            "parallel_tool_calls": e.parallel_tool_calls, "text": {"format": e.text_format},
            "metadata": e.metadata, "store": False, "previous_response_id": None,
            "top_logprobs": e.top_logprobs,
            "usage": None if done is None else self._usage(done),
            **({"speculation": core.speculation_stats(done)} if done is not None else {}),
        }  # fmt: skip

    def _usage(self, done: Result) -> dict[str, Any]:
        output = len(done.tokens)
        return {
            "input_tokens": self.prompt_tokens, "output_tokens": output,
            "total_tokens": self.prompt_tokens + output,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }  # fmt: skip

    def _status(self, done: Result) -> str:
        return "incomplete" if self.finish_reason(done) == "length" else "completed"

    def response(self, done: Result) -> dict[str, Any]:
        """The whole response: the answer read as its stream would be, every item done."""
        self._hold(done.logprobs or ())
        self._read(done.text)
        self._end(done)
        return self._object(self._status(done), done)

    # --- building the output items -------------------------------------------------------

    def _read(self, text: str) -> list[dict[str, Any]]:
        """The events of a piece of the answer, the items updated."""
        if self.parser is None:
            return self._text(text) if text else []
        return self._pieces(self.parser.feed(text))

    def _pieces(self, delta: tool_calls.Delta) -> list[dict[str, Any]]:
        events = self._text(delta.content) if delta.content else []
        for index, name, arguments in delta.calls:
            if name is not None:
                events += self._call_added(index, name)
            item = self.items[-1]
            item["arguments"] += arguments
            if arguments:
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": len(self.items) - 1, "delta": arguments})  # fmt: skip
        return events

    def _call_added(self, index: int, name: str) -> list[dict[str, Any]]:
        events = self._close_last()
        item = {
            "type": "function_call", "id": f"fc_{self.request_id}_{index}", "status": "in_progress",
            "call_id": tool_calls.call_id(self.id, index), "name": name, "arguments": "",
        }  # fmt: skip
        self.items.append(item)
        return [
            *events,
            {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item},
        ]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.items or self.items[-1]["type"] != "message":
            item = {"type": "message", "id": f"msg_{self.request_id}", "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
            self.items.append(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            where = {"item_id": item["id"], "output_index": len(self.items) - 1}
            events += [
                {"type": "response.output_item.added", "output_index": where["output_index"], "item": item},
                {"type": "response.content_part.added", **where, "content_index": 0, "part": part},
            ]
            item["content"].append(dict(part))
        item = self.items[-1]
        item["content"][0]["text"] += text
        entries, self.entries = self.entries, []
        item["content"][0]["logprobs"] += entries
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [*events, {"type": "response.output_text.delta", **where, "delta": text, "logprobs": entries}]

    def _close_last(self, status: str = "completed") -> list[dict[str, Any]]:
        """The `.done` events of the last item, if it is still open."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = status
        if item["type"] == "function_call":
            done = {"type": "response.function_call_arguments.done", "item_id": item["id"],
                    "output_index": index, "arguments": item["arguments"]}  # fmt: skip
            return [done, {"type": "response.output_item.done", "output_index": index, "item": item}]
        part, where = item["content"][0], {"item_id": item["id"], "output_index": index, "content_index": 0}
        part["logprobs"] += self.entries  # tokens that added no text (the end of sequence)
        self.entries = []
        text_done = {"type": "response.output_text.done", **where, "text": part["text"]}
        return [
            text_done | {"logprobs": list(part["logprobs"])},
            {"type": "response.content_part.done", **where, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

    def _end(self, done: Result) -> list[dict[str, Any]]:
        """Held-back text, then every open item closed."""
        events = [] if self.parser is None else self._pieces(self.parser.finish())
        return events + self._close_last("completed" if self._status(done) == "completed" else "incomplete")

    # --- as Server-Sent Events ------------------------------------------------------------

    def _event(self, data: dict[str, Any]) -> bytes:
        data = data | {"sequence_number": self.sequence}
        self.sequence += 1
        return b"event: " + data["type"].encode() + b"\ndata: " + _json.encode(data) + b"\n\n"

    def stream_opening(self) -> list[bytes]:
        return [
            self._event({"type": kind, "response": self._object("in_progress")})
            for kind in ("response.created", "response.in_progress")
        ]

    def _hold(self, logprobs: Sequence[TokenLogprobs]) -> None:
        """Entries wait for the text delta they belong to (text may be held back for a stop string)."""
        found = self._logprobs(logprobs)
        self.entries += found["content"] if found else []

    def stream_text(self, text: str, logprobs: Sequence[TokenLogprobs], decided: str) -> list[bytes]:
        self._hold(logprobs)
        return [self._event(e) for e in self._read(text)]

    def stream_closing(self, done: Result, include_usage: bool) -> list[bytes]:
        events = [self._event(e) for e in self._end(done)]
        status = self._status(done)
        return [*events, self._event({"type": f"response.{status}", "response": self._object(status, done)})]

    def stream_error(self, error: ApiError) -> list[bytes]:
        body = error.body()["error"]
        return [
            self._event(
                {"type": "error", "code": body["code"], "message": body["message"], "param": body["param"]}
            )
        ]

    stream_end = b""

"""A request's structured-output format as OpenAI's `response_format` spells it, checked without
the grammar library.

`SamplingParams` is a frozen msgspec struct that crosses the wire, so it cannot hold a compiled
grammar: it carries the format as canonical JSON text, and whichever side needs a matcher compiles
that text (`compiler.compile_format`, cached). Checking the shape here, with no tokenizer, lets
every front (CLI, HTTP, the orchestrator) refuse a malformed format before any lane sees it.

Accepted shapes:
- {"type": "text"}: no constraint (normalised to None);
- {"type": "json_object"}: any JSON object;
- {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}: JSON that
  validates against the schema (always enforced: `strict` is accepted and changes nothing);
- {"type": "grammar", "grammar": "<Lark or GBNF text>"}: this server's extension, for output that
  is not JSON (the grammar library tells the two syntaxes apart).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# A schema or grammar this long is already far beyond what a 135M-parameter model can follow; the bound
# keeps every message that carries SamplingParams small.
MAX_FORMAT_CHARS = 65536
KINDS = ("json_object", "json_schema", "grammar")


class ResponseFormatError(ValueError):
    """A response_format that is malformed, too large, or that the grammar library refuses. The
    message starts with "response_format", the field's name (fronts use the first word as `param`)."""


@dataclass(frozen=True)
class ResponseFormat:
    kind: Literal["json_object", "json_schema", "grammar"]
    schema: dict[str, Any] = field(default_factory=dict)  # json_schema: the schema to validate against
    grammar: str = ""  # grammar: the Lark or GBNF text
    name: str = ""  # json_schema: the schema's name (informational)


def _fail(message: str) -> ResponseFormatError:
    return ResponseFormatError(f"response_format {message}")


def _as_mapping(value: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(value, str):
        if len(value) > MAX_FORMAT_CHARS:
            raise _fail(f"must be at most {MAX_FORMAT_CHARS} characters of JSON, got {len(value)}")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise _fail(f"is not valid JSON ({exc})") from None
    if not isinstance(value, Mapping):
        raise _fail('must be an object such as {"type": "json_object"}')
    return value


def _json_schema(spec: Any) -> ResponseFormat:
    if not isinstance(spec, Mapping):
        raise _fail('json_schema needs "json_schema": {"name": ..., "schema": {...}}')
    schema, name = spec.get("schema"), spec.get("name", "")
    if not isinstance(schema, Mapping):
        raise _fail("json_schema.schema must be a JSON Schema object")
    if not isinstance(name, str):
        raise _fail("json_schema.name must be a string")
    if not isinstance(spec.get("strict", False), bool | None):
        raise _fail("json_schema.strict must be true or false")
    return ResponseFormat("json_schema", schema=dict(schema), name=name)


def parse_response_format(value: str | Mapping[str, Any] | None) -> ResponseFormat | None:
    """The format a request asks for, or None for unconstrained text; ResponseFormatError if malformed."""
    if value is None:
        return None
    spec = _as_mapping(value)
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        return _json_schema(spec.get("json_schema"))
    if kind == "grammar":
        grammar = spec.get("grammar")
        if not isinstance(grammar, str) or not grammar.strip():
            raise _fail('grammar needs "grammar": "<Lark or GBNF text>"')
        return ResponseFormat("grammar", grammar=grammar)
    raise _fail(f"type must be one of text, {', '.join(KINDS)}; got {kind!r}")


def canonical_response_format(value: str | Mapping[str, Any] | None) -> str | None:
    """The JSON text `SamplingParams.response_format` holds (None: unconstrained). One format has one
    text, so compiled grammars can be cached by it."""
    fmt = parse_response_format(value)
    if fmt is None:
        return None
    if fmt.kind == "json_schema":
        spec: dict[str, Any] = {"type": fmt.kind, "json_schema": {"name": fmt.name, "schema": fmt.schema}}
    elif fmt.kind == "grammar":
        spec = {"type": fmt.kind, "grammar": fmt.grammar}
    else:
        spec = {"type": fmt.kind}
    text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_FORMAT_CHARS:
        raise _fail(f"must be at most {MAX_FORMAT_CHARS} characters of JSON, got {len(text)}")
    return text

"""Realistic JSON schemas for structured output: the grammar libraries were measured on them
(ops/bench/grammar_libraries.py), `speclanes bench structured` runs them, and the tests use them
(tests/grammar_cases.py adds a valid document for each).

PERSON has a pattern, bounds and a nested object; ORDER an array of objects, an enum and a nullable
field; TOOL_CALL `$defs`, `anyOf`, `const` and a `maxLength`; CITY and REVIEW are plain records.
"""

from __future__ import annotations

from typing import Any

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "address"],
    "additionalProperties": False,
}

ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["order_id", "status", "items", "note"],
    "additionalProperties": False,
}

TOOL_CALL: dict[str, Any] = {
    "$defs": {
        "search": {
            "type": "object",
            "properties": {"tool": {"const": "search"}, "query": {"type": "string"}},
            "required": ["tool", "query"],
            "additionalProperties": False,
        },
        "weather": {
            "type": "object",
            "properties": {
                "tool": {"const": "weather"},
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["tool", "city", "unit"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "thought": {"type": "string", "maxLength": 200},
        "call": {"anyOf": [{"$ref": "#/$defs/search"}, {"$ref": "#/$defs/weather"}]},
    },
    "required": ["thought", "call"],
    "additionalProperties": False,
}

CITY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "country", "population", "landmarks"],
    "additionalProperties": False,
}

REVIEW: dict[str, Any] = {
    "type": "object",
    "properties": {
        "product": {"type": "string"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "cons": {"type": "array", "items": {"type": "string"}},
        "recommended": {"type": "boolean"},
    },
    "required": ["product", "rating", "pros", "cons", "recommended"],
    "additionalProperties": False,
}


def bounded(schema: Any, chars: int = 24, items: int = 2) -> Any:
    """`schema` narrowed to what a small model can finish within a modest max_tokens: strings at most
    `chars` long, arrays at most `items` long, integers and numbers below a million, numbers in
    quarters (a binary fraction, so `jsonschema`'s float check of `multipleOf` is exact). Sampling at
    a temperature, a 135M model can otherwise write one string (or the digits of one number) until
    max_tokens, and output cut there does not parse. Every document valid under the bounded schema
    is valid under `schema`."""
    if isinstance(schema, list):
        return [bounded(item, chars, items) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded(value, chars, items) for key, value in schema.items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "string" in kinds:
        out["maxLength"] = min(out.get("maxLength", chars), chars)
    if "array" in kinds:
        out["maxItems"] = min(out.get("maxItems", items), items)
    if "integer" in kinds or "number" in kinds:
        out["maximum"] = min(out.get("maximum", 999_999), 999_999)
    if "number" in kinds:
        out.setdefault("multipleOf", 0.25)
    return out

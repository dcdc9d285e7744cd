"""Realistic JSON schemas with one valid document each: shared by the grammar tests and by
ops/bench/grammar_libraries.py (which measured the libraries on them). `json_object` is any
object: the `response_format` {"type": "json_object"}."""

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

SCHEMAS: dict[str, dict[str, Any] | None] = {
    "json_object": None,
    "person": PERSON,
    "order": ORDER,
    "tool_call": TOOL_CALL,
}

DOCUMENTS: dict[str, Any] = {
    "json_object": {"title": "Notes", "count": 3, "done": False, "items": [1.5, "two", None, {"k": "v"}]},
    "person": {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.org",
        "tags": ["math", "engines"],
        "address": {"city": "London", "zip": "12345"},
    },
    "order": {
        "order_id": "ORD-004217",
        "status": "shipped",
        "items": [
            {"sku": "A-1", "quantity": 2, "unit_price": 9.5},
            {"sku": "B-22", "quantity": 1, "unit_price": 120.0},
        ],
        "note": None,
    },
    "tool_call": {
        "thought": "The user asks about the weather, so I call the weather tool.",
        "call": {"tool": "weather", "city": "Paris", "unit": "celsius"},
    },
}

"""Realistic JSON schemas (from `pipeline.bench.schemas`) with one valid document each: shared by
the grammar tests and by ops/bench/grammar_libraries.py (which measured the libraries on them).
`json_object` is any object: the `response_format` {"type": "json_object"}."""

from __future__ import annotations

from typing import Any

from pipeline.bench.schemas import CITY, ORDER, PERSON, REVIEW, TOOL_CALL, bounded

__all__ = ["CITY", "DOCUMENTS", "ORDER", "PERSON", "REVIEW", "SCHEMAS", "TOOL_CALL", "bounded"]

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

"""Tool calling as a request asks for it: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`,
and the legacy `functions` and `function_call`, which take the same path (answered in their own
legacy shape). The result is a `ToolPlan`: the functions the prompt offers, the ones a call may
name, and whether the model must call, may call, or must not.

Calls are constrained, never hoped for: the plan becomes a grammar (api/tool_calls.py) that the
pipeline enforces like any `response_format`, so every call parses and its arguments validate against
the function's schema, and speculation keeps outputs identical (the grammar machinery's guarantee).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from pipeline.api.errors import ApiError

# OpenAI's rule for function names; it also keeps a name safe inside the call grammar's literals.
NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128  # OpenAI's limit
Choice = Literal["none", "auto", "required"]


class FunctionDef(msgspec.Struct, kw_only=True):
    """A function the model may call: its name, what it does, and a JSON Schema of its arguments."""

    name: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; calls always validate against the schema here


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDef


class FunctionName(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionName


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields come to. `offered`: described in the prompt; `allowed`: what a
    call may name; `choice`: "auto" (text or calls), "required" (calls), "none" (text only)."""

    offered: tuple[FunctionDef, ...]
    allowed: tuple[FunctionDef, ...]
    choice: Choice
    parallel: bool  # more than one call in an answer
    legacy: bool  # asked with `functions`: answered with `function_call`
    named: str | None = None  # the one function a named tool_choice forces

    @property
    def calls(self) -> bool:
        """Whether the answer may hold calls (so the output is constrained and parsed)."""
        return self.choice != "none" and bool(self.allowed)


def arguments_schema(function: FunctionDef, param: str = "tools") -> dict[str, Any]:
    """The JSON Schema a call's arguments validate against: always an object (OpenAI's rule; it also
    tells where the arguments end while they stream). No parameters: an object of anything."""
    schema = dict(function.parameters or {})
    if schema.get("type", "object") != "object":
        raise ApiError(
            400, f"function {function.name}: parameters must be a JSON Schema of an object",
            param=param, code="invalid_function_parameters",
        )  # fmt: skip
    return {"type": "object", **schema}


def _functions(
    tools: list[Tool] | None, functions: list[FunctionDef] | None
) -> tuple[list[FunctionDef], bool]:
    if tools and functions:
        raise ApiError(400, "give tools or the legacy functions, not both", param="functions")
    if functions:
        return functions, True
    defs = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise ApiError(
                400, f"tools.{i}.type: {tool.type!r} tools are not supported (only 'function')",
                param=f"tools.{i}.type", code="unsupported_parameter",
            )  # fmt: skip
        defs.append(tool.function)
    return defs, False


def _choice(value: Any, legacy: bool) -> Choice | str:
    """ "none", "auto", "required", or the name of the one function to call."""
    param = "function_call" if legacy else "tool_choice"
    if value is None:
        return "auto"
    if value in ("none", "auto") or (value == "required" and not legacy):
        return value  # type: ignore[no-any-return]
    try:
        if legacy:
            return msgspec.convert(value, FunctionName).name
        named = msgspec.convert(value, NamedToolChoice)
    except msgspec.ValidationError:
        shapes = '"none", "auto" or {"name": ...}' if legacy else (
            '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )  # fmt: skip
        raise ApiError(400, f"{param} must be {shapes}", param=param) from None
    if named.type != "function":
        raise ApiError(400, f"{param}.type must be 'function'", param=param)
    return named.function.name


def plan(
    tools: list[Tool] | None, tool_choice: Any, parallel: bool | None,
    functions: list[FunctionDef] | None = None, function_call: Any = None,
) -> ToolPlan | None:  # fmt: skip
    """The plan for a request's tool fields; None when it offers no tools (then tool_choice may
    only say none, as OpenAI's rule is)."""
    defs, legacy = _functions(tools, functions)
    if function_call not in (None, "none") and not legacy:
        raise ApiError(400, "function_call needs functions to choose from", param="function_call")
    if legacy and tool_choice is not None:
        raise ApiError(400, "give tool_choice with tools, function_call with functions", param="tool_choice")
    param = "function_call" if legacy else "tool_choice"
    choice = _choice(function_call if legacy else tool_choice, legacy)
    if not defs:
        if (function_call if legacy else tool_choice) not in (None, "none"):
            raise ApiError(400, f"{param} needs tools to choose from", param=param)
        return None
    field = "functions" if legacy else "tools"
    if len(defs) > MAX_TOOLS:
        raise ApiError(400, f"at most {MAX_TOOLS} tools, got {len(defs)}", param=field)
    if len({d.name for d in defs}) < len(defs):
        raise ApiError(400, "two tools have the same name", param=field)
    for d in defs:
        arguments_schema(d, field)
    allowed, named = defs, None
    if choice not in ("none", "auto", "required"):
        allowed, named = [d for d in defs if d.name == choice], choice
        if not allowed:
            raise ApiError(400, f"{param} names {choice!r}, which is not among the tools", param=param)
        choice = "required"
    single = legacy or parallel is False or named is not None  # a forced function is called once
    return ToolPlan(tuple(defs), tuple(allowed), choice, not single, legacy, named)  # type: ignore[arg-type]


def function_spec(function: FunctionDef) -> dict[str, Any]:
    """One function as a prompt shows it: its name, description and the schema of its arguments."""
    spec: dict[str, Any] = {"name": function.name}
    if function.description:
        spec["description"] = function.description
    spec["parameters"] = arguments_schema(function)
    return spec


def describe(function: FunctionDef) -> str:
    """One function as the fallback prompt shows it: compact JSON of `function_spec`."""
    return json.dumps(function_spec(function), ensure_ascii=False)

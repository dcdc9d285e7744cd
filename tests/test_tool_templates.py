"""Tools through a model's own chat template (model/tool_templates.py): where the template renders
tools in the Hermes `<tool_call>` format, admission renders the structured conversation through it;
elsewhere, the fallback messages. Checked on the prompt text admission builds from a real chat body."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.api import chat
from pipeline.api.tool_calls import call_text
from pipeline.model.tokenizer import Tokenizer
from pipeline.model.tool_templates import renders_hermes_tools
from pipeline.orchestration.admission import request_tokens

HERMES_TEMPLATE = (Path(__file__).parent / "fixtures" / "hermes_tools_template.jinja").read_text()
WEATHER = {
    "name": "get_weather",
    "description": "Weather <now> in a city, °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "user", "content": "And in Rome?"},
]  # fmt: skip


def with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    info = {
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "add_bos": False,
        "chat_template": template,
    }
    return Tokenizer(tokenizer.hf, info)


def prompt_text(tokenizer: Tokenizer, **fields: object) -> str:
    body = {"model": "m", "messages": HISTORY, "tools": [{"type": "function", "function": WEATHER}], **fields}
    submit = chat.to_submit(chat.decode(json.dumps(body).encode()), "m")
    return tokenizer.decode(request_tokens(submit, tokenizer))


def test_which_templates_render_tools(tiny_tokenizer: Tokenizer) -> None:
    assert renders_hermes_tools(HERMES_TEMPLATE)
    assert not renders_hermes_tools(tiny_tokenizer.chat_template)  # a plain ChatML template
    assert not renders_hermes_tools(None)
    # Words in the template's text are not the `tools` variable.
    assert not renders_hermes_tools(
        "{{ 'Use tools: <tool_call>' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )


def test_a_tool_template_gets_the_structured_conversation(tiny_tokenizer: Tokenizer) -> None:
    text = prompt_text(with_template(tiny_tokenizer, HERMES_TEMPLATE))
    # The tools as the template lays them out, in the client's key order, not HTML-escaped.
    spec = json.dumps({"type": "function", "function": WEATHER}, ensure_ascii=False)
    assert f"<tools>\n{spec}\n</tools>" in text
    # The earlier call exactly as the call grammar makes the model write one (api/tool_calls.py).
    assert call_text("get_weather", '{"city": "Paris"}') in text
    assert "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>" in text
    assert "You can call functions" not in text  # not the fallback's instructions
    assert text.endswith("<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n")


def test_other_templates_get_the_fallback(tiny_tokenizer: Tokenizer) -> None:
    text = prompt_text(tiny_tokenizer)
    assert "You can call functions" in text
    assert "<tool_response>\n22 C\n</tool_response>" in text


def test_no_callable_tools_means_no_tools_in_the_prompt(tiny_tokenizer: Tokenizer) -> None:
    """tool_choice none: the answer is text, so neither form offers the tools."""
    text = prompt_text(with_template(tiny_tokenizer, HERMES_TEMPLATE), tool_choice="none")
    assert "<tools>" not in text and "You can call functions" not in text


def test_tools_are_refused_by_a_template_that_does_not_render_them(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="does not render tools"):
        tiny_tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=[])


@pytest.mark.slow
def test_a_pipeline_renders_tools_through_the_models_template(tmp_path: Path) -> None:
    """End to end: the gateway's two forms cross to the orchestrator, which renders the structured one
    through the served model's own template (the prompt it counts is that render's), and the call the
    grammar forces comes back in OpenAI's shape."""
    import openai

    from pipeline.model import Model

    from .pipeline_harness import running_pipeline
    from .tinymodel import TinySpec, write_tiny_gguf
    from .tinyspm import rewrite_gguf

    write_tiny_gguf(tmp_path / "chat.gguf", TinySpec(context=1024))  # byte-level: a token a character
    path = rewrite_gguf(tmp_path / "chat.gguf", tmp_path / "tools.gguf", chat_template=HERMES_TEMPLATE)
    tokenizer = Model.load(path).tokenizer
    assert tokenizer is not None and tokenizer.renders_tools
    tools = [{"type": "function", "function": WEATHER}]
    with running_pipeline(tmp_path / "run", [f"model.path={path}", "model.backend=native"]) as pipeline:
        client = openai.OpenAI(base_url=f"{pipeline.gateway_url}/v1", api_key="unused", max_retries=0)
        model = pipeline.config.model_id()
        answer = client.chat.completions.create(
            model=model, messages=HISTORY, tools=tools, tool_choice="required", max_tokens=64, temperature=0
        )
    structured = chat.to_submit(
        chat.decode(json.dumps({"model": "m", "messages": HISTORY, "tools": tools}).encode()), "m"
    )
    assert structured.tool_messages is not None and structured.tools is not None
    rendered = tokenizer.encode(tokenizer.render_chat(structured.tool_messages, tools=structured.tools))
    assert answer.usage is not None and answer.usage.prompt_tokens == len(rendered)
    choice = answer.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"

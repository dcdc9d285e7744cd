"""`/tokenize` and `/detokenize` without processes: the bodies llama-server's and vLLM's clients
send, mapped to the orchestrator's `Tokenize`/`Detokenize`, answered by its tokenizing functions on
a tiny model, and shaped back into both servers' response forms. The same path through a real
pipeline is in tests/test_gateway.py."""

from __future__ import annotations

import json

import pytest

from pipeline.api import tokenize as api
from pipeline.api.errors import ApiError
from pipeline.model.prompts import prompt_tokens
from pipeline.orchestration.tokenizing import detokenize, tokenize
from pipeline.protocol.messages import ErrorReply, Text, Tokens

CONTEXT = 256


def answer(tokenizer, **body) -> dict:
    """The HTTP response body for a /tokenize request body, as the gateway composes it."""
    req = api.decode_tokenize(json.dumps(body).encode())
    reply = tokenize(api.to_tokenize(req), tokenizer, CONTEXT)
    assert isinstance(reply, Tokens), reply
    return api.tokenize_response(reply, req.with_pieces)


def refused(body: dict | bytes, detokenizing: bool = False) -> ApiError:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as caught:
        if detokenizing:
            api.to_detokenize(api.decode_detokenize(data))
        else:
            api.to_tokenize(api.decode_tokenize(data))
    assert caught.value.status == 400
    return caught.value


def test_llama_server_and_vllm_spellings_give_the_prompt_a_completion_gets(tiny_tokenizer):
    text = "Hello wörld, 日本語"
    expected = prompt_tokens(tiny_tokenizer, text)
    for body in ({"content": text}, {"prompt": text, "model": "tiny"}):
        out = answer(tiny_tokenizer, **body)
        assert out == {"tokens": expected, "count": len(expected), "max_model_len": CONTEXT}
    # BOS on request, either spelling (the tiny model's own flag says no BOS)
    assert answer(tiny_tokenizer, content=text, add_special=True)["tokens"] == [1, *expected]
    assert answer(tiny_tokenizer, prompt=text, add_special_tokens=True)["tokens"] == [1, *expected]
    assert (
        answer(tiny_tokenizer, prompt=text, add_special=False, add_special_tokens=False)["tokens"] == expected
    )


def test_chat_messages_tokenize_as_a_chat_completion_prompt(tiny_tokenizer):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    as_served = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = answer(tiny_tokenizer, messages=messages)
    assert out["tokens"] == prompt_tokens(tiny_tokenizer, None, messages=as_served)
    without = answer(tiny_tokenizer, messages=messages, add_generation_prompt=False)["tokens"]
    assert out["tokens"][: len(without)] == without and len(without) < len(out["tokens"])
    assert refused({"messages": [{"role": "bogus", "content": "x"}]}).param == "messages.0.role"


def test_pieces_are_llama_servers_text_or_bytes(tiny_tokenizer):
    text = "a日<|im_start|>"
    out = answer(tiny_tokenizer, content=text, with_pieces=True)
    ids = [t["id"] for t in out["tokens"]]
    assert ids == tiny_tokenizer.encode(text)
    raw = b"".join(
        bytes(p) if isinstance(p, list) else p.encode() for p in (t["piece"] for t in out["tokens"])
    )
    assert raw == text.encode()
    assert {"id": 1, "piece": "<|im_start|>"} in out["tokens"]
    assert any(isinstance(t["piece"], list) for t in out["tokens"])  # a byte of 日 on its own


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({}, None, "none was given"),
        ({"content": "a", "prompt": "a"}, "prompt", "content and prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages", "prompt and messages"),
        ({"content": 5}, "content", "Expected `str"),
        (
            {"content": "a", "add_special": True, "add_special_tokens": False},
            "add_special_tokens",
            "disagree",
        ),
        ({"content": "a", "return_token_strs": True}, "return_token_strs", "not supported"),
        (b"{not json", None, "not valid JSON"),
    ],
)
def test_bad_tokenize_bodies_are_400s_naming_the_field(body, param, says):
    error = refused(body)
    assert error.param == param and says in error.message, error.message


def test_detokenize_answers_in_both_shapes_and_names_a_bad_id(tiny_tokenizer):
    text = "Hello <|im_start|>wörld"
    req = api.decode_detokenize(json.dumps({"tokens": tiny_tokenizer.encode(text)}).encode())
    reply = detokenize(api.to_detokenize(req), tiny_tokenizer)
    assert isinstance(reply, Text)
    assert api.detokenize_response(reply.text) == {"content": text, "prompt": text}
    bad = detokenize(
        api.to_detokenize(api.DetokenizeRequest(tokens=[5, tiny_tokenizer.vocab_size])), tiny_tokenizer
    )
    assert isinstance(bad, ErrorReply) and bad.kind == "bad_request"
    assert f"tokens[1] = {tiny_tokenizer.vocab_size} is not a token id" in bad.message
    assert isinstance(
        detokenize(api.to_detokenize(api.DetokenizeRequest(tokens=[-1])), tiny_tokenizer), ErrorReply
    )
    assert refused({"tokens": ["a"]}, detokenizing=True).param == "tokens"
    assert refused({}, detokenizing=True).param == "tokens"


def test_the_orchestrator_refuses_text_and_messages_together(tiny_tokenizer):
    from pipeline.protocol.messages import Tokenize

    both = Tokenize(text="a", messages=[{"role": "user", "content": "b"}])
    assert isinstance(tokenize(both, tiny_tokenizer, CONTEXT), ErrorReply)
    assert isinstance(tokenize(Tokenize(), tiny_tokenizer, CONTEXT), ErrorReply)

"""Base models (no chat template, as Gemma 3 270M): served text to complete; chat refused in one clear
line by the CLI and as a 400 in OpenAI's shape by the gateway's chat and responses APIs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from pipeline.decoding.speculation import Speculation
from pipeline.model import Model
from pipeline.model.prompts import prompt_tokens
from pipeline.model.tokenizer import NO_CHAT_TEMPLATE, NoChatTemplate, Tokenizer
from pipeline.orchestration.admission import admit
from pipeline.protocol.client import PipelineError
from pipeline.protocol.messages import ErrorReply, Submit, Submitted

from .test_gateway_app import Orchestrator, serve
from .tinymodel import TinySpec, write_tiny_gguf
from .tinyspm import rewrite_gguf


@pytest.fixture(scope="module")
def base_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its chat template taken out."""
    directory = tmp_path_factory.mktemp("base")
    write_tiny_gguf(directory / "chat.gguf", TinySpec())
    return rewrite_gguf(directory / "chat.gguf", directory / "base.gguf")


@pytest.fixture(scope="module")
def base_tokenizer(base_file: Path) -> Tokenizer:
    tokenizer = Model.load(base_file).tokenizer
    assert tokenizer is not None and tokenizer.chat_template is None
    return tokenizer


def test_prompts_encode_and_chat_is_refused(base_tokenizer):
    assert prompt_tokens(base_tokenizer, "the hat") == base_tokenizer.encode("the hat")
    with pytest.raises(NoChatTemplate, match="no chat template"):
        prompt_tokens(base_tokenizer, "the hat", chat=True)
    with pytest.raises(NoChatTemplate):
        prompt_tokens(base_tokenizer, None, messages=[{"role": "user", "content": "hi"}])


def speclanes(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pipeline.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_cli_generates_for_a_base_model_and_refuses_chat_in_one_line(base_file, tmp_path):
    common = ("--model", str(base_file), "--max-tokens", "4", "--backend", "numpy", "--drafter", "none")
    done = speclanes("generate", "the hat", *common, "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 4
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    for refused in (("--chat", "the hat"), ("--messages", str(messages))):
        result = speclanes("generate", *refused, *common)
        assert result.returncode == 2
        assert result.stderr == f"speclanes: error: {NO_CHAT_TEMPLATE}\n"  # one line, no traceback


class Admitting(Orchestrator):
    """The gateway's stand-in orchestrator, admitting each request as the real one does (the base
    model's tokenizer builds the prompt) and refusing it as the client library reports a refusal."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    async def request(self, submit: Submit) -> Submitted:
        admitted = admit(submit, Speculation(), self.tokenizer, 128, has_draft_model=False)
        if isinstance(admitted, ErrorReply):
            raise PipelineError(admitted.kind, admitted.message)
        return await super().request(submit)


@pytest.fixture
def base_gateway(monkeypatch, base_tokenizer) -> Iterator[TestClient]:
    http, _ = serve(monkeypatch, orchestrator=Admitting(base_tokenizer))
    with http:
        yield http


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
def test_gateway_chat_on_a_base_model_is_a_400_naming_why(base_gateway, path, body):
    response = base_gateway.post(path, json={"model": "m", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "no chat template" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_gateway_completions_serve_a_base_model(base_gateway):
    response = base_gateway.post("/v1/completions", json={"model": "m", "prompt": "the hat"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "Hi!"

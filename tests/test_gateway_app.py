"""The gateway's HTTP application in-process (pipeline/api/server.py) over a stand-in for the
orchestrator: CORS with and without API keys, usage counted once in streams, the max_tokens and the
temperature a request may name. Driven by Starlette's TestClient under trio (as hypercorn serves
the gateway), and by the official `openai` client over it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import openai
import pytest
from starlette.testclient import TestClient

from pipeline.api.core import NO_MAX_TOKENS
from pipeline.api.keys import KEY_VARIABLE
from pipeline.api.server import Gateway
from pipeline.decoding.result import Result
from pipeline.protocol.config import load_config
from pipeline.protocol.messages import Chunk, Submit, Submitted

MODEL = "m"
ALLOWED = "https://chat.example"
KEY = "s3cret"


class Orchestrator:
    """The orchestrator as the gateway's AsyncClient sees it: every request is "Hi!" in two chunks,
    three prompt tokens; the Submits are kept for the test to read."""

    def __init__(self) -> None:
        self.submits: list[Submit] = []

    async def request(self, submit: Submit) -> Submitted:
        self.submits.append(submit)
        return Submitted(request_id=submit.request_id or f"r{len(self.submits)}", prompt_tokens=3)

    async def chunks(self, request_id: str) -> AsyncIterator[Chunk | Result]:
        yield Chunk(0, "Hi", [10])
        yield Chunk(1, "!", [11])
        stats = {"drafter": "ngram", "steps": 2, "seed": 7}
        yield msgspec.convert(
            {"request_id": request_id, "prompt_tokens": [1, 2, 3], "tokens": [10, 11], "text": "Hi!",
             "finish_reason": "stop", "stats": stats},
            Result,
        )  # fmt: skip

    async def stream(self, request_id: str) -> AsyncIterator[list[Chunk | Result]]:
        """`AsyncClient.stream`: the chunks in batches, here one item each."""
        async for item in self.chunks(request_id):
            yield [item]

    async def cancel(self, request_id: str) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def serve(
    monkeypatch: pytest.MonkeyPatch, *settings: str, key: str | None = None,
    orchestrator: Orchestrator | None = None,
) -> tuple[TestClient, Orchestrator]:  # fmt: skip
    if key is None:
        monkeypatch.delenv(KEY_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(KEY_VARIABLE, key)
    gateway = Gateway(load_config(None, [f"gateway.model={MODEL}", *settings], environ={}))
    orchestrator = orchestrator or Orchestrator()
    gateway.client = orchestrator  # type: ignore[assignment]

    async def ready() -> None:
        pass

    monkeypatch.setattr(gateway, "require_ready", ready)
    return TestClient(gateway.app(), backend="trio"), orchestrator


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, Orchestrator]]:
    http, orchestrator = serve(monkeypatch)
    with http:
        yield http, orchestrator


def sdk(http: TestClient, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


# --- CORS -------------------------------------------------------------------------------


def preflight(http: TestClient, origin: str, path: str = "/v1/chat/completions") -> Any:
    headers = {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }  # fmt: skip
    return http.options(path, headers=headers)


@pytest.mark.parametrize("key", [None, KEY])
def test_any_origin_by_default_and_the_key_is_still_needed(monkeypatch, key):
    http, _ = serve(monkeypatch, key=key)
    answer = preflight(http, ALLOWED)  # a preflight carries no key: never refused for that
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    models = http.get("/v1/models", headers={"Origin": ALLOWED})
    assert models.headers["access-control-allow-origin"] == "*"
    assert models.status_code == (401 if key else 200)  # the browser reads the 401 too
    if key:
        keyed = http.get("/v1/models", headers={"Origin": ALLOWED, "Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("key", [None, KEY])
def test_listed_origins_only(monkeypatch, key):
    http, _ = serve(monkeypatch, f'gateway.cors_origins=["{ALLOWED}"]', key=key)
    allowed = preflight(http, ALLOWED)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
    refused = preflight(http, "https://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    headers = {"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"}
    assert "access-control-allow-origin" not in http.get("/v1/models", headers=headers).headers
    headers["Origin"] = ALLOWED
    assert http.get("/v1/models", headers=headers).headers["access-control-allow-origin"] == ALLOWED


def test_no_origins_no_cors(monkeypatch):
    http, _ = serve(monkeypatch, "gateway.cors_origins=[]")
    assert preflight(http, ALLOWED).status_code == 405  # no route takes OPTIONS
    assert "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": ALLOWED}).headers


# --- usage, counted once ------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_a_stream_carries_usage_once_with_include_usage_and_never_without(app, chat, n, include_usage):
    http, _ = app
    client, options = sdk(http), {"include_usage": include_usage}
    if chat:
        messages = [{"role": "user", "content": "hi"}]
        stream: Any = client.chat.completions.create(messages=messages, model=MODEL, n=n, stream=True,
                                                     stream_options=options)  # fmt: skip
    else:
        stream = client.completions.create(prompt="hi", model=MODEL, n=n, stream=True, stream_options=options)
    chunks = list(stream)
    with_usage = [chunk for chunk in chunks if chunk.usage is not None]
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finished) == n and all(c.model_extra["speculation"]["steps"] == 2 for c in finished)
    if not include_usage:
        assert with_usage == []
        return
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 2 * n, 3 + 2 * n)


def test_a_whole_response_still_carries_usage(app):
    http, _ = app
    whole = sdk(http).completions.create(prompt="hi", model=MODEL)
    assert whole.usage is not None and whole.usage.total_tokens == 5 and whole.choices[0].text == "Hi!"


# --- what a request may name --------------------------------------------------------------


def test_a_request_naming_no_max_tokens_runs_to_its_end_unless_the_operator_caps_it(monkeypatch):
    for settings, unnamed in (((), NO_MAX_TOKENS), (("gateway.default_max_tokens=64",), 64)):
        http, orchestrator = serve(monkeypatch, *settings)
        with http:
            client = sdk(http)
            client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], model=MODEL)
            client.completions.create(prompt="hi", model=MODEL)
            client.completions.create(prompt="hi", model=MODEL, max_tokens=300)  # a named limit wins
            client.chat.completions.create(
                messages=[{"role": "user", "content": "hi"}], model=MODEL, max_completion_tokens=7
            )
        limits = [submit.params.max_tokens for submit in orchestrator.submits]
        assert limits == [unnamed, unnamed, 300, 7], settings


@pytest.mark.parametrize("chat", [True, False])
def test_temperature_over_two_is_a_400_naming_it(app, chat):
    http, orchestrator = app
    client = sdk(http)
    with pytest.raises(openai.BadRequestError) as refused:
        if chat:
            client.chat.completions.create(
                messages=[{"role": "user", "content": "hi"}], model=MODEL, temperature=2.5
            )
        else:
            client.completions.create(prompt="hi", model=MODEL, temperature=2.5)
    error = refused.value
    assert (error.status_code, error.param, error.type) == (400, "temperature", "invalid_request_error")
    assert "2" in error.message
    assert orchestrator.submits == []
    client.completions.create(prompt="hi", model=MODEL, temperature=2)  # 2 itself is allowed

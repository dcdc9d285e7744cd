"""API keys on the HTTP gateway (pipeline/api/keys.py): the ASGI middleware, driven directly."""

from __future__ import annotations

import json

import pytest
import trio

from pipeline.api.keys import KEY_VARIABLE, RequireKey, authorized, load_keys


def test_keys_come_from_the_variable_and_the_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the team's keys\nalpha\n\n  beta  \n")
    assert load_keys(str(path), {KEY_VARIABLE: " gamma "}) == (b"gamma", b"alpha", b"beta")
    assert load_keys("", {}) == ()
    with pytest.raises(OSError, match=r"cannot read gateway\.api_key_file"):
        load_keys(str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys(str(tmp_path / "empty"), {})


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (b"Bearer alpha", True),
        (b"bearer beta", True),
        (b"Bearer alph", False),
        (b"Bearer alphaa", False),
        (b"Basic alpha", False),
        (b"Bearer ", False),
        (b"alpha", False),
        (None, False),
    ],
)
def test_only_a_bearer_with_a_listed_key_is_authorized(header, ok):
    assert authorized(header, (b"alpha", b"beta")) is ok


def call(app: RequireKey, path: str, header: bytes | None) -> tuple[int, dict]:
    sent: list[dict] = []

    async def inner(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    app.app = inner
    headers = [(b"authorization", header)] if header is not None else []
    trio.run(app, {"type": "http", "path": path, "headers": headers}, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"] or b"{}")


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/completions", "/nowhere"])
def test_every_endpoint_but_health_needs_a_key(path):
    guarded = RequireKey(None, (b"alpha",))  # type: ignore[arg-type]
    status, body = call(guarded, path, None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(guarded, path, b"Bearer wrong")[0] == 401
    assert call(guarded, path, b"Bearer alpha")[0] == 200
    assert call(guarded, "/health", None)[0] == 200


def test_without_keys_the_gateway_is_open():
    assert call(RequireKey(None, ()), "/v1/models", None)[0] == 200  # type: ignore[arg-type]

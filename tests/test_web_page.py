"""The web page at / (pipeline/api/web.py, its files in pipeline/api/static/) and the stream
extension it reads (pipeline/api/extension.py): in-process against the gateway's application, and
once in a real headless browser, Debian's chromium driven by Playwright, against a real pipeline
whose gateway has an API key."""

from __future__ import annotations

import fnmatch
import os
import shutil
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from pipeline.api.web import ASSETS
from pipeline.decoding.result import Result
from pipeline.protocol.messages import Chunk

from .pipeline_harness import running_pipeline
from .test_gateway_app import KEY, MODEL, Orchestrator, sdk, serve

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "hi"}]


# --- the page's files, served by the gateway ----------------------------------------------------


def test_the_page_and_its_files_need_no_key_but_every_api_call_does(monkeypatch):
    http, _ = serve(monkeypatch, key=KEY)
    with http:
        for path, (name, media_type) in ASSETS.items():
            answer = http.get(path)
            assert answer.status_code == 200 and answer.headers["content-type"] == media_type, path
            assert "connect-src 'self'" in answer.headers["content-security-policy"]
            assert "http://" not in answer.text and "https://" not in answer.text, f"{name} fetches elsewhere"
        page = http.get("/").text
        assert 'data-drafters="none ngram' in page and "a:accepted draft" in page and "{{" not in page
        for path in ("/v1/models", "/metrics", "/version", "/web/other.js"):
            assert http.get(path).status_code == 401, path
        assert http.post("/v1/chat/completions", json={"messages": MESSAGES}).status_code == 401


def test_the_pages_files_ship_as_package_data():
    """A non-editable install has them: pyproject's package-data names each one."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["pipeline.api"]
    for name, _ in ASSETS.values():
        assert (ROOT / "pipeline/api/static" / name).is_file()
        assert any(fnmatch.fnmatch(f"static/{name}", pattern) for pattern in patterns), name


# --- the extension: how each token was decided ---------------------------------------------------


def decided_steps(orchestrator: Orchestrator) -> None:
    """Three steps: a plain token, two accepted drafts whose text is held back (a stop string might
    start there), then the target's correction, which releases the text."""

    async def chunks(request_id: str) -> AsyncIterator[Chunk | Result]:
        yield Chunk(0, "Hi", [10], [], "p")
        yield Chunk(1, "", [11, 12], [], "aa")
        yield Chunk(2, " there!", [13], [], "c")
        yield msgspec.convert(
            {"request_id": request_id, "prompt_tokens": [1, 2, 3], "tokens": [10, 11, 12, 13],
             "text": "Hi there!", "finish_reason": "stop", "stats": {"steps": 2, "accepted": 2}},
            Result,
        )  # fmt: skip

    orchestrator.chunks = chunks  # type: ignore[method-assign]


def stream(client: openai.OpenAI, chat: bool, **extra: Any) -> list[Any]:
    if chat:
        return list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **extra))
    return list(client.completions.create(model=MODEL, prompt="hi", stream=True, **extra))


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_says_how_each_token_was_decided_only_when_asked(monkeypatch, chat, n):
    http, orchestrator = serve(monkeypatch)
    decided_steps(orchestrator)
    with http:
        client = sdk(http)
        plain = stream(client, chat, n=n)
        assert not any("speclanes" in (chunk.model_extra or {}) for chunk in plain)  # OpenAI's chunks only
        asked = stream(client, chat, n=n, extra_body={"speclanes": {"decided": True}})
    letters: dict[int, str] = {}
    for chunk in asked:
        carried = (chunk.model_extra or {}).get("speclanes")
        text_chunk = (
            bool(chunk.choices)
            and chunk.choices[0].finish_reason is None
            and (chunk.choices[0].delta.content is not None if chat else True)
        )
        if carried is None:  # the opening role chunk, the closing chunks
            assert not text_chunk or (chat and chunk.choices[0].delta.role == "assistant"), chunk
            continue
        index = chunk.choices[0].index
        letters[index] = letters.get(index, "") + carried["decided"]
    assert letters == dict.fromkeys(range(n), "paac")
    # The held-back tokens' chunk is sent only to a stream that asked for their letters.
    assert len(asked) == len(plain) + n


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Any:
    http, orchestrator = serve(monkeypatch)
    with http:
        yield http, orchestrator


def test_asking_for_the_letters_without_a_stream_is_a_400_naming_the_field(app):
    http, orchestrator = app
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(http).chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"speclanes": {"decided": True}}
        )
    assert refused.value.param == "speclanes.decided" and orchestrator.submits == []


# --- in a real browser ------------------------------------------------------------------------------

# What works here for a headless chromium with no network and no display; Playwright makes a fresh,
# empty profile (user data dir) for each launch.
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
PROMPT = "Repeat this line three times: the quick brown fox jumps over the lazy dog."
MAX_TOKENS = 24
# Counts, on every change of the page, the tokens shown while the answer is still streaming.
WATCH_STREAMING = """() => {
  window.seenWhileStreaming = 0;
  new MutationObserver(() => {
    const shown = document.querySelectorAll(".msg.assistant.streaming .t").length;
    window.seenWhileStreaming = Math.max(window.seenWhileStreaming, shown);
  }).observe(document.getElementById("transcript"), {childList: true, subtree: true, characterData: true});
}"""


def chromium_or_skip() -> str:
    """The system's chromium: ops/setup.sh installs it where it runs as root, as CI does; missing in
    CI, the test fails rather than skips."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        import playwright  # noqa: F401 (the test extra's)
    except ImportError:
        found = None
    if found is None:
        why = "chromium or playwright is not installed (ops/setup.sh installs both when run as root)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return found


@pytest.mark.slow
def test_the_page_streams_coloured_tokens_in_a_real_browser(tmp_path: Path):
    chromium = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with (
        running_pipeline(tmp_path / "run", [], {"SPECLANES_API_KEY": KEY}) as pipeline,
        sync_playwright() as driver,
    ):
        browser = driver.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 820})
        errors: list[Any] = []
        page.on("pageerror", lambda error: errors.append(error))
        page.goto(f"{pipeline.gateway_url}/")
        page.wait_for_selector("#model:not(:empty)")  # its script ran, and /health answered it

        # No key yet: the page is served, its API call is not, and the page asks for the key.
        page.fill("#prompt", PROMPT)
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant.failed")
        assert "API key" in page.text_content(".msg.assistant.failed .error")
        assert page.is_visible("#api-key.wanted")
        page.fill("#api-key", KEY)
        page.wait_for_selector("#lanes li.up:nth-child(5)")  # the lanes, live, once the key is there
        assert page.locator("#lanes li.up").count() == 5

        page.click("#new-chat")
        page.select_option("#drafter", "ngram")
        page.fill("#max-tokens", str(MAX_TOKENS))
        page.evaluate(WATCH_STREAMING)
        page.fill("#prompt", PROMPT)
        started = time.monotonic()
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant.done", timeout=60_000)
        streamed = time.monotonic() - started
        assert page.evaluate("window.seenWhileStreaming") > 0, "no token was shown before the answer ended"

        spans = page.eval_on_selector_all(
            ".msg.assistant.done .t", "all => all.map(s => [s.className, s.textContent])"
        )
        letters = page.get_attribute(".msg.assistant.done", "data-decided") or ""
        assert spans and {cls for cls, _ in spans} <= {"t a", "t c", "t b", "t p"}, spans
        assert set(letters) <= set("acbp")
        assert page.text_content("#live-tokens") == str(len(letters))

        # Exactness, twice: the page's text is the target's own greedy answer as the SDK gets it without
        # drafts, and the page's own check (the same turn decoded again with drafter none) agrees.
        client = openai.OpenAI(base_url=f"{pipeline.gateway_url}/v1", api_key=KEY, max_retries=0, timeout=60)
        plain = client.chat.completions.create(
            model=pipeline.config.model_id(), messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS, temperature=0, extra_body={"speculation": {"drafter": "none"}},
        )  # fmt: skip
        assert "".join(text for _, text in spans) == plain.choices[0].message.content
        assert plain.usage is not None and len(letters) == plain.usage.completion_tokens
        page.click(".msg.assistant.done .check")
        page.wait_for_selector(".verdict.same", timeout=60_000)

        page.screenshot(path=str(tmp_path / "webpage.png"), full_page=True)
        browser.close()
    assert errors == []
    print(f"streamed {len(letters)} tokens ({letters}) in {streamed:.2f} s; screenshot in {tmp_path}")

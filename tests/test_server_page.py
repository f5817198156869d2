"""The chat page at `/`, in a real headless browser (Debian's Chromium driven by Playwright,
no browser download): a question typed in gets a streamed answer from the embedded model."""

import os
import pathlib
import shutil
import time

import httpx
import pytest

from checkpoints.registry import DEFAULT_MODEL
from tests.serving import serve
from tests.xla_env import optimized_env

KEY = "page-key"
ARTIFACTS = pathlib.Path(__file__).parent / "artifacts"


def _chromium() -> str | None:
    for path in (os.environ.get("JAXINFER_CHROMIUM"), "/usr/bin/chromium",
                 shutil.which("chromium"), shutil.which("chromium-browser")):
        if path and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="module")
def chromium():
    path = _chromium()
    if path is None:
        pytest.skip("no Chromium found (Debian: apt-get install chromium; or set "
                    "JAXINFER_CHROMIUM): the chat page's browser test needs one")
    pytest.importorskip("playwright.sync_api", reason="the test extra's playwright is missing")
    return path


def _pages_back_to_zero(url: str, wait: float = 20.0) -> bool:
    deadline = time.time() + wait
    while time.time() < deadline:
        text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        if float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("jaxinfer_pages_in_use "))) == 0:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.network
def test_chat_page_streams_an_answer(chromium, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    # The embedded 30-layer model under XLA's default CPU optimizations (its steps ~3x
    # faster, tests/xla_env.py), with the engine `jaxinfer chat` builds (one row, the default
    # length and pool): the same programs as tests/test_cli.py's chat, which the session's
    # compilation cache (tests/conftest.py) may already hold.
    with serve("--max-num-seqs", "1", "--api-key", KEY, env=optimized_env()) as (url, _, _):
        page_html = httpx.get(url + "/")  # the page needs no key; the API does
        assert page_html.status_code == 200 and "<textarea" in page_html.text
        assert httpx.get(url + "/v1/models").status_code == 401
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 900, "height": 640})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            expect(page.locator("#key-box")).to_be_visible()  # asked for the key
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            expect(page.locator("#model")).to_have_text(DEFAULT_MODEL, timeout=10_000)
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "24")
            page.evaluate("""() => {
                window.shown = [];
                new MutationObserver(() => {
                    const a = document.querySelector('.assistant');
                    if (a) window.shown.push(a.textContent);
                }).observe(document.getElementById('log'),
                           {subtree: true, childList: true, characterData: true});
            }""")
            page.fill("#input", "What is the capital of France?")
            page.press("#input", "Enter")
            expect(page.locator(".user")).to_have_text("What is the capital of France?")
            answer = page.locator(".assistant")
            expect(answer).to_have_attribute("data-done", "true", timeout=240_000)
            text = answer.text_content()
            shown = page.evaluate("window.shown")
            # Stop: a long answer cut short, its request aborted and its pages back. The
            # question's new tokens (past the first turn's cached pages: ~40) take the first
            # turn's prefill width, as test_cli's chat does: no prefill program of its own.
            page.fill("#max-tokens", "400")
            page.fill("#input", "Tell me a long story about a dragon who lived in the "
                      "mountains above a small village.")
            page.click("#send")
            second = page.locator(".assistant").nth(1)
            expect(second).not_to_have_text("", timeout=240_000)
            page.click("#stop")
            expect(second).to_have_attribute("data-done", "stopped")
            expect(page.locator("#send")).to_be_enabled()
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "chat_page.png"))
            page.screenshot(path=str(tmp_path / "chat_page.png"))
            browser.close()
        assert _pages_back_to_zero(url), "the stopped request kept its pages"
    assert "Paris" in text, text
    # Streamed: the answer was on the page at several lengths before it was whole.
    partial = {s for s in shown if s and s != text}
    assert len(partial) >= 2 and all(text.startswith(s) for s in partial), shown
    assert not errors, errors

"""The chat page of `gemma-ane serve` (issue 46), in a real browser: headless Chromium (Debian's, which .ci/run
installs) driven by Playwright, against `serve` on the demo bundle. Model output that would be markup in a page is
fed by a route of the browser's own (the demo model never writes it), so the test sees what the page does with it."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from gemma_ane.oracle.demo_corpus import picture

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(bundle: Path, *flags: str):
    """`gemma-ane serve BUNDLE` on a free loopback port until the block ends; yields its URL and the file its log
    goes to (a file, not a pipe: a pipe nobody reads would stall the server once full)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "gemma_ane", "serve", str(bundle), "--backend", "mil", "--port", str(port), *flags]
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "serve.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                if proc.poll() is not None:
                    raise AssertionError(f"serve exited: {log.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.2)
            else:
                raise AssertionError("serve did not answer /health in 120 s")
            yield url, log
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(demo_bundle16):
    with serving(demo_bundle16) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("no chromium on PATH: .ci/run installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    # bypass_csp: Playwright's own probes evaluate strings, which the page's policy forbids; what the page renders
    # must be inert without the policy's help anyway (test_model_and_user_markup_is_shown_as_text_and_runs_nothing)
    context = browser.new_context(viewport={"width": 1100, "height": 800}, accept_downloads=True, bypass_csp=True)
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("dialog", lambda d: errors.append(f"dialog: {d.message}") or d.dismiss())
    pg.goto(server)
    pg.wait_for_function("document.getElementById('model-name').textContent !== '…'")
    settings(pg, temperature=0)  # greedy: the demo's answers, word for word
    pg.click("#toggle-settings")
    yield pg
    context.close()
    assert not errors, errors  # no script error, no alert() that model text could have opened


def ask(pg, text: str) -> None:
    pg.fill("#input", text)
    pg.press("#input", "Enter")
    pg.wait_for_selector("#send:not([disabled])", timeout=120_000)  # the answer has ended


def answers(pg) -> list[str]:
    return [t.strip() for t in pg.locator(".message.assistant .body").all_inner_texts()]


def settings(pg, **values) -> None:
    if pg.locator("#settings").is_hidden():
        pg.click("#toggle-settings")
    for name, value in values.items():
        if isinstance(value, bool):
            pg.locator(f"#{name}").set_checked(value)
        else:
            pg.fill(f"#{name}", str(value))


def test_the_page_is_served_with_a_policy_and_not_with_no_webui(server, demo_bundle16):
    r = httpx.get(server)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    for asset in ("/page/app.js", "/page/app.css"):
        assert httpx.get(server + asset).headers["content-security-policy"] == policy
    card = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert card["context_length"] == 512 and card["capabilities"]["vision"] and not card["capabilities"]["audio"]
    port = server.rsplit(":", 1)[1]
    own = {"Origin": server, "Content-Type": "application/json"}
    ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert httpx.post(f"{server}/v1/chat/completions", json=ask, headers=own).status_code == 200  # its own page
    rebound = {"Origin": f"http://evil.example:{port}", "Host": f"evil.example:{port}"}  # a name resolving here
    assert httpx.post(f"{server}/v1/chat/completions", json=ask, headers=rebound).status_code == 403
    with serving(demo_bundle16, "--no-webui") as (bare, _):
        assert httpx.get(bare).status_code == 404
        assert httpx.get(f"{bare}/v1/models").status_code == 200


def test_a_question_streams_its_answer_with_figures_that_match_usage(page):
    chunks = []
    page.on("response", lambda r: chunks.append(r) if r.url.endswith("/v1/chat/completions") else None)
    assert page.locator("#stop").is_hidden()
    ask(page, "What is the capital of France?")
    assert answers(page) == ["Paris."] and page.locator("#stop").is_hidden()  # only a running answer can stop
    events = [json.loads(line[6:]) for line in chunks[0].text().splitlines() if line.startswith("data: {")]
    usage = next(e["usage"] for e in events if e.get("usage"))
    figures = page.locator(".message.assistant .figures").inner_text()
    assert (
        f"prompt {usage['prompt_tokens']} tokens ({usage['prompt_tokens_details']['cached_tokens']} reused)" in figures
    )
    assert f"generation {usage['completion_tokens']} tokens" in figures and "finish stop" in figures
    total = usage["prompt_tokens"] + usage["completion_tokens"]
    assert f"context {total}/512" in figures and page.inner_text("#context-figure") == f"{total} / 512 tokens"


def test_thinking_shows_a_reasoning_block(page):
    settings(page, thinking=True)
    ask(page, "What is 7 + 8?")
    block = page.locator(".message.assistant details.reasoning")
    assert block.count() == 1 and block.locator(".text").text_content().strip()  # folded: its text is there
    assert answers(page)[-1]  # and an answer after it


def test_the_red_square_is_described(page, tmp_path):
    path = tmp_path / "red_square.png"
    picture("red_square").save(path)
    page.set_input_files("#attach", str(path))
    page.wait_for_selector("#attachments .chip")
    ask(page, "Describe the picture.")
    assert answers(page) == ["A red square on a white background."]
    assert page.locator(".message.user img.attachment").count() == 1


def test_stop_keeps_the_partial_answer_and_the_next_question_works(page):
    settings(page, temperature=5, max_tokens=400, seed=3)  # a flat distribution: a long answer to stop
    page.fill("#input", "Tell me a story.")
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant .body')?.textContent.length > 0")
    page.click("#stop")
    page.wait_for_selector("#send:not([disabled])")
    partial = answers(page)[-1]
    assert partial and page.locator(".message.assistant").count() == 1
    settings(page, temperature=0, max_tokens=64)
    ask(page, "What is the capital of Italy?")
    assert answers(page)[0] == partial and answers(page)[1]  # the conversation goes on after the partial answer
    assert "finish stop" in page.locator(".message.assistant .figures").last.inner_text()


def test_regenerate_and_edit_and_resend(page):
    ask(page, "What is the capital of Japan?")
    page.click(".message.assistant button:has-text('Regenerate')")
    page.wait_for_selector("#send:not([disabled])")
    assert answers(page) == ["Tokyo."]  # greedy: the same answer, once
    page.evaluate("window.prompt = () => 'What is the capital of Spain?'")  # the edit box, answered
    page.click(".message.user button:has-text('Edit')")
    page.wait_for_selector("#send:not([disabled])")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length === 1")
    assert answers(page) == ["Madrid."]
    assert page.locator(".message.user .body").all_inner_texts() == ["What is the capital of Spain?"]


def test_reload_keeps_export_and_import_round_trip(page, tmp_path):
    ask(page, "What is the capital of Egypt?")
    page.reload()
    page.wait_for_selector(".message.assistant")
    assert answers(page) == ["Cairo."]
    with page.expect_download() as download:
        page.click("#export")
    saved = tmp_path / "conversations.json"
    download.value.save_as(saved)
    exported = json.loads(saved.read_text())
    assert exported["format"] == "gemma-ane.conversations"
    page.evaluate("localStorage.clear()")
    page.reload()
    page.wait_for_function("document.getElementById('model-name').textContent !== '…'")
    assert answers(page) == []
    page.set_input_files("#import", str(saved))
    page.locator("#conversations .title", has_text="What is the capital of Egypt?").click()
    assert answers(page) == ["Cairo."]
    kept = json.loads(page.evaluate("localStorage.getItem('gemma-ane.conversations')"))
    assert all(c in kept for c in exported["conversations"])  # beside the empty chat the cleared page opened


def test_a_preset_restores_its_settings(page):
    settings(page, system="Be brief.", temperature=0.7, top_k=20, seed=9, thinking=True)
    page.fill("#preset-name", "brief")
    page.click("#save-preset")
    settings(page, system="", temperature=1.5, top_k=0, seed=1, thinking=False)
    page.select_option("#presets", "brief")
    assert page.input_value("#system") == "Be brief." and page.input_value("#temperature") == "0.7"
    assert page.input_value("#top_k") == "20" and page.input_value("#seed") == "9" and page.is_checked("#thinking")


HOSTILE = '<img src=x onerror="window.pwned=1"> and <script>window.pwned=2</script> **bold** [x](javascript:alert(1))'


def test_model_and_user_markup_is_shown_as_text_and_runs_nothing(page):
    def fake(route):
        chunks = [{"choices": [{"index": 0, "delta": {"content": HOSTILE}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]  # fmt: skip
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", fake)
    ask(page, HOSTILE)
    assert page.evaluate("window.pwned") is None
    assert page.locator(".message img, .message script").count() == 0
    shown = page.locator(".message.assistant .body").inner_text()
    assert '<img src=x onerror="window.pwned=1">' in shown and "<script>window.pwned=2</script>" in shown
    assert page.locator(".message.assistant strong").inner_text() == "bold"
    assert page.locator(".message a").count() == 0  # only http(s) links become links
    assert '<img src=x onerror="window.pwned=1">' in page.locator(".message.user .body").inner_text()


def test_failures_show_one_message_and_keep_the_conversation(page, tmp_path):
    ask(page, "What is the capital of Peru?")
    sound = tmp_path / "beep.wav"
    sound.write_bytes(b"RIFF" + bytes(40))
    page.set_input_files("#attach", str(sound))  # the demo bundle has no audio model
    assert "no audio model" in page.inner_text("#notice")
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionreset"))  # the server went away
    ask(page, "And of Canada?")
    assert "the answer failed" in page.inner_text("#notice")
    assert answers(page) == ["Lima."] and page.locator(".message.user").count() == 2
    page.unroute("**/v1/chat/completions")
    big = tmp_path / "big.png"
    big.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(25 << 20))  # past serve's default image limit
    page.set_input_files("#attach", str(big))
    page.wait_for_selector("#attachments .chip")
    ask(page, "Describe the picture.")
    assert page.inner_text("#notice").startswith("the answer failed: 4")  # the server's 4xx, named
    assert answers(page) == ["Lima."]


def test_an_api_key_is_asked_for_then_used(browser, demo_bundle16):
    with serving(demo_bundle16, "--api-key", "sesame") as (url, _):
        context = browser.new_context(bypass_csp=True)
        pg = context.new_page()
        pg.goto(url)
        pg.wait_for_selector("#key-dialog[open]")
        pg.fill("#key", "sesame")
        pg.press("#key", "Enter")
        pg.wait_for_function("document.getElementById('model-name').textContent !== '…'")
        ask(pg, "What is the capital of Germany?")
        assert answers(pg) == ["Berlin."]
        assert pg.evaluate("sessionStorage.getItem('gemma-ane.key')") == "sesame"
        assert pg.evaluate("localStorage.getItem('gemma-ane.key')") is None  # kept for the session only
        context.close()


def test_a_phone_width_screen_hides_the_sidebar(browser, server):
    context = browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="dark", bypass_csp=True)
    pg = context.new_page()
    pg.goto(server)
    assert not pg.locator("#sidebar").is_visible() or pg.locator("#sidebar").bounding_box()["x"] < 0
    pg.click("#toggle-sidebar")
    pg.wait_for_timeout(300)
    assert pg.locator("#sidebar").bounding_box()["x"] >= 0
    assert pg.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(28, 28, 30)"  # dark
    context.close()

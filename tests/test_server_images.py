"""Images through `/v1/chat/completions`: OpenAI's image_url parts with data: URLs, the server's limits, and what
reaches the runtime. In-process (Starlette's TestClient) over test_server's scripted FakeModel, given an `images`
attribute as a vision bundle's Model has; then end to end on conftest's `vision_bundle` against the library."""

from __future__ import annotations

import base64
import contextlib
import io
import struct
import zlib

import numpy as np
import pytest
from openai import OpenAI
from PIL import Image
from test_server import CHAT, THOUGHT, FakeModel, assert_openai_error

import gemma_ane
from gemma_ane.runtime.model import Event
from gemma_ane.server.app import ImageLimits, Vocab, build_app

VISION = object()  # stands for the bundle's ImageEncoder: the server only asks whether there is one


def png(height: int, width: int, seed: int = 0) -> bytes:
    """Noise: incompressible, so the file is about 3 * width * height bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header states width x height (its CRC fixed): huge to Pillow's open, a few bytes to send."""
    one = png(1, 1)
    chunk = b"IHDR" + struct.pack(">II", width, height) + one[24:29]  # the size, then depth, colour, ... as they were
    return one[:12] + chunk + struct.pack(">I", zlib.crc32(chunk)) + one[33:]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_url(data: bytes, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data), **extra}}


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def fake(images=VISION, script=THOUGHT) -> FakeModel:
    model = FakeModel(script)
    model.images = images
    return model


@contextlib.contextmanager
def serving(model, **kw):
    from starlette.testclient import TestClient

    with TestClient(build_app(model, model_name="fake", **kw)) as http:
        yield http


def ask(http, *parts):
    return http.post(CHAT, json={"messages": [{"role": "user", "content": list(parts)}]})


def too_large(r) -> str:
    """The message of a 413 for the first message's first part."""
    return assert_openai_error(r, 413, "messages[0].content[0].image_url", "image_too_large")["message"]


SMALL = png(40, 60)


# -- what reaches the model -------------------------------------------------------------------------------------


def test_image_parts_reach_the_model_as_bytes_in_place():
    other = png(30, 20, seed=1)
    messages = [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [
                text("compare"),
                image_url(SMALL, detail="low"),
                text("and"),
                {"type": "image_url", "image_url": data_url(other)},  # the URL as a bare string: accepted too
            ],
        },
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": [image_url(other)]},
    ]
    model = fake()
    with serving(model) as http:
        r = http.post(CHAT, json={"messages": messages})
    assert r.status_code == 200, r.text
    image = [{"type": "image", "image": SMALL}, {"type": "image", "image": other}]
    assert model.calls[0]["messages"] == [
        messages[0],
        {"role": "user", "content": [text("compare"), image[0], text("and"), image[1]]},
        messages[2],
        {"role": "user", "content": [image[1]]},
    ]


def test_usage_counts_the_runtime_prompt_with_its_soft_tokens():
    # FakeModel.prompt_ids says 5 (one placeholder an image); the runtime's prompt, images expanded, is 83
    model = fake(script=[Event(token=5, text="a"), Event(finish_reason="stop", prompt_tokens=83, reused_tokens=3)])
    with serving(model) as http:
        client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        messages = [{"role": "user", "content": [image_url(SMALL), text("what is it?")]}]
        r = client.chat.completions.create(model="fake", messages=messages)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (83, 1, 84)
        assert r.usage.prompt_tokens_details.cached_tokens == 3
        chunks = client.chat.completions.create(
            model="fake", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        [usage] = [c.usage for c in chunks if c.usage is not None]
        assert (usage.prompt_tokens, usage.total_tokens) == (83, 84)


# -- refused, naming the part, before anything is queued ----------------------------------------------------------

AT = "messages[0].content[1]"
BAD_PARTS = [
    # (part, status, param, code, a phrase of the message)
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, 400, AT, None, "has no audio model"),
    # no server file is read
    ({"type": "image", "image": "/etc/passwd"}, 400, AT, None, "(text, image_url and input_audio)"),
    ({"type": "text", "text": 5}, 400, AT, None, "expected {'type': 'text'"),
    ("a bare string", 400, AT, None, "expected {'type': 'text'"),
    ({"type": "image_url", "image_url": {"url": 5}}, 400, f"{AT}.image_url", None, "expected {'url'"),
    ({"type": "image_url"}, 400, f"{AT}.image_url", None, "expected {'url'"),
    (image_url(SMALL, detail="ultra"), 400, f"{AT}.image_url.detail", None, "'auto', 'low' or 'high'"),
    (
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        400,
        f"{AT}.image_url",
        None,
        "send the image as a data: URL",
    ),
    ({"type": "image_url", "image_url": "file:///etc/passwd"}, 400, f"{AT}.image_url", None, "expected a data: URL"),
    ({"type": "image_url", "image_url": "data:image/png;base64,!!"}, 400, f"{AT}.image_url", None, "not valid base64"),
    ({"type": "image_url", "image_url": "data:image/png,abc"}, 400, f"{AT}.image_url", None, "must be base64"),
    (image_url(b"hello, not a picture"), 400, f"{AT}.image_url", None, "not an image"),
    (image_url(SMALL[:20]), 400, f"{AT}.image_url", None, "truncated or corrupt header"),
    (image_url(claiming(8000, 8000)), 413, f"{AT}.image_url", "image_too_large", "8000x8000 pixels"),  # > 40 MP
]


@pytest.mark.parametrize("part,status,param,code,needle", BAD_PARTS, ids=[b[4] for b in BAD_PARTS])
def test_a_bad_part_is_refused_by_name(part, status, param, code, needle):
    model = fake()
    with serving(model) as http:
        err = assert_openai_error(ask(http, text("look"), part), status, param, code)
        assert needle in err["message"], err
        assert ask(http, text("look"), image_url(SMALL)).status_code == 200  # the server goes on
    assert len(model.calls) == 1


def test_the_byte_limit_is_413_above_and_fine_at_it():
    model = fake()
    with serving(model, max_image_bytes=len(SMALL) - 1) as http:
        assert f"{len(SMALL)} bytes" in too_large(ask(http, image_url(SMALL)))
    with serving(model, max_image_bytes=len(SMALL)) as http:
        assert ask(http, image_url(SMALL)).status_code == 200
    assert len(model.calls) == 1


def test_the_pixel_limit_is_413_above_and_fine_at_it():
    model = fake()
    with serving(model, max_image_pixels=40 * 60 - 1) as http:
        assert "60x40 pixels" in too_large(ask(http, image_url(SMALL)))
    with serving(model, max_image_pixels=40 * 60) as http:
        assert ask(http, image_url(SMALL)).status_code == 200
    assert len(model.calls) == 1


def test_more_than_max_images_is_400():
    model = fake()
    with serving(model) as http:
        n = ImageLimits().max_images
        err = assert_openai_error(ask(http, *[image_url(SMALL)] * (n + 1)), 400, "messages")
        assert f"{n + 1} images, more than the {n}" in err["message"]
        assert ask(http, *[image_url(SMALL)] * n).status_code == 200
    assert len(model.calls) == 1


def test_a_model_without_vision_refuses_images():
    model = fake(images=None)
    with serving(model) as http:
        err = assert_openai_error(ask(http, text("look"), image_url(SMALL)), 400, AT)
        assert "this model takes no images (its bundle has no vision model)" in err["message"]
        assert ask(http, text("text parts still work")).status_code == 200
    assert len(model.calls) == 1


def test_the_default_body_limit_admits_images_only_for_a_vision_model():
    big = png(1000, 1000)  # 3 MB of noise, 4 MB as base64: over the text limit of 1 MB
    assert len(big) > 3_000_000
    model = fake()
    with serving(model) as http:
        assert ask(http, image_url(big)).status_code == 200
    assert model.calls[0]["messages"][0]["content"] == [{"type": "image", "image": big}]
    with serving(fake(images=None)) as http:
        assert_openai_error(ask(http, image_url(big)), 413, code="request_too_large")


def test_serve_takes_the_image_limits(monkeypatch, tmp_path, capsys):
    import uvicorn
    from starlette.testclient import TestClient

    import gemma_ane.runtime.model
    from gemma_ane.server import app as server

    served = []
    monkeypatch.setattr(gemma_ane.runtime.model, "load", lambda bundle, **kw: fake())
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    flags = ["--max-images", "1", "--max-image-bytes", str(len(SMALL) - 1), "--max-image-pixels", "2399"]
    assert server.main([str(tmp_path), "--port", "0", *flags]) == 0
    with TestClient(served[0]) as http:
        assert_openai_error(ask(http, image_url(SMALL), image_url(SMALL)), 400, "messages")
        assert "bytes" in too_large(ask(http, image_url(SMALL)))
    flags[3] = str(len(SMALL))
    assert server.main([str(tmp_path), "--port", "0", *flags]) == 0
    with TestClient(served[1]) as http:
        assert "pixels" in too_large(ask(http, image_url(SMALL)))

    monkeypatch.setattr(gemma_ane.runtime.model, "load", lambda bundle, **kw: pytest.fail("loaded despite a bad flag"))
    assert server.main([str(tmp_path), "--max-images", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "gemma-ane serve: error: --max-images -1: must be >= 0"  # the flag typed


# -- end to end: a bundle with a vision model -----------------------------------------------------------------


@pytest.mark.slow
def test_an_image_over_http_equals_the_library(vision_bundle):
    picture = png(40, 60, seed=3)
    question = "What is in this picture?"
    with serving(gemma_ane.load(vision_bundle, backend="mil")) as http:
        client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        r = client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": [image_url(picture), text(question)]}],
            temperature=0,
            max_tokens=4,
            logprobs=True,
        )
    reference = gemma_ane.load(vision_bundle, backend="mil")
    want = reference.generate(
        messages=[{"role": "user", "content": [{"type": "image", "image": picture}, text(question)]}],
        temperature=0,
        max_tokens=4,
    )
    vocab = Vocab(reference.tokenizer)
    assert [t.token for t in r.choices[0].logprobs.content] == [vocab(t)[0] for t in want.tokens]
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.prompt_tokens == want.prompt_tokens > 70  # the image's 70 soft tokens are counted


# -- remote image URLs: refused unless serve --allow-remote-images -------------------------------------------------


@pytest.fixture
def web():
    """A loopback HTTP server: /small.png (SMALL), /big.png (a larger file), /moved (to /small.png), /ftp (a
    redirect off http), and 404 for anything else. Yields its base URL and the paths it was asked for."""
    import http.server
    import threading

    files, asked = {"/small.png": SMALL, "/big.png": png(60, 60)}, []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            moved = {"/moved": "/small.png", "/ftp": "ftp://127.0.0.1/x.png"}.get(self.path)
            if moved:
                self.send_response(302)
                self.send_header("Location", moved)
                self.end_headers()
            elif self.path in files:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(files[self.path])
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def remote(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_remote_urls_are_refused_and_never_fetched_by_default(web):
    base, asked = web
    with serving(fake()) as http:
        r = ask(http, remote(f"{base}/small.png"))
    assert (
        "remote image URLs are not fetched"
        in assert_openai_error(r, 400, "messages[0].content[0].image_url")["message"]
    )
    assert asked == []


def test_allowed_remote_images_are_fetched_within_the_limits(web):
    base, asked = web
    model = fake()
    with serving(model, remote_images=True, max_image_bytes=len(SMALL), allow_fetch_from=["127.0.0.1"]) as http:
        assert ask(http, remote(f"{base}/small.png"), text("and"), remote(f"{base}/moved")).status_code == 200
        assert f"more than the limit of {len(SMALL)}" in too_large(ask(http, remote(f"{base}/big.png")))
        for path in ["/nowhere.png", "/ftp"]:  # the reason goes to the log: see test_fetch
            message = assert_openai_error(ask(http, remote(base + path)), 400, "messages[0].content[0].image_url")
            assert f"could not fetch '{base}{path}'" in message["message"]
        ok = ask(http, image_url(SMALL))  # data: URLs as ever
    assert ok.status_code == 200
    assert model.calls[0]["messages"][0]["content"] == [
        {"type": "image", "image": SMALL},
        text("and"),
        {"type": "image", "image": SMALL},
    ]
    # one request's images are fetched at once, on the fetch pool: their order is the pool's
    assert sorted(asked[:3]) == ["/moved", "/small.png", "/small.png"]
    assert asked[3:] == ["/big.png", "/nowhere.png", "/ftp"]


def test_serve_allow_remote_images_turns_fetching_on(monkeypatch, tmp_path, web):
    import uvicorn
    from starlette.testclient import TestClient

    import gemma_ane.runtime.model
    from gemma_ane.server import app as server

    base, asked = web
    served = []
    monkeypatch.setattr(gemma_ane.runtime.model, "load", lambda bundle, **kw: fake())
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    for flags in ([], ["--allow-remote-images", "--allow-fetch-from", "127.0.0.1"], ["--allow-remote-images"]):
        assert server.main([str(tmp_path), "--port", "0", *flags]) == 0
    statuses = []
    for app in served:
        with TestClient(app) as http:
            statuses.append(ask(http, remote(f"{base}/small.png")).status_code)
    assert statuses == [400, 200, 400] and asked == ["/small.png"]  # loopback only through the allowlist

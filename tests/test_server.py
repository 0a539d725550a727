"""`gemma-ane serve`: a real server process on the tiny bundle (MIL backend), driven by the official
openai client and by raw HTTP, checked against the same bundle run in-process by the library.

The random tiny model never opens a thought channel by itself, so reasoning is checked in-process
(Starlette's TestClient) with a scripted model that yields the runtime's own Event objects.

Exact equality with a fresh run needs the server's caches to hold no reusable prefix: reusing one
shifts the prefill batches, and fp16 batch and single-step results differ by up to ~0.2 in the
logits, enough to change a draw at temperature 3. Every prompt compared exactly is therefore
longer than the tiny bundle's 16-token sliding window, so whatever the previous request left is
discarded; the reference model is reset before every run. The disconnect test does exercise a
rewind, and compares greedy tokens and logprobs within that tolerance.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields
from pathlib import Path

import httpx
import pytest
from margins import assert_greedy_prefix
from openai import APIError as OpenAIAPIError
from openai import OpenAI
from scripted import TEMPLATE, ScriptedEngine

import gemma_ane
from gemma_ane.oracle.tokenizer_files import build_tokenizer, write_tokenizer_files
from gemma_ane.runtime.chat import ChatTemplate
from gemma_ane.runtime.model import Event, Model
from gemma_ane.server.app import Vocab, build_app

CONTEXT = 128
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE = 8
NAME = "bundle"  # the served model's id: the bundle directory's name
# sampled settings under which the tiny model's output depends on every parameter and the seed
HOT = dict(temperature=3.0, top_p=1.0)
HOT_EXTRA = dict(top_k=0)
RAW = "Once upon a time, in a land far away, there lived a model"  # 29 tokens


def msgs(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


# -- the server process ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle(tiny_bundle16, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / NAME  # the model id is the bundle directory's name
    out.symlink_to(tiny_bundle16, target_is_directory=True)
    return out


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path, reference):
        self.url, self.proc, self.log, self.reference = url, proc, log, reference

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=AUTH, timeout=120, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while (h := self.health())["generating"] or h["waiting"]:
            assert time.monotonic() < deadline, f"server still busy: {h}"
            time.sleep(0.05)


class Fresh:
    """The library on the same bundle, reset before every run: what a fresh server would answer."""

    def __init__(self, model):
        self.model, self.tokenizer = model, model.tokenizer

    def generate(self, *args, **kw):
        self.model.reset()
        return self.model.generate(*args, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gemma_ane.server.app",
                str(bundle),
                "--port",
                str(port),
                "--backend",
                "mil",
                "--api-key",
                KEY,
                "--max-queue",
                str(MAX_QUEUE),
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        reference = gemma_ane.load(bundle, backend="mil")  # loads while the server does
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text(errors='replace')[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up within 180 s"
            time.sleep(0.2)
        yield Server(url, proc, log, Fresh(reference))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(errors="replace")


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def stream_text(events) -> tuple[str, str | None, object]:
    """(content, finish_reason, usage) from an openai chat stream."""
    text, finish, usage = "", None, None
    for chunk in events:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


# -- the openai client ----------------------------------------------------------------------------


def test_health_and_models(server, client):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == NAME
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


SAMPLING = dict(temperature=4.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=7)
EXTENSIONS = dict(top_k=50, min_p=0.1, repetition_penalty=1.2)


def test_chat_equals_the_library_and_every_parameter_reaches_the_sampler(server, client):
    m = msgs("tell me a story")
    r = client.chat.completions.create(model=NAME, messages=m, max_tokens=16, extra_body=EXTENSIONS, **SAMPLING)
    want = server.reference.generate(messages=m, max_tokens=16, **SAMPLING, **EXTENSIONS)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == NAME and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text and choice.finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, len(want.tokens))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    for name in EXTENSIONS:  # without any one extension the text changes: none is dropped on the way
        other = {k: v for k, v in EXTENSIONS.items() if k != name}
        assert server.reference.generate(messages=m, max_tokens=16, **SAMPLING, **other).text != want.text, name

    stream = client.chat.completions.create(
        model=NAME,
        messages=m,
        max_tokens=16,
        extra_body=EXTENSIONS,
        stream=True,
        stream_options={"include_usage": True},
        **SAMPLING,
    )
    text, finish, usage = stream_text(stream)
    assert (text, finish) == (want.text, want.finish_reason)
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.prompt_tokens, len(want.tokens))


def test_max_completion_tokens_and_finish_length(client):
    r = client.chat.completions.create(model=NAME, messages=msgs("count"), max_completion_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_completions_raw_prompt(server, client):
    prompt = RAW
    kw = dict(max_tokens=12, seed=3, **HOT)
    r = client.completions.create(model=NAME, prompt=prompt, extra_body=HOT_EXTRA, **kw)
    want = server.reference.generate(prompt, raw=True, **kw, **HOT_EXTRA)
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    # raw: <bos> + the text, no chat template
    tok = server.reference.tokenizer
    assert r.usage.prompt_tokens == 1 + len(tok.encode(prompt, add_special_tokens=False).ids)
    assert r.usage.completion_tokens == len(want.tokens)

    text, finish = "", None
    for chunk in client.completions.create(model=NAME, prompt=prompt, stream=True, extra_body=HOT_EXTRA, **kw):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert (text, finish) == (want.text, want.finish_reason)

    # the legacy API's default length is 16 tokens; greedy never stops early on this model
    r = client.completions.create(model=NAME, prompt=RAW, temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_chat_logprobs(server, client):
    m = msgs("hello")
    r = client.chat.completions.create(
        model=NAME, messages=m, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    want = server.reference.generate(messages=m, max_tokens=6, temperature=0, logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert [e.logprob for e in content] == want.logprobs
    for e, top in zip(content, want.top_logprobs):
        assert [t.logprob for t in e.top_logprobs] == [lp for _, lp in top]
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob)  # greedy took the best
        assert e.bytes == list(e.token.encode())

    # sampled: byte tokens (half a UTF-8 character) report U+FFFD as text and their one raw byte
    r = client.chat.completions.create(
        model=NAME, messages=m, max_tokens=24, seed=1, logprobs=True, top_logprobs=2, extra_body=HOT_EXTRA, **HOT
    )
    want = server.reference.generate(messages=m, max_tokens=24, seed=1, logprobs=2, **HOT, **HOT_EXTRA)
    content, tokenizer = r.choices[0].logprobs.content, server.reference.tokenizer
    # the content's tokens alone: a control token that decodes to nothing is no content (issue 44)
    kept = [i for i, t in enumerate(want.tokens) if tokenizer.decode([t], skip_special_tokens=True)]
    assert len(kept) < len(want.tokens), "pick a seed whose output has a control token"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None  # every kept token is the content's
    assert [e.logprob for e in content] == [want.logprobs[i] for i in kept]
    assert [e.token for e in content] == [tokenizer.decode([want.tokens[i]], skip_special_tokens=False) for i in kept]
    partial = [e for e in content if "\ufffd" in e.token]
    assert partial, "pick a seed whose output has a byte token"
    assert all(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for e in partial)

    stream = client.chat.completions.create(
        model=NAME,
        messages=m,
        max_tokens=24,
        seed=1,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body=HOT_EXTRA,
        **HOT,
    )
    streamed = [e.logprob for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == [want.logprobs[i] for i in kept]


def test_completion_logprobs(server, client):
    r = client.completions.create(model=NAME, prompt=RAW, max_tokens=5, logprobs=2, seed=4, extra_body=HOT_EXTRA, **HOT)
    want = server.reference.generate(RAW, raw=True, max_tokens=5, logprobs=2, seed=4, **HOT, **HOT_EXTRA)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == want.logprobs and len(lp.tokens) == 5
    assert all(len(t) <= 3 for t in lp.top_logprobs)  # the 2 most likely, and the chosen token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_seed_reproducibility(client):
    def run(seed, stream=False):
        kw = dict(model=NAME, messages=msgs("surprise me"), max_tokens=16, seed=seed, extra_body=HOT_EXTRA, **HOT)
        if stream:
            return stream_text(client.chat.completions.create(stream=True, **kw))[0]
        return client.chat.completions.create(**kw).choices[0].message.content

    first = run(11)
    assert run(11) == first and run(11, stream=True) == first
    assert run(12) != first


def _stop_string(text: str) -> str:
    """Two letters from the middle of text, where a stop string would cut it."""
    for i in range(3, len(text) - 2):
        if text[i : i + 2].isalpha() and text[i : i + 2].isascii():
            return text[i : i + 2]
    return ""


def _first_cut(run) -> tuple[int, str, str]:
    """(seed, text, stop) for the first seed whose output has a stop string to cut at."""
    for seed in range(20, 30):
        text = run(seed)[0]
        stop = _stop_string(text)
        if stop:
            return seed, text, stop
    pytest.fail("no seed gave a text with two letters in a row")


def test_stop_strings(client):
    def chat(seed, stop=None, stream=False):
        r = client.chat.completions.create(
            model=NAME,
            messages=msgs("go on"),
            max_tokens=40,
            seed=seed,
            stop=stop,
            stream=stream,
            extra_body=HOT_EXTRA,
            **HOT,
        )
        return stream_text(r)[:2] if stream else (r.choices[0].message.content, r.choices[0].finish_reason)

    def complete(seed, stop=None):
        c = client.completions.create(
            model=NAME, prompt=RAW, max_tokens=40, seed=seed, stop=stop, extra_body=HOT_EXTRA, **HOT
        ).choices[0]
        return c.text, c.finish_reason

    for run in (chat, complete):
        seed, full, stop = _first_cut(run)
        expected = (full[: full.index(stop)], "stop")
        assert run(seed, stop) == expected
        assert run(seed, ["never-emitted", stop]) == expected
        if run is chat:
            assert chat(seed, stop, stream=True) == expected


def test_usage_counts_the_rendered_prompt_and_thinking_switch(server, client, bundle):
    template = ChatTemplate((bundle / "hf_model" / "chat_template.jinja").read_text())
    tok = server.reference.tokenizer
    m = msgs("think about it")

    def n_prompt(thinking):
        return len(tok.encode(template.render(m, enable_thinking=thinking), add_special_tokens=False).ids)

    base = client.chat.completions.create(model=NAME, messages=m, max_tokens=3, temperature=0)
    assert base.usage.prompt_tokens == n_prompt(False)
    assert (base.usage.completion_tokens, base.usage.total_tokens) == (3, n_prompt(False) + 3)
    for extra in ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}):
        r = client.chat.completions.create(model=NAME, messages=m, max_tokens=3, temperature=0, extra_body=extra)
        assert r.usage.prompt_tokens == n_prompt(True) > n_prompt(False), extra


def test_a_follow_up_turn_reports_the_prompt_tokens_it_reused(client):
    """Each turn processes only what is new: usage.prompt_tokens_details.cached_tokens (OpenAI's
    field) counts the tokens the model's caches already held, past the ring's wrap too."""
    m1 = msgs("Tell me about the river that runs through the old town")
    r1 = client.chat.completions.create(model=NAME, messages=m1, max_tokens=12, temperature=0)
    assert r1.usage.prompt_tokens + 12 > 16  # the 16-slot ring wrapped during turn 1
    m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "more"}]
    stream = client.chat.completions.create(
        model=NAME, messages=m2, max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = stream_text(stream)[2]
    assert usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    r3 = client.chat.completions.create(model=NAME, messages=msgs("something else entirely"), max_tokens=1)
    assert r3.usage.prompt_tokens_details.cached_tokens < r3.usage.prompt_tokens


def test_logit_bias_bans_and_forces_tokens_as_the_library_does(server, client):
    """-100 bans a token (greedy and sampled), +100 forces one; the server's answers are the library's."""
    greedy = dict(max_tokens=12, temperature=0)
    hot = dict(max_tokens=24, seed=5, **HOT, **HOT_EXTRA)
    for kw in (greedy, hot):
        free = server.reference.generate(RAW, raw=True, logprobs=0, **kw)
        banned = {t: -100 for t in free.tokens}  # everything the unbiased run chose
        want = server.reference.generate(RAW, raw=True, logprobs=0, logit_bias=banned, **kw)
        assert len(want.tokens) == kw["max_tokens"] and not set(want.tokens) & set(banned)
        body = {k: v for k, v in kw.items() if k not in HOT_EXTRA}
        r = client.completions.create(
            model=NAME,
            prompt=RAW,
            logit_bias={str(t): b for t, b in banned.items()},
            logprobs=0,
            extra_body=HOT_EXTRA,
            **body,
        )
        # the chosen tokens' logprobs (the model's own, unbiased) tell the tokens apart where the
        # text cannot: the greedy run's replacement decodes to ""
        assert r.choices[0].logprobs.token_logprobs == want.logprobs != free.logprobs
        assert r.choices[0].text == want.text
    forced = 300
    want = server.reference.generate(messages=M, logit_bias={forced: 100}, logprobs=0, **hot)
    assert want.tokens == [forced] * hot["max_tokens"]
    r = client.chat.completions.create(
        model=NAME,
        messages=M,
        logit_bias={str(forced): 100},
        logprobs=True,
        max_tokens=24,
        seed=5,
        extra_body=HOT_EXTRA,
        **HOT,
    )
    assert [e.logprob for e in r.choices[0].logprobs.content] == want.logprobs
    assert r.choices[0].message.content == want.text


# -- errors over raw HTTP -------------------------------------------------------------------------

M = msgs("hi")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LONG = "hello there " * 200  # far more than the 128-token context

BAD_REQUESTS = [
    # (path, body, status, param, code)
    (CHAT, b"{not json", 400, None, None),
    (CHAT, b"[1, 2]", 400, None, None),
    (CHAT, b"[" * 100_000, 400, None, None),
    (CHAT, {"messages": "hi"}, 400, "messages", None),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages[0]", None),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0].image_url",
        None,
    ),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None),
    (CHAT, {"messages": M, "temperature": "hot"}, 400, "temperature", None),
    (CHAT, {"messages": M, "stream": "yes"}, 400, "stream", None),
    (CHAT, {"messages": M, "stop": 5}, 400, "stop", None),
    (CHAT, {"messages": M, "stop": ["ok", 5]}, 400, "stop", None),
    (CHAT, {"messages": M, "max_tokens": 2.5}, 400, "max_tokens", None),
    (CHAT, {"messages": M, "seed": "x"}, 400, "seed", None),
    (CHAT, {"messages": M, "logprobs": 1}, 400, "logprobs", None),
    (CHAT, {"messages": M, "top_k": 1.5}, 400, "top_k", None),
    (CHAT, {"messages": M, "chat_template_kwargs": {"enable_thinking": "yes"}}, 400, "enable_thinking", None),
    (CHAT, {"messages": M, "temperature": -1}, 400, "temperature", None),
    (CHAT, {"messages": M, "top_p": 0}, 400, "top_p", None),
    (CHAT, {"messages": M, "top_p": 1.5}, 400, "top_p", None),
    (CHAT, {"messages": M, "top_k": -1}, 400, "top_k", None),
    (CHAT, {"messages": M, "min_p": 2}, 400, "min_p", None),
    (CHAT, {"messages": M, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    (CHAT, {"messages": M, "presence_penalty": 3}, 400, "presence_penalty", None),
    (CHAT, {"messages": M, "frequency_penalty": -2.5}, 400, "frequency_penalty", None),
    (CHAT, {"messages": M, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    (CHAT, {"messages": M, "top_logprobs": 2}, 400, "top_logprobs", None),
    (CHAT, {"messages": M, "seed": 2**63}, 400, "seed", None),
    (CHAT, {"messages": M, "n": 17}, 400, "n", None),
    (CHAT, {"messages": M, "max_tokens": 0}, 400, "max_tokens", None),
    (CHAT, {"messages": M, "max_completion_tokens": -5}, 400, "max_completion_tokens", None),
    (CHAT, {"messages": msgs(LONG)}, 400, "messages", "context_length_exceeded"),
    (CHAT, {"model": "gpt-4o", "messages": M}, 404, "model", "model_not_found"),
    (CHAT, {"messages": M, "tools": {"type": "function", "function": {"name": "f"}}}, 400, "tools", None),
    (CHAT, {"messages": M, "response_format": {"type": "xml"}}, 400, "response_format.type", None),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    (COMPLETIONS, {"prompt": "x", "echo": "yes"}, 400, "echo", None),
    (COMPLETIONS, {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
]


def assert_openai_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code), err
    return err


@pytest.mark.parametrize(
    "path,body,status,param,code",
    BAD_REQUESTS,
    ids=[f"{i}-{p.rsplit('/', 1)[1]}" for i, (p, *_rest) in enumerate(BAD_REQUESTS)],
)
def test_bad_requests(server, path, body, status, param, code):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers=AUTH, timeout=30)
    else:
        r = server.post(path, body)
    assert_openai_error(r, status, param, code)


def test_unknown_paths_methods_and_models(server):
    assert_openai_error(httpx.get(server.url + "/nope"), 404, code="not_found")
    assert_openai_error(httpx.post(server.url + "/v1/embeddings", json={}, headers=AUTH), 404, code="not_found")
    assert_openai_error(httpx.get(server.url + "/v1/models/gpt-4o", headers=AUTH), 404, "model", "model_not_found")
    assert httpx.get(server.url + CHAT, headers=AUTH).status_code == 405


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}],
    ids=["missing", "wrong", "basic", "no-scheme"],
)
def test_api_key(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("POST", COMPLETIONS)):
        r = httpx.request(method, server.url + path, json={"messages": M, "prompt": "x"}, headers=headers)
        assert_openai_error(r, 401, code="invalid_api_key")
    assert httpx.get(server.url + "/health").status_code == 200  # liveness stays open


def test_body_size_cap(server):
    big = json.dumps({"messages": msgs("x" * 1_100_000)}).encode()
    assert_openai_error(httpx.post(server.url + CHAT, content=big, headers=AUTH), 413, code="request_too_large")

    def chunked():  # no Content-Length: the cap must hold while reading
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    assert_openai_error(httpx.post(server.url + CHAT, content=chunked(), headers=AUTH), 413, code="request_too_large")


# -- concurrency, disconnects, the queue ----------------------------------------------------------


def _request(i: int) -> tuple[str, dict]:
    """Eight different requests, chat and completions, streamed and not, each with its own seed."""
    base = dict(max_tokens=10, seed=100 + i, **HOT, **HOT_EXTRA, stream=i % 2 == 1)
    if i % 4 < 2:
        return CHAT, {**base, "messages": msgs(f"client {i} says hello")}
    return COMPLETIONS, {**base, "prompt": f"client {i} writes: {RAW}"}


async def _fetch(c: httpx.AsyncClient, path: str, body: dict) -> str:
    r = await c.post(path, json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    if not body["stream"]:
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x)["choices"] for x in lines[:-1]]
    return "".join(c[0]["delta"].get("content", "") if path == CHAT else c[0]["text"] for c in chunks if c)


def test_concurrent_clients_equal_one_by_one(server):
    async def run(concurrently: bool) -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            if concurrently:
                return await asyncio.gather(*(_fetch(c, *_request(i)) for i in range(8)))
            return [await _fetch(c, *_request(i)) for i in range(8)]

    together = asyncio.run(run(True))
    alone = asyncio.run(run(False))
    assert together == alone
    assert len(set(alone)) == 8  # the seeds and prompts really differ


def test_disconnect_mid_stream_cancels_and_leaves_the_model_consistent(server):
    # A short raw prompt: the cancelled run leaves a few tokens in the cache, and the next request
    # (same prompt) rewinds to it. That shifts the prefill batches, so the check is greedy, with
    # logprobs equal to a fresh run's within fp16 batch-vs-step noise.
    prompt = "Once"
    with httpx.Client(timeout=60) as c:
        with c.stream(
            "POST",
            server.url + COMPLETIONS,
            headers=AUTH,  # logprobs: one chunk per token
            json={"prompt": prompt, "max_tokens": 500, "temperature": 0, "logprobs": 0, "stream": True},
        ) as r:
            assert r.status_code == 200
            seen = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.append(json.loads(line[len("data: ") :]))
                    if len(seen) == 3:
                        break
    rid = seen[0]["id"]
    deadline = time.monotonic() + 20
    while not (m := re.search(rf"{rid}: client gone, generation stopped after (\d+) tokens", server.logs())):
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert int(m.group(1)) < 60  # greedy runs to the end of the context (~124 tokens) unless cancelled

    r = server.post(COMPLETIONS, {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2})
    assert r.status_code == 200
    got = r.json()["choices"][0]["logprobs"]
    want = server.reference.generate(prompt, raw=True, max_tokens=10, temperature=0, logprobs=2)
    # the server's tokens as ids: each is one of the reference's top two at its step, or no near-tie (-1)
    vocab = Vocab(server.reference.tokenizer)
    ids = [{vocab(t)[0]: t for t, _ in top}.get(piece, -1) for piece, top in zip(got["tokens"], want.top_logprobs)]
    # greedy tokens up to a near-tie in the reference's top two (logprobs: the logits' margins), within the fp16
    # batch-vs-step bound above; the logprobs alike up to there
    steps = assert_greedy_prefix(ids, want.tokens, [dict(top) for top in want.top_logprobs], 0.25, 3, "rewound")
    assert got["token_logprobs"][:steps] == pytest.approx(want.logprobs[:steps], abs=0.25)


def test_full_queue_answers_429_and_recovers(server):
    # greedy on this model never stops: each request runs to the end of the context (seconds)
    long = {"prompt": RAW, "max_tokens": 500, "temperature": 0}
    n = MAX_QUEUE + 5

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            tasks = [asyncio.create_task(c.post(COMPLETIONS, json=long, headers=AUTH)) for _ in range(n)]
            rejected = []
            deadline = time.monotonic() + 30
            while len(rejected) < n - MAX_QUEUE - 1 and time.monotonic() < deadline:
                done, _ = await asyncio.wait(
                    [t for t in tasks if not t.done()], timeout=1, return_when=asyncio.FIRST_COMPLETED
                )
                rejected = [t.result() for t in tasks if t.done()]
            # a full queue refuses before any prompt is rendered: the admitted ones may still be preparing
            health = (await c.get("/health")).json()
            while not health["generating"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                health = (await c.get("/health")).json()
            for t in tasks:  # hang up on the admitted ones: the server must cancel them all
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return rejected, health

    rejected, health = asyncio.run(run())
    assert len(rejected) == n - MAX_QUEUE - 1
    assert health["generating"] and health["waiting"] == MAX_QUEUE
    for r in rejected:
        assert r.headers["retry-after"].isdigit()
        assert assert_openai_error(r, 429, code="queue_full")["type"] == "rate_limit_error"
    server.wait_idle()
    after = dict(prompt=RAW, max_tokens=8, seed=2, **HOT, **HOT_EXTRA)
    r = server.post(COMPLETIONS, after)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == server.reference.generate(raw=True, **after).text


def test_serve_argument_errors_are_one_line(tmp_path, bundle):
    (tmp_path / "junk.npz").write_text("not a zip")
    for args, needle in (
        ([str(tmp_path / "missing")], "not a bundle directory"),
        ([str(bundle), "--backend", "mil", "--prompt-cache", str(tmp_path / "junk.npz")], "junk.npz: not a prompt"),
        ([str(tmp_path), "--max-queue", "-1"], "--max-queue -1: must be >= 0"),  # the flag typed, not the keyword
        ([str(tmp_path), "--port", "70000"], "--port 70000: expected 0..65535"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "gemma_ane.server.app", *args], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- in-process, with a scripted model ------------------------------------------------------------


class FakeTokenizer:
    decoder = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)

    def id_to_token(self, i):
        return f"<{i}>"


class FakeModel(Model):
    """The runtime's own Model over scripted.py's engine without a network (the test tokenizer, Gemma 4's template,
    a bundle directory holding only the tokenizer, which a grammar reads), whose every prompt is 5 tokens (8 with
    thinking, one placeholder an image) and whose generation is a fixed script of runtime Events (an exception in
    the script is raised there). Every request goes through the real Model.prepare; `calls` records what each
    generation ran with: the GenerationRequest's fields, with the sampling, tools and tool choice as prepare checked
    them."""

    context = 64
    head = "logits"

    def __init__(self, script, delay: float = 0.0):
        super().__init__(
            fake_root(),
            ScriptedEngine(512),
            build_tokenizer(512),
            ChatTemplate(TEMPLATE),
            {},
            {"vocab_size": 512},
            "none",
        )
        self.script, self.delay, self.calls = script, delay, []

    def _prompt_ids(self, prompt, messages, raw, enable_thinking, system, tools):
        super()._prompt_ids(prompt, messages, raw, enable_thinking, system, tools)  # its checks, its rendering
        return [2] * (5 + 3 * enable_thinking)

    def _run(self, prepared, cancelled):
        asked = prepared.request
        self.calls.append(
            {
                **{f.name: getattr(asked, f.name) for f in fields(asked) if f.name != "sampling"},
                **{f.name: getattr(prepared.params, f.name) for f in fields(prepared.params)},
                "tools": prepared.tools,
                "tool_choice": prepared.rule.choice,
            }
        )
        for ev in self.script:
            time.sleep(self.delay)
            if isinstance(ev, Exception):
                raise ev
            yield ev


@functools.cache
def fake_root() -> Path:
    """A bundle directory holding the 512-token test tokenizer's files, for every FakeModel of the session."""
    root = Path(tempfile.mkdtemp(prefix="fake-bundle-"))
    write_tokenizer_files(root / "hf_model", 512)
    return root


THOUGHT = [
    Event(token=100),
    Event(token=11, reasoning="Let me think."),
    Event(token=12, reasoning=" Done."),
    Event(token=101),
    Event(token=13, text="Hello"),
    Event(token=14, text=" world"),
    Event(token=106),
    Event(finish_reason="stop"),
]


@pytest.fixture
def fake_client():
    """An openai client talking to build_app over a fake model, in-process."""
    from starlette.testclient import TestClient

    def make(model, raise_server_exceptions=True, **kw):
        http = TestClient(build_app(model, model_name="fake", **kw), raise_server_exceptions=raise_server_exceptions)
        return http, OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)

    return make


def test_token_bytes_of_a_byte_fallback_piece():
    class SentencePieceLike(FakeTokenizer):  # Gemma's own tokenizer spells raw bytes <0xNN>
        def decode(self, ids, skip_special_tokens=True):
            return {7: "\ufffd", 8: "é"}[ids[0]]

        def id_to_token(self, i):
            return {7: "<0xC3>", 8: "é"}[i]

    vocab = Vocab(SentencePieceLike())
    assert vocab(7) == ("\ufffd", [0xC3]) and vocab(8) == ("é", [0xC3, 0xA9])


def test_token_bytes_of_every_byte_level_piece():
    from gemma_ane.oracle.tokenizer_files import MIN_VOCAB_SIZE, build_tokenizer

    vocab = Vocab(build_tokenizer(MIN_VOCAB_SIZE))  # ids 128..383 spell the bytes 0..255, in the GPT-2 alphabet
    assert [vocab(128 + b)[1] for b in range(256)] == [[b] for b in range(256)]


def test_reasoning_on_the_message_and_in_stream_deltas(fake_client):
    model = FakeModel(THOUGHT)
    http, client = fake_client(model)
    with http:
        r = client.chat.completions.create(
            model="fake", messages=M, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
        )
        msg = r.choices[0].message
        assert (msg.content, msg.reasoning_content, r.choices[0].finish_reason) == (
            "Hello world",
            "Let me think. Done.",
            "stop",
        )
        assert r.usage.prompt_tokens == 8 and r.usage.completion_tokens == 7

        deltas = [
            c.choices[0].delta
            for c in client.chat.completions.create(
                model="fake", messages=M, stream=True, extra_body={"enable_thinking": True}
            )
            if c.choices
        ]
        reasoning = [getattr(d, "reasoning_content", None) for d in deltas]
        content = [d.content for d in deltas]
        assert "".join(r for r in reasoning if r) == "Let me think. Done."
        assert "".join(c for c in content if c) == "Hello world"
        # reasoning streams first, and never in the same delta field as the answer
        assert max(i for i, r in enumerate(reasoning) if r) < min(i for i, c in enumerate(content) if c)

        client.chat.completions.create(model="fake", messages=M)
    assert [c["enable_thinking"] for c in model.calls] == [True, True, False]


def test_no_api_key_configured_needs_no_header(fake_client):
    http, _ = fake_client(FakeModel(THOUGHT))
    with http:
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert http.get("/v1/models").json()["data"][0]["id"] == "fake"


def test_a_failing_generation_is_an_error_not_a_traceback(fake_client):
    model = FakeModel([Event(token=5, text="a"), RuntimeError("secret internals")])
    http, client = fake_client(model)
    with http:
        r = http.post("/v1/chat/completions", json={"messages": M})
        assert r.status_code == 500 and "secret" not in r.text and "Traceback" not in r.text
        assert r.json()["error"]["type"] == "server_error"
        with pytest.raises(OpenAIAPIError):
            stream_text(client.chat.completions.create(model="fake", messages=M, stream=True))
        model.script = THOUGHT  # the worker survives and serves the next request
        r = http.post("/v1/chat/completions", json={"messages": M})
        assert r.json()["choices"][0]["message"]["content"] == "Hello world"


def test_an_unexpected_exception_is_a_500_in_openai_shape(fake_client):
    class Broken(FakeModel):
        def _prompt_ids(self, *a, **kw):
            raise RuntimeError("secret internals")

    http, _ = fake_client(Broken(THOUGHT), raise_server_exceptions=False)
    with http:
        r = http.post("/v1/chat/completions", json={"messages": M})
    assert r.status_code == 500 and "secret" not in r.text
    assert r.json()["error"]["type"] == "server_error"


def test_requests_run_in_arrival_order_and_overflow_is_429(fake_client):
    model = FakeModel([Event(token=5, text="a"), Event(finish_reason="stop")], delay=0.3)
    http, _ = fake_client(model, max_queue=2)
    statuses = {}

    def post(i):
        statuses[i] = http.post("/v1/completions", json={"prompt": f"p{i}"}).status_code

    with http:
        threads = []
        for i in range(5):
            threads.append(threading.Thread(target=post, args=(i,)))
            threads[-1].start()
            time.sleep(0.1)  # p0 runs (0.6 s); p1 and p2 wait; p3 and p4 find the queue full
        for t in threads:
            t.join(30)
    assert statuses == {0: 200, 1: 200, 2: 200, 3: 429, 4: 429}
    assert [c["prompt"] for c in model.calls] == ["p0", "p1", "p2"]


# -- what the server does not implement: refused by name, never ignored ------------------------------------------

REFUSED = [
    # (endpoint, field, value): every one a 400 naming the field; null would count as absent
    ("chat", "functions", []),
    ("chat", "function_call", "none"),
    ("chat", "n", 17),
    ("chat", "n", True),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "web_search_options", {}),
    ("chat", "reasoning_effort", "extreme"),
    ("chat", "verbosity", "low"),
    ("chat", "moderation", {}),
    ("completion", "n", 0),
    ("completion", "best_of", 2),
    ("completion", "echo", "yes"),
    ("completion", "suffix", "end"),
]
ACCEPTED = [
    # the values that ask for nothing, OpenAI's bookkeeping fields (no effect on the answer), and
    # fields OpenAI does not define (ignored, as before)
    ("chat", {"n": 1, "modalities": ["text"], "response_format": {"type": "text"}, "tools": None}),
    ("chat", {"user": "u1", "metadata": {"a": "b"}, "store": True, "service_tier": "auto"}),
    ("chat", {"safety_identifier": "x", "prompt_cache_key": "k", "not_an_openai_field": 1}),
    ("completion", {"n": 1, "best_of": 1, "echo": False, "suffix": "", "user": "u1", "not_an_openai_field": 1}),
]


def _post(http, kind: str, extra: dict):
    if kind == "chat":
        return http.post(CHAT, json={"messages": M, **extra})
    return http.post(COMPLETIONS, json={"prompt": "x", **extra})


@pytest.mark.parametrize("kind,field,value", REFUSED, ids=[f"{k}-{f}-{json.dumps(v)}" for k, f, v in REFUSED])
def test_what_the_server_does_not_implement_is_refused_by_name(fake_client, kind, field, value):
    model = FakeModel(THOUGHT)
    http, _ = fake_client(model)
    with http:
        assert_openai_error(_post(http, kind, {field: value}), 400, field)
    assert model.calls == []


@pytest.mark.parametrize("kind,extra", ACCEPTED)
def test_what_asks_for_nothing_is_accepted(fake_client, kind, extra):
    model = FakeModel(THOUGHT)
    http, _ = fake_client(model)
    with http:
        r = _post(http, kind, extra)
    assert r.status_code == 200, r.text
    assert len(model.calls) == 1


def test_logit_bias_reaches_the_runtime_with_int_ids(fake_client):
    model = FakeModel(THOUGHT)
    http, client = fake_client(model)
    with http:
        client.chat.completions.create(model="fake", messages=M, logit_bias={"5": -100, "511": 2.5})
        client.completions.create(model="fake", prompt="x", logit_bias={"0": 100}, stream=True).close()
        client.completions.create(model="fake", prompt="x")
    assert [c["logit_bias"] for c in model.calls] == [{5: -100.0, 511: 2.5}, {0: 100.0}, None]


BAD_BIAS = [
    ([5], "expected an object"),
    ({"x": 1}, "'x' is not a token id"),
    ({"-3": 1}, "'-3' is not a token id"),
    ({"512": 1}, "token 512 is not in the vocabulary of 512"),
    ({"5": 101}, "expected a number in [-100, 100]"),
    ({"5": "a"}, "expected a number in [-100, 100]"),
    ({str(i): -100 for i in range(512)}, "bans every token"),
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("bias,needle", BAD_BIAS, ids=[n for _, n in BAD_BIAS])
def test_bad_logit_bias_is_a_400_naming_it(fake_client, kind, bias, needle):
    model = FakeModel(THOUGHT)
    http, _ = fake_client(model)
    with http:
        err = assert_openai_error(_post(http, kind, {"logit_bias": bias}), 400, "logit_bias")
    assert needle in err["message"] and model.calls == []


def test_the_published_head_refuses_logit_bias(fake_client):
    model = FakeModel(THOUGHT)
    model.head = "token_id"  # chunk_3 returns the argmax token alone: no logits to bias
    http, _ = fake_client(model)
    with http:
        for kind in ("chat", "completion"):
            err = assert_openai_error(_post(http, kind, {"logit_bias": {"5": -100}}), 400, "logit_bias")
            assert "only the chosen token" in err["message"]
        assert _post(http, "chat", {"temperature": 0}).status_code == 200


def test_an_address_it_cannot_listen_on_is_refused_before_loading(monkeypatch, tmp_path, capsys):
    """A port in use or a host of no address: one line before the model loads (uvicorn said it after the load, in
    its startup log, and exited 3)."""
    import socket

    import gemma_ane.runtime.model
    from gemma_ane.server import app as server

    monkeypatch.setattr(gemma_ane.runtime.model, "load", lambda bundle, **kw: pytest.fail("loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert server.main([str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gemma-ane serve: error: --port {port}: cannot listen on 127.0.0.1 (Address already in use)"
    for host in ("999.1.1.1", "192.0.2.1"):  # no address at all; another machine's (TEST-NET-1)
        assert server.main([str(tmp_path), "--host", host]) == 2
        assert capsys.readouterr().err.startswith(f"gemma-ane serve: error: --host {host}: not an address of")


@pytest.mark.parametrize(
    "flags, allowed, drafts", [([], False, 0), (["--allow-special-tokens"], True, 0), (["--draft", "2"], False, 2)]
)
def test_serve_passes_its_startup_options_to_the_model(monkeypatch, tmp_path, flags, allowed, drafts):
    import uvicorn

    import gemma_ane.runtime.model
    from gemma_ane.server import app as server

    class Drafting(FakeModel):
        max_draft_tokens = 3  # as a bundle with a drafter says: --draft 2 is within it

    served = []
    monkeypatch.setattr(gemma_ane.runtime.model, "load", lambda bundle, **kw: Drafting([]))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    assert server.main([str(tmp_path), "--port", "0", *flags]) == 0
    [app] = served
    assert app.state.worker.model.allow_special_tokens is allowed
    assert app.state.worker.model.draft_tokens == drafts

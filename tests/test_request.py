"""A request is built once (Model.prepare): every check, the chat template rendered once, the grammar compiled once;
the server builds it before the request queues and its worker only runs it."""

from __future__ import annotations

import contextlib
import json

import pytest
from scripted import ASK, PARIS, WEATHER, script, scripted_model

from gemma_ane.runtime.chat import ChatTemplate
from gemma_ane.runtime.engine import MAX_SNAPSHOTS
from gemma_ane.runtime.request import Prepared
from gemma_ane.server.app import build_app

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    {"role": "assistant", "content": "It is 18 degrees."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture
def model():
    return scripted_model()


@contextlib.contextmanager
def renders(monkeypatch):
    """The chat template's renders from now on."""
    seen, render = [], ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render", lambda self, *a, **kw: seen.append(a) or render(self, *a, **kw))
    yield seen


def test_a_chat_request_with_tools_renders_the_template_once(model, monkeypatch):
    from starlette.testclient import TestClient

    script(model, monkeypatch, PARIS + "<|tool_response>")
    with TestClient(build_app(model, model_name="m")) as http, renders(monkeypatch) as seen:
        body = {"messages": CONVERSATION, "tools": [WEATHER], "max_tokens": 40}
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert len(seen) <= 2, f"{len(seen)} renders"


def test_the_python_api_renders_once_too(model, monkeypatch):
    script(model, monkeypatch, PARIS + "<|tool_response>")
    with renders(monkeypatch) as seen:
        r = model.generate(messages=CONVERSATION, tools=[WEATHER], max_tokens=40)
    assert r.finish_reason == "tool_calls" and len(seen) == 1


def test_turn_ends_are_where_each_turn_alone_ends(model):
    """Found in the ids, they are where the prompt of the conversation up to each earlier message ends (its
    rendering alone a prefix of the prompt), as rendering each prefix would find them."""
    ids = model.prompt_ids(messages=CONVERSATION, tools=[WEATHER])
    rendered = []
    for k in range(1, len(CONVERSATION)):
        part = model.chat_ids(CONVERSATION[:k], False, False, [WEATHER])
        if ids[: len(part)] == part:
            rendered.append(len(part))
    assert len(rendered) > MAX_SNAPSHOTS and model.turn_ends(CONVERSATION, ids) == rendered[-MAX_SNAPSHOTS:]


def test_a_prepared_request_runs_once_checked(model, monkeypatch):
    request = model.prepare(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=9, temperature=0)
    assert (
        isinstance(request, Prepared)
        and request.rule.bans == [48]
        and request.ids == model.prompt_ids(messages=ASK, tools=[WEATHER])
    )
    with pytest.raises(ValueError, match="not both"):
        list(model.stream_generate(messages=ASK, request=request))
    script(model, monkeypatch, "Sunny.<turn|>")
    events = list(model.stream_generate(request=request))
    assert "".join(ev.text for ev in events) == "Sunny." and events[-1].prompt_tokens == len(request.ids)


def test_the_server_queues_a_prepared_request(model, monkeypatch):
    from starlette.testclient import TestClient

    queued = []
    run = model.stream_generate
    monkeypatch.setattr(model, "stream_generate", lambda **kw: queued.append(kw) or run(**kw))
    script(model, monkeypatch, "Sunny.<turn|>")
    with TestClient(build_app(model, model_name="m")) as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, "logit_bias": {"9": -100}})
    assert r.json()["choices"][0]["message"]["content"] == "Sunny."
    (kw,) = queued
    assert set(kw) == {"request", "cancelled"} and kw["request"].params.logit_bias == {9: -100.0}
    assert json.dumps(r.json()["usage"]["prompt_tokens"]) == str(len(kw["request"].ids))


def test_the_servers_modules_stand_behind_the_runtimes_walls():
    from test_walls import CONVERTER_SIDE, imports

    for module in ("server.request", "server.response", "server.worker", "runtime.events", "runtime.gemma4"):
        banned = imports(module) & ({"torch", "transformers"} | {f"gemma_ane.{m}" for m in CONVERTER_SIDE})
        assert not banned, f"{module}.py imports {sorted(banned)}"


def test_images_for_a_bundle_without_vision_are_refused_when_prepared(model):
    from gemma_ane.runtime.images import ImageError

    messages = [
        {"role": "user", "content": [{"type": "image", "image": b"not even read"}, {"type": "text", "text": "?"}]}
    ]
    with pytest.raises(ImageError, match=r"messages\[0\].content\[0\]: this bundle has no vision model"):
        model.prepare(messages=messages)


def test_a_chat_request_with_a_response_format_builds_its_grammar_once(tmp_path, monkeypatch):
    from starlette.testclient import TestClient
    from test_token_bytes import metaspace_model

    from gemma_ane.runtime import grammar

    built, request_grammar = [], grammar.request_grammar
    monkeypatch.setattr(grammar, "request_grammar", lambda *a, **kw: built.append(a) or request_grammar(*a, **kw))
    with TestClient(build_app(metaspace_model(tmp_path), model_name="m")) as http:
        body = {"messages": ASK, "response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 30}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert len(built) == 1

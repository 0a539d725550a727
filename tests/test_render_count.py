"""Issue 28: a chat request with tools renders the chat template at most twice, counted where jinja runs
(ChatTemplate._render: the tools probe a template gets once included), for every way a request with tools asks for
its output (tool_choice auto, none, required, a named function; a response_format beside the tools), whole or
streamed through the server, and through Model.generate. test_request.py counts the plain case's public renders."""

from __future__ import annotations

import contextlib

import pytest
from scripted import ASK, WEATHER
from test_request import CONVERSATION
from test_runtime_tools import constrained_model

from gemma_ane.runtime.chat import ChatTemplate
from gemma_ane.server.app import build_app

ASKS = {
    "auto": {},
    "none": {"tool_choice": "none"},
    "required": {"tool_choice": "required"},
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "response-format": {"response_format": {"type": "json_object"}},
}


@contextlib.contextmanager
def jinja_renders(monkeypatch):
    seen, render = [], ChatTemplate._render
    monkeypatch.setattr(ChatTemplate, "_render", lambda self, *a: seen.append(a) or render(self, *a))
    yield seen


@pytest.fixture
def model(tmp_path):
    """A fresh model (so its template's tools probe is counted too): flat logits, the real Gemma 4 template, a
    bundle directory holding the tokenizer a grammar is compiled against."""
    return constrained_model(tmp_path)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("ask", ASKS, ids=list(ASKS))
def test_the_server_renders_a_chat_request_with_tools_at_most_twice(model, monkeypatch, ask, stream):
    from starlette.testclient import TestClient

    body = {"messages": CONVERSATION, "tools": [WEATHER], "max_tokens": 6, "stream": stream, **ASKS[ask]}
    with TestClient(build_app(model, model_name="m")) as http, jinja_renders(monkeypatch) as seen:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    assert 1 <= len(seen) <= 2, f"{len(seen)} renders"


@pytest.mark.parametrize("ask", ASKS, ids=list(ASKS))
def test_generate_renders_a_chat_request_with_tools_at_most_twice(model, monkeypatch, ask):
    kw = {**ASKS[ask]}
    if "tool_choice" in kw and isinstance(kw["tool_choice"], dict):
        kw["tool_choice"] = kw["tool_choice"]["function"]["name"]  # the Python API names the function
    with jinja_renders(monkeypatch) as seen:
        model.generate(messages=[*ASK], tools=[WEATHER], max_tokens=6, **kw)
        again = len(seen)
        model.generate(messages=CONVERSATION, tools=[WEATHER], max_tokens=6, **kw)
    assert 1 <= again <= 2 and len(seen) - again == 1, seen  # the probe once a template, then one render a request

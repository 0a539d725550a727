"""Issue 42's one typed request and issue 43's item 9: the server parses a body once into a GenerationRequest,
Model.prepare checks it once (tools once, sampling once, capabilities once, however many choices), the worker runs
the Prepared (each choice of n from the one Prepared), and a full queue refuses a request before any per-request
work (rendering, grammar preparation)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from scripted import ASK, WEATHER
from test_runtime_tools import constrained_model

from gemma_ane.runtime import model as runtime_model
from gemma_ane.runtime import request as runtime_request
from gemma_ane.runtime.chat import ChatTemplate
from gemma_ane.runtime.events import Event
from gemma_ane.runtime.grammar import Constraint
from gemma_ane.runtime.model import Model
from gemma_ane.runtime.request import GenerationRequest, Prepared
from gemma_ane.runtime.sampling import SamplingParams
from gemma_ane.server import request as server_request
from gemma_ane.server.app import build_app

SCHEMA = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}


@pytest.fixture
def model(tmp_path):
    """Flat logits, the real Gemma 4 template, a bundle directory holding the tokenizer a grammar compiles with."""
    return constrained_model(tmp_path)


@contextlib.contextmanager
def counting(monkeypatch):
    """Calls of each check and of each piece of per-request work from now on, by name."""
    seen = {"check_tools": 0, "sampling": 0, "capabilities": 0, "render": 0, "grammar": 0}

    def count(name, f):
        def counted(*a, **kw):
            seen[name] += 1
            return f(*a, **kw)

        return counted

    monkeypatch.setattr(runtime_model, "check_tools", count("check_tools", runtime_model.check_tools))
    build = SamplingParams.from_generation_config.__func__
    monkeypatch.setattr(SamplingParams, "from_generation_config", classmethod(count("sampling", build)))
    caps = Model.capabilities.fget
    monkeypatch.setattr(Model, "capabilities", property(count("capabilities", caps)))
    monkeypatch.setattr(ChatTemplate, "_render", count("render", ChatTemplate._render))
    monkeypatch.setattr(Constraint, "__init__", count("grammar", Constraint.__init__))
    yield seen


def test_the_server_checks_tools_sampling_and_capabilities_once_for_n_choices(model, monkeypatch):
    """n=3 with tools, a named tool choice (a grammar) and sampling fields: one check of each, one render; each
    choice compiles its own grammar state (3), in the worker."""
    from starlette.testclient import TestClient

    body = {
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 3,
        "n": 3,
        "temperature": 0.7,
        "seed": 5,
        "logit_bias": {"9": -100},
    }
    with TestClient(build_app(model, model_name="m")) as http:
        # the template's tools probe, once a template
        http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "max_tokens": 1})
        with counting(monkeypatch) as seen:
            r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    assert seen == {"check_tools": 1, "sampling": 1, "capabilities": 1, "render": 1, "grammar": 3}, seen


def test_the_server_holds_no_check_of_its_own():
    """The duck-typed path is gone: the server's request module asks no tool, sampling or grammar question."""
    for name in ("check_tools", "check_tool_choice", "SamplingParams", "grammar", "check_stop", "choice_seed"):
        assert not hasattr(server_request, name), name


def test_the_python_api_and_a_generation_request_prepare_alike(model):
    asked = GenerationRequest(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4, sampling={"seed": 3})
    typed, keywords = (
        model.prepare(asked),
        model.prepare(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4, seed=3),
    )
    assert isinstance(typed, Prepared) and typed.request is asked
    assert (typed.ids, typed.params, typed.rule.bans) == (keywords.ids, keywords.params, keywords.rule.bans)
    with pytest.raises(ValueError, match="not both"):
        model.prepare(asked, max_tokens=5)


def test_a_choice_gets_the_next_seed_and_a_grammar_state_of_its_own(model):
    first = model.prepare(messages=ASK, response_format={"type": "json_object"}, seed=2**63 - 1)
    second = model.choice(first, 1)
    assert model.choice(first, 0) is first
    assert second.params.seed == -(2**63) and second.ids is first.ids  # wrapped; the prompt not rendered again
    assert second.rule.constraint is not first.rule.constraint and second.rule.constraint is not None
    assert runtime_request.choice_seed(None, 3) is None


def test_a_full_queue_refuses_before_any_rendering_or_grammar(model, monkeypatch):
    """Issue 43 item 9: with the queue full, n=16 with a schema is a 429 that rendered nothing and prepared no
    grammar (it prepared 16 before)."""
    from starlette.testclient import TestClient

    gate, running = threading.Event(), threading.Event()

    def blocked(prepared, cancelled):
        running.set()
        gate.wait(30)
        yield Event(finish_reason="stop")

    monkeypatch.setattr(model, "_run", blocked)
    with TestClient(build_app(model, model_name="m", max_queue=0)) as http:
        first = threading.Thread(target=http.post, args=("/v1/chat/completions",), kwargs={"json": {"messages": ASK}})
        first.start()
        try:
            assert running.wait(30)
            with counting(monkeypatch) as seen:
                r = http.post("/v1/chat/completions", json={"messages": ASK, "n": 16, "response_format": SCHEMA})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert seen["render"] == 0 and seen["grammar"] == 0, seen
        finally:
            gate.set()
            first.join(30)
        time.sleep(0.05)
        # the place a refused or failed request held is given back: the queue serves the next one
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_an_over_long_prompt_is_refused_after_one_render_whatever_n(model, monkeypatch):
    from starlette.testclient import TestClient

    long = [{"role": "user", "content": "word " * 5000}]
    with TestClient(build_app(model, model_name="m")) as http:
        http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1})
        with counting(monkeypatch) as seen:
            r = http.post("/v1/chat/completions", json={"messages": long, "n": 16})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert seen["render"] == 1, seen
        # a refused request gives its place in the queue back
        assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1}).status_code == 200

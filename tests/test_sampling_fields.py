"""The sampling fields are declared once (sampling.FIELDS): each is a SamplingParams field (the Python API's
keyword), a flag of `generate` and `chat`, and a field the server checks, all derived from the declaration, so a
field added in one place only fails here."""

from __future__ import annotations

import dataclasses

import pytest
from test_server import FakeModel

from gemma_ane.cli import build_parser
from gemma_ane.cli.run import sampling
from gemma_ane.runtime.model import Event
from gemma_ane.runtime.sampling import FIELDS, SamplingError, SamplingParams
from gemma_ane.server.app import build_app

# a value each field takes, and the CLI's spelling of it
VALUES = {
    "temperature": (0.5, "0.5"),
    "top_k": (7, "7"),
    "top_p": (0.9, "0.9"),
    "min_p": (0.1, "0.1"),
    "repetition_penalty": (1.2, "1.2"),
    "presence_penalty": (0.5, "0.5"),
    "frequency_penalty": (-0.5, "-0.5"),
    "seed": (3, "3"),
    "logprobs": (2, "2"),
    "logit_bias": ({5: -100.0}, "5=-100"),
}


def test_the_declaration_is_the_dataclass():
    assert [f.name for f in FIELDS] == [f.name for f in dataclasses.fields(SamplingParams)]
    assert set(VALUES) == {f.name for f in FIELDS}
    assert all(f.help for f in FIELDS)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_is_a_cli_flag(command, field):
    value, text = VALUES[field.name]
    flag = "--" + field.name.replace("_", "-")
    argv = [command, "b", *(["-p", "hi"] if command == "generate" else []), flag, text]
    a = build_parser().parse_args(argv)
    assert sampling(a) == {field.name: value}
    assert SamplingParams(**sampling(a)).validate(vocab_size=10)  # what the API takes from it


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_is_checked_by_its_declaration(field):
    value, _ = VALUES[field.name]
    assert getattr(SamplingParams.from_generation_config({}, **{field.name: value}), field.name) == value
    with pytest.raises(SamplingError) as e:
        SamplingParams.from_generation_config({}, **{field.name: "x"})
    assert e.value.param == field.name


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_is_taken_and_checked_by_the_server(field):
    from starlette.testclient import TestClient

    value, _ = VALUES[field.name]
    model = FakeModel([Event(token=5, text="a", logprob=-0.5), Event(finish_reason="stop")])
    name = "top_logprobs" if field.name == "logprobs" else field.name  # the chat endpoint's spelling
    extra = {"logprobs": True} if field.name == "logprobs" else {}
    good = {name: {str(k): v for k, v in value.items()} if isinstance(value, dict) else value}
    with TestClient(build_app(model, model_name="fake")) as http:
        messages = [{"role": "user", "content": "hi"}]
        assert http.post("/v1/chat/completions", json={"messages": messages, **good, **extra}).status_code == 200
        bad = http.post("/v1/chat/completions", json={"messages": messages, name: "x", **extra})
    assert model.calls[0][field.name] == value
    assert bad.status_code == 400 and bad.json()["error"]["param"] == name


def test_a_flag_out_of_range_is_refused_before_the_bundle_loads(tmp_path, capsys):
    from gemma_ane.cli import main

    assert main(["generate", str(tmp_path / "no-bundle"), "-p", "hi", "--top-p", "2"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["gemma-ane generate: error: --top-p 2.0: must be <= 1.0"]

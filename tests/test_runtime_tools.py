"""Function calling through the Python API (issue 15): `generate(tools=...)` and `stream_generate`.

A scripted model (tests/scripted.py) "says" chosen token sequences, so what is tested is the runtime
around the network: the prompt, the parser, when generation stops and why. Constrained decoding on the
real tiny bundle's logits is tested through the server (tests/test_server_tools.py) and on its own
(tests/test_grammar.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted import ASK, PARIS, TEMPLATE, TIME, TOKYO, VOCAB, WEATHER, ScriptedEngine, script, scripted_model

from gemma_ane.oracle.tokenizer_files import build_tokenizer, write_tokenizer_files
from gemma_ane.runtime.chat import ChatTemplate
from gemma_ane.runtime.model import Model
from gemma_ane.runtime.tokens import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_OPEN, TOOL_RESPONSE_OPEN
from gemma_ane.runtime.tools import ToolError

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model():
    return scripted_model()


def test_a_call_comes_back_structured_and_ends_the_turn(model, monkeypatch):
    ids = script(model, monkeypatch, PARIS + "<|tool_response>never reached")
    r = model.generate(messages=ASK, tools=[WEATHER], max_tokens=100)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert r.finish_reason == "tool_calls" and r.text == ""
    assert r.tokens[-1] == TOOL_RESPONSE_OPEN and len(r.tokens) == ids.index(TOOL_RESPONSE_OPEN) + 1
    assert r.tool_calls[0].to_openai()["function"]["arguments"] == json.dumps({"city": "Paris", "unit": "celsius"})


def test_the_call_is_streamed_on_the_token_that_closes_it(model, monkeypatch):
    script(model, monkeypatch, "Let me check." + PARIS + "<|tool_response>")
    events = list(model.stream_generate(messages=ASK, tools=[WEATHER], max_tokens=100))
    with_calls = [ev for ev in events if ev.tool_calls]
    assert len(with_calls) == 1 and with_calls[0].token == TOOL_CALL_CLOSE
    assert "".join(ev.text for ev in events) == "Let me check."
    assert events[-1].finish_reason == "tool_calls"


def test_parallel_calls_and_one_call_only(model, monkeypatch):
    script(model, monkeypatch, PARIS + TOKYO + "<|tool_response>")
    both = model.generate(messages=ASK, tools=[WEATHER, TIME], max_tokens=100)
    assert [c.name for c in both.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in both.tool_calls}) == 2
    script(model, monkeypatch, PARIS + TOKYO + "<|tool_response>")
    one = model.generate(messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False, max_tokens=100)
    assert [c.name for c in one.tool_calls] == ["get_weather"]
    assert one.finish_reason == "tool_calls" and one.tokens[-1] == TOOL_CALL_CLOSE


def test_a_named_choice_is_one_call_whatever_parallel_tool_calls_says(flat, monkeypatch):
    """OpenAI: a named choice forces the model to call that function; vLLM returns exactly one call. "required" and
    "auto" follow parallel_tool_calls (the grammar's side: test_grammar). The script writes two calls; the grammar
    (a tokenizer file: `flat`) is compiled as a forced choice asks."""
    for choice, parallel, names in (
        ("get_weather", True, ["get_weather"]),
        ({"type": "function", "function": {"name": "get_weather"}}, True, ["get_weather"]),
        ("required", True, ["get_weather", "get_weather"]),
        ("required", False, ["get_weather"]),
        ("auto", False, ["get_weather"]),
    ):
        script(flat, monkeypatch, PARIS + PARIS + "<|tool_response>")
        r = flat.generate(
            messages=ASK, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=parallel, max_tokens=120
        )
        assert [c.name for c in r.tool_calls] == names, choice
        assert r.finish_reason == "tool_calls"


def test_an_answer_without_calls_finishes_with_stop(model, monkeypatch):
    script(model, monkeypatch, "Sunny.<turn|>")
    r = model.generate(messages=ASK, tools=[WEATHER], max_tokens=100)
    assert (r.text, r.tool_calls, r.finish_reason) == ("Sunny.", [], "stop")


def test_tools_are_declared_in_the_prompt(model):
    with_tools = model.prompt_ids(messages=ASK, tools=[WEATHER])
    assert TOOL_OPEN in with_tools and TOOL_OPEN not in model.prompt_ids(messages=ASK)
    assert "declaration:get_weather" in model.tokenizer.decode(with_tools, skip_special_tokens=False)


def test_tool_choice_none_forbids_opening_a_call(model):
    push = {"logit_bias": {TOOL_CALL_OPEN: 100}, **GREEDY}  # all but forces the call token
    with pytest.warns(UserWarning, match="never closed"):  # the call it opens is cut by max_tokens
        auto = model.generate(messages=ASK, tools=[WEATHER], max_tokens=3, **push)
    assert auto.tokens[0] == TOOL_CALL_OPEN
    none = model.generate(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=3, **push)
    assert TOOL_CALL_OPEN not in none.tokens


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"tools": [WEATHER], "tool_choice": "get_time"}, "no tool is named 'get_time'"),
        ({"tool_choice": "required"}, "no tools were given"),
        ({"tools": [WEATHER], "tool_choice": 7}, "expected 'auto'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "expected 'auto'"),
    ],
)
def test_a_bad_tool_choice_is_named(model, kwargs, problem):
    with pytest.raises(ToolError, match=problem) as e:
        model.generate(messages=ASK, max_tokens=1, **kwargs)
    assert e.value.param == "tool_choice"


def test_a_raw_prompt_takes_no_tools(model):
    with pytest.raises(ValueError, match="raw prompt"):
        model.generate("hi", raw=True, tools=[WEATHER], max_tokens=1)


# -- the command line: generate --json-schema ---------------------------------------------------------------


def test_generate_json_schema_constrains_the_answer(tiny_bundle16, tmp_path, capsys):
    from gemma_ane.cli import main

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    argv = ["generate", str(tiny_bundle16), "-p", "Hi", "--temperature", "0", "--max-tokens", "40", "--json"]
    assert main(argv) == 0
    with pytest.raises(ValueError):
        json.loads(json.loads(capsys.readouterr().out)["text"])  # the random model writes no JSON of its own
    for given in (str(tmp_path / "schema.json"), json.dumps(schema)):
        assert main([*argv[:-1], "--max-tokens", "100", "--json", "--json-schema", given]) == 0
        result = json.loads(capsys.readouterr().out)
        assert 0 <= json.loads(result["text"])["n"] <= 99 and result["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("[1]", "--json-schema: a JSON schema is an object, not list"),
        ("{bad", "--json-schema: not JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
        ('{"type": 7}', "--json-schema: failed to compile JSON schema"),
        ('{"a":' * 5000 + "1" + "}" * 5000, "--json-schema: nested more than 64 deep"),  # issue 25: a traceback
        ('{"properties":' * 500 + "{}" + "}" * 500, "--json-schema: nested more than 64 deep"),
        ("missing.json", "--json-schema missing.json: cannot read (No such file or directory)"),
    ],
)
def test_a_bad_json_schema_is_one_line_before_anything_loads(tmp_path, capsys, monkeypatch, given, problem):
    from gemma_ane.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["generate", str(tmp_path / "no-bundle"), "-p", "Hi", "--json-schema", given]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gemma-ane generate: error: {problem}") and err.count("\n") == 1, err


# -- bad input: nesting, and constraints that leave no token (issue 25) ------------------------------------


def nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def test_deep_messages_and_tools_are_the_packages_own_errors(model):
    """Issue 25: 4 KB of brackets in a message or a tool was a RecursionError from the escaping."""
    from gemma_ane.runtime.chat import ChatError

    with pytest.raises(ChatError) as e:
        model.generate(messages=[{**ASK[0], "metadata": nested(500)}], max_tokens=1)
    assert e.value.param == "messages[0].metadata" and str(e.value) == "messages[0].metadata: nested more than 64 deep"
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": nested(500)}}
    with pytest.raises(ToolError) as e:  # prompt_ids checks the tools it is given as generate does
        model.prompt_ids(messages=ASK, tools=[deep_tool])
    assert e.value.param == "tools[0].function.parameters"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(nested(500))}}
    with pytest.raises(ToolError) as e:
        model.generate(messages=[*ASK, {"role": "assistant", "tool_calls": [call]}], tools=[WEATHER], max_tokens=1)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


def constrained_model(root: Path, tokenizer=None) -> Model:
    """The scripted model's engine (flat logits: the sampler and the constraint choose) with a bundle directory
    holding tokenizer.json, as constrained decoding reads it: the test tokenizer, or `tokenizer`."""
    (root / "hf_model").mkdir(parents=True)
    if tokenizer is None:
        write_tokenizer_files(root / "hf_model", VOCAB)
        tokenizer = build_tokenizer(VOCAB)
    else:
        tokenizer.save(str(root / "hf_model" / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return Model(root, ScriptedEngine(vocab), tokenizer, ChatTemplate(TEMPLATE), {}, {"vocab_size": vocab}, "none")


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    return constrained_model(tmp_path_factory.mktemp("flat"))


def unspellable(root: Path) -> Model:
    """A model whose tokenizer cannot write a double quote, nor any byte it has no token for."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "{": 4, "}": 5, **{f"x{i}": 6 + i for i in range(122)}}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    t.add_special_tokens([AddedToken(s, special=True) for s in ("<pad>", "<eos>", "<bos>", "<unk>")])
    return constrained_model(root, t)


EVERY_BUT_CALLS = {t: -100 for t in range(VOCAB) if t != TOOL_CALL_OPEN}
QUOTED = {"type": "json_schema", "json_schema": {"name": "q", "schema": {"const": "a"}}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    ("kw", "param", "message"),
    [
        (
            dict(tools=[WEATHER], tool_choice="none", logit_bias=EVERY_BUT_CALLS),
            "logit_bias",
            "logit_bias: it bans every token but <|tool_call>, which tool_choice 'none' bans",
        ),
        (
            dict(response_format={"type": "json_object"}, logit_bias={t: -100 for t in range(VOCAB - 1)}),
            "logit_bias",
            "logit_bias: it bans every token response_format allows at the start",
        ),
        (
            dict(tools=[WEATHER], tool_choice="required", logit_bias={TOOL_CALL_OPEN: -100}),
            "logit_bias",
            "logit_bias: it bans every token tool_choice 'required' allows at the start",
        ),
    ],
    ids=["tool-choice-none", "json-object", "tool-choice-required"],
)
def test_constraints_that_leave_no_first_token_are_refused_before_generation(
    flat, monkeypatch, kw, param, message, temperature
):
    """Issue 25: these drew a banned token (greedy), a NaN probability (sampling) or a token the grammar
    refuses; now nothing runs."""
    from gemma_ane.runtime.sampling import SamplingError

    monkeypatch.setattr(flat.engine, "prompt", lambda *a: pytest.fail("the prompt ran"))
    with pytest.raises(SamplingError) as e:
        next(flat.stream_generate(messages=ASK, temperature=temperature, max_tokens=5, **kw))
    assert (e.value.param, str(e.value)) == (param, message)
    flat.prepare(messages=ASK, **{k: v for k, v in kw.items() if k != "logit_bias"})  # without the bans: fine
    with pytest.raises(SamplingError) as e:
        flat.prepare(messages=ASK, **kw)  # what the server asks before a request queues
    assert (e.value.param, str(e.value)) == (param, message)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_the_tokenizer_cannot_spell_is_refused_before_generation(tmp_path, temperature):
    """llguidance's first mask holds <unk> alone, which its parser then refuses ("token 3 breaks the grammar")."""
    from gemma_ane.runtime.grammar import GrammarError

    model = unspellable(tmp_path)
    with pytest.raises(GrammarError) as e:
        model.generate("x1", raw=True, response_format=QUOTED, temperature=temperature, max_tokens=5)
    assert e.value.param == "response_format"
    assert str(e.value) == "response_format: no token of this tokenizer can continue it at the start"
    # a format it can spell runs: "{" then "}"
    r = model.generate("x1", raw=True, response_format={"type": "json_object"}, temperature=temperature, max_tokens=5)
    assert r.text == "{}" and r.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_dead_end_later_ends_with_one_line_and_no_forbidden_token(flat, temperature):
    """The grammar complete, only the stop tokens may follow: logit_bias banning them all is known only then."""
    from gemma_ane.runtime.sampling import SamplingError

    events, bans = [], {t: -100 for t in flat.stop_ids}
    with pytest.raises(SamplingError) as e:
        for ev in flat.stream_generate(
            messages=ASK, response_format=QUOTED, logit_bias=bans, temperature=temperature, max_tokens=20
        ):
            events.append(ev)
    text = "".join(ev.text for ev in events)
    assert text == '"a"' and not any(ev.token in flat.stop_ids for ev in events)
    n = len(events)
    assert (e.value.param, str(e.value)) == (
        "logit_bias",
        f"logit_bias: it bans every token response_format allows after {n} tokens",
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_later_token_llguidance_masks_in_but_refuses_is_never_drawn(tmp_path, temperature):
    """After "{" the schema needs a quoted key, which this tokenizer cannot write: llguidance's mask then holds
    <unk> alone, which its parser refuses ("token 3 breaks the grammar" before issue 25)."""
    from gemma_ane.runtime.grammar import GrammarError

    schema = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    rf = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}
    model, events = unspellable(tmp_path), []
    with pytest.raises(GrammarError) as e:
        for ev in model.stream_generate("x1", raw=True, response_format=rf, temperature=temperature, max_tokens=5):
            events.append(ev)
    assert [ev.text for ev in events] == ["{"]
    assert (e.value.param, str(e.value)) == (
        "response_format",
        "response_format: no token of this tokenizer can continue it after 1 token",
    )


def test_a_raw_prompt_of_token_ids_is_taken_as_given(model):
    """OpenAI's completions take token ids: the Python API's raw prompt too, with no <bos> added."""
    assert model.prompt_ids([5, 6, 7], raw=True) == [5, 6, 7]
    for bad, found in (([], "an empty list"), ([5, VOCAB], str(VOCAB)), ([5, True], "True"), ([-1], "-1")):
        with pytest.raises(
            ValueError, match=f"prompt: token ids must be integers from 0 to {VOCAB - 1}, found {found}"
        ):
            model.prompt_ids(bad, raw=True)

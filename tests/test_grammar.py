"""Structured output by constrained decoding (issue 15, part 5): gemma_ane.runtime.grammar's grammars for OpenAI's
response_format and for forced tool calls in Gemma 4's syntax, the Constraint that masks logits with them,
and, end to end on a random tiny bundle whose own output is never JSON, generations that parse and follow
their schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import llguidance
import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from gemma_ane.oracle.tokenizer_files import write_tokenizer_files
from gemma_ane.runtime import grammar
from gemma_ane.runtime.grammar import Constraint, GrammarError, request_grammar, response_grammar, tool_call_grammar
from gemma_ane.runtime.sampling import Sampler, SamplingParams
from gemma_ane.runtime.tokens import STOP_IDS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_RESPONSE_OPEN
from gemma_ane.runtime.tools import parse_call

VOCAB = 1024
Q = '<|"|>'
TEMPLATE = (Path(__file__).parent / "fixtures" / "gemma4_chat_template.jinja").read_text()

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "indoor": {"type": "boolean"}},
            "required": ["x", "indoor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "home"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
                "at": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                },
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                "Zone": {"type": "string"},  # dictsort compares lowercased: after "unit"
                "note": {"type": ["string", "null"]},
            },
            "required": ["city", "days"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "on": {"type": "boolean"}},
            "required": ["hour", "on"],
        },
    },
}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
PET = {"type": "function", "function": {"name": "describe_pet", "parameters": SCHEMA}}  # bounded: a random model


def valid(value, s: dict) -> bool:
    """`value` against the JSON schema subset the tests use."""
    if "enum" in s:
        return value in s["enum"]
    kind = s["type"]
    if isinstance(kind, list):
        return any(valid(value, {**s, "type": k}) for k in kind)
    if kind == "object":
        props = s.get("properties", {})
        return (
            isinstance(value, dict)
            and set(s.get("required", [])) <= set(value)
            and (s.get("additionalProperties", True) or set(value) <= set(props))
            and all(valid(v, props[k]) for k, v in value.items() if k in props)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= s.get("maxItems", len(value))
            and all(valid(v, s["items"]) for v in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= s.get("maxLength", len(value))
    if kind == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and s.get("minimum", value) <= value <= s.get("maximum", value)
        )
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"boolean": isinstance(value, bool), "null": value is None}[kind]


# -- grammars, fed text -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(out, VOCAB)
    return out / "tokenizer.json"


def feed(g: str, tok: Path, text: str, vocab: int = VOCAB) -> Constraint | None:
    """A Constraint that consumed `text` (control tokens counted as such), or None if the grammar refused it."""
    c = Constraint(g, tok, vocab, STOP_IDS)
    for token in Tokenizer.from_file(str(tok)).encode(text, add_special_tokens=False).ids:
        try:
            c.advance(token)
        except GrammarError:
            return None
    return c


def accepts(g: str, tok: Path, text: str) -> bool:
    c = feed(g, tok, text)
    return c is not None and c.done


def test_text_and_no_response_format_have_no_grammar():
    assert response_grammar(None) is None and response_grammar({"type": "text"}) is None


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("{}", True),
        ('{"a": [1, {"b": null}], "c": "é \\"q\\""}', True),
        ('{\n  "a": {\n    "b": 1.5e3\n  }\n}', True),
        ("[]", False),  # an object, not any JSON
        (" {}", False),
        ('{"a": 1', False),
        ('{\n\n  "a": 1\n}', True),
        ('{"a":\n\n\n1}', False),  # whitespace is bounded: a model cannot idle in it
        ('{"a":\n' + " " * 21 + "1}", False),
        ("{}{}", False),
    ],
)
def test_json_object(tok, text, ok):
    assert accepts(response_grammar({"type": "json_object"}), tok, text) is ok


@pytest.mark.parametrize(
    ("doc", "ok"),
    [
        ({"name": "Rex", "kind": "dog", "age": 3, "home": {"x": -2, "indoor": True}}, True),
        ({"name": "", "kind": "cat", "age": 99, "tags": ["a", "bb"], "home": {"x": 9, "indoor": False}}, True),
        ({"name": "Rex", "kind": "dog", "age": 3}, False),  # home is required
        ({"name": "Rex", "kind": "cow", "age": 3, "home": {"x": 0, "indoor": True}}, False),
        ({"name": "Rex", "kind": "dog", "age": 100, "home": {"x": 0, "indoor": True}}, False),
        ({"name": "Rex", "kind": "dog", "age": 3.5, "home": {"x": 0, "indoor": True}}, False),
        ({"name": "Rex", "kind": "dog", "age": 3, "tags": ["a", "b", "c"], "home": {"x": 0, "indoor": True}}, False),
        ({"name": "Rex", "kind": "dog", "age": 3, "home": {"x": 0, "indoor": True, "y": 1}}, False),
        ({"name": "Rexxxxxxxx", "kind": "dog", "age": 3, "home": {"x": 0, "indoor": True}}, False),
    ],
)
def test_json_schema(tok, doc, ok):
    g = response_grammar({"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    assert accepts(g, tok, json.dumps(doc)) is ok and valid(doc, SCHEMA) is ok


def test_strict_schema_refuses_keywords_it_cannot_enforce(tok):
    schema = {"type": "string", "format": "no-such-format"}
    with pytest.raises(GrammarError, match="no-such-format"):
        response_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
    g = response_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert accepts(g, tok, '"anything"') and not accepts(g, tok, "1")


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({"json_schema": {"schema": {}}}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
    ],
)
def test_bad_response_format_names_the_field(response_format, param):
    with pytest.raises(GrammarError) as e:
        response_grammar(response_format)
    assert e.value.param == param and str(e.value).startswith(param + ": ") and "\n" not in str(e.value)


def test_a_schema_part_that_fails_to_compile_says_why():
    """llguidance reports a bad regex over several lines (the regex, a caret, then `error: why`): the one line
    keeps the why, not the bare heading "regex parse error:"."""
    schema = {"type": "string", "pattern": "(a"}
    with pytest.raises(GrammarError) as e:
        response_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert str(e.value) == (
        "response_format.json_schema.schema: failed to compile JSON schema: regex parse error: unclosed group"
    )


def test_unknown_tool_choice_names_the_field():
    with pytest.raises(GrammarError) as e:
        tool_call_grammar([WEATHER], "get_time")
    assert e.value.param == "tool_choice" and "get_time" in str(e.value)


def test_llguidance_is_optional(monkeypatch):
    """The runtime imports without it; asking for a grammar says how to install it."""
    code = "import sys, gemma_ane.runtime.grammar, gemma_ane.runtime.model; assert 'llguidance' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(GrammarError, match=r"pip install 'gemma-ane\[serve\]'"):
        response_grammar({"type": "json_object"})


def rendered(*calls) -> str:
    """Tool calls as the chat template writes them, with the <|tool_response> that follows."""
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": tool_calls}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(TEMPLATE).render(messages=messages, bos_token="<bos>", add_generation_prompt=False)
    return text[text.index("<|tool_call>") : text.index("<|tool_response>") + len("<|tool_response>")]


FULL = {
    "city": 'Zürich "old"',
    "days": 3,
    "unit": "celsius",
    "hourly": False,
    "at": {"lat": 47.37, "lon": -8.5e-05},
    "tags": ["a, b", "日本"],
    "Zone": "",
    "note": None,
}


@pytest.mark.parametrize(
    "calls",
    [
        [("get_weather", {"city": "Paris", "days": 0})],
        [("get_weather", FULL)],
        [("get_weather", {**FULL, "note": "{x:1}", "tags": [], "days": -12})],
        [("lookup", {"q": ["a", {"b": [1.5, True, None]}], "empty": {}, "s": "<b>"})],
        [("set_alarm", {"hour": 7, "on": True}), ("get_weather", {"city": "Oslo", "days": 1}), ("lookup", {})],
    ],
)
def test_tool_call_grammar_accepts_the_templates_rendering(tok, calls):
    assert accepts(tool_call_grammar([WEATHER, ALARM, LOOKUP], "required"), tok, rendered(*calls))


def test_tool_call_grammar_refuses(tok):
    g = tool_call_grammar([WEATHER, ALARM], "required")
    call = rendered(("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"}))
    assert accepts(g, tok, call)
    for bad in [
        call.replace('city:<|"|>Paris<|"|>,days:3', 'days:3,city:<|"|>Paris<|"|>'),  # keys out of order
        call.replace(",days:3", ""),  # a required argument missing
        call.replace("celsius", "kelvin"),  # not in the enum
        call.replace("days:3", 'days:<|"|>3<|"|>'),  # a string for an integer
        call.replace("}<tool_call|>", ",extra:1}<tool_call|>"),  # an argument not declared
        call.replace("Paris", "Paris and far beyond"),  # longer than maxLength
        call.replace("get_weather", "get_time"),
        call.replace("<|tool_response>", ""),  # the turn must hand over to the tool
        "Sure! " + call,
        rendered(("get_weather", {"city": "Paris", "days": 3, "tags": ["a", "b", "c"]})),  # maxItems
    ]:
        assert not accepts(g, tok, bad), bad
    one = tool_call_grammar([WEATHER, ALARM], "set_alarm", parallel=False)
    alarm = rendered(("set_alarm", {"hour": 7, "on": True}))
    assert accepts(one, tok, alarm) and not accepts(one, tok, call)
    assert not accepts(one, tok, alarm.replace("hour:7", "hour:24")) and accepts(one, tok, alarm.replace("7", "23"))
    assert not accepts(one, tok, alarm.replace("<|tool_response>", "") + alarm)
    assert accepts(tool_call_grammar([WEATHER, ALARM], "set_alarm"), tok, alarm.replace("<|tool_response>", "") + alarm)


def test_thinking_block_only_when_asked(tok):
    thought = "<|channel>thought\nThe user wants JSON.<channel|>"
    call = rendered(("set_alarm", {"hour": 7, "on": True}))
    for make, answer in [
        (lambda thinking: response_grammar({"type": "json_object"}, thinking=thinking), '{"a": 1}'),
        (lambda thinking: tool_call_grammar([ALARM], "required", thinking=thinking), call),
    ]:
        assert accepts(make(True), tok, thought + answer) and accepts(make(True), tok, answer)
        assert accepts(make(False), tok, answer) and not accepts(make(False), tok, thought + answer)


# -- the mask ---------------------------------------------------------------------------------------


def oracle(c: Constraint) -> set[int]:
    """The tokens llguidance's matcher takes next, asked one by one."""
    return {t for t in range(c.vocab_size) if c.matcher.deep_copy().consume_token(t)}


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("prefix", ["", '{"a": [1, ', '{"a": "x'])
def test_mask_keeps_exactly_the_allowed_tokens(tok, dtype, prefix):
    vocab = VOCAB + 76  # the model's vocabulary may be larger than the tokenizer's
    c = feed(response_grammar({"type": "json_object"}), tok, prefix, vocab)
    logits = np.random.default_rng(0).standard_normal(vocab).astype(dtype)
    before = logits.copy()
    out = c.mask(logits)
    allowed = set(np.flatnonzero(np.isfinite(out)).tolist())
    assert allowed == oracle(c) and allowed and max(allowed) < VOCAB
    assert out.dtype == dtype and np.array_equal(out[list(allowed)], logits[list(allowed)])
    assert np.all(out[np.isinf(out)] < 0) and np.array_equal(logits, before)  # -inf, and the input untouched


def test_mask_at_the_start_and_the_end(tok):
    hf = Tokenizer.from_file(str(tok))
    c = feed(response_grammar({"type": "json_object"}), tok, "")
    first = {hf.decode([t]) for t in np.flatnonzero(np.isfinite(c.mask(np.zeros(VOCAB, np.float16))))}
    assert first and all(s.startswith("{") for s in first) and "{" in first
    assert not c.done
    c = feed(response_grammar({"type": "json_object"}), tok, '{"a": 1}')
    assert c.done and set(np.flatnonzero(np.isfinite(c.mask(np.zeros(VOCAB, np.float32))))) == set(STOP_IDS)
    c.advance(STOP_IDS[0])
    assert c.done and set(np.flatnonzero(np.isfinite(c.mask(np.zeros(VOCAB, np.float32))))) == set(STOP_IDS)


def test_advance_refuses_a_forbidden_token(tok):
    c = Constraint(response_grammar({"type": "json_object"}), tok, VOCAB, STOP_IDS)
    forbidden = int(np.flatnonzero(~c.allowed())[200])
    with pytest.raises(GrammarError, match=f"token {forbidden} breaks the grammar") as e:
        c.advance(forbidden)
    assert e.value.param is None and "\n" not in str(e.value)


def test_tool_call_ends_on_tool_response_even_when_it_is_a_stop_id(tok):
    """The runtime stops on <|tool_response>: the grammar still asks for it, then allows only stops."""
    stops = (*STOP_IDS, TOOL_RESPONSE_OPEN)
    c = Constraint(tool_call_grammar([ALARM], "set_alarm", parallel=False), tok, VOCAB, stops)
    assert set(np.flatnonzero(c.allowed())) == {TOOL_CALL_OPEN}
    for t in Tokenizer.from_file(str(tok)).encode(rendered(("set_alarm", {"hour": 7, "on": True}))).ids[:-1]:
        c.advance(t)
    assert not c.done and set(np.flatnonzero(c.allowed())) == {TOOL_RESPONSE_OPEN}
    c.advance(TOOL_RESPONSE_OPEN)
    assert c.done and set(np.flatnonzero(c.allowed())) == set(stops)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=0),
        SamplingParams(temperature=1.5, top_k=40, seed=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=2),
        SamplingParams(temperature=1.0, top_k=64, top_p=0.95, repetition_penalty=1.3, seed=3),
    ],
)
def test_sampler_draws_only_allowed_tokens_from_masked_fp16(tok, params):
    """Past 16,384 ids the sampler's fp16 path picks candidates from a strided sample: it must still see
    through a sea of -inf. The best raw logit is always forbidden."""
    vocab = 65536
    c = feed(response_grammar({"type": "json_object"}), tok, '{"a": [1, ', vocab)
    allowed = c.allowed()
    logits = np.random.default_rng(4).standard_normal(vocab).astype(np.float16)
    logits[np.flatnonzero(~allowed)[7]] = 60.0
    masked = c.mask(logits)
    sampler = Sampler(params, history=[int(np.flatnonzero(allowed)[0])])
    draws = [sampler.sample(masked) for _ in range(1 if sampler.greedy else 100)]
    assert all(allowed[draws])
    if sampler.greedy:
        assert draws[0] == int(np.argmax(np.where(allowed, logits.astype(np.float32), -np.inf)))
    else:
        assert len(set(draws)) > 1


def test_tokenizer_is_built_once_per_path(tok):
    g = response_grammar({"type": "json_object"})
    assert Constraint(g, tok, VOCAB, STOP_IDS).tokenizer is Constraint(g, str(tok), VOCAB, STOP_IDS).tokenizer


def sentencepiece_tokenizer(path: Path) -> Path:
    """Gemma's kind of tokenizer in small: BPE with byte fallback, ▁ for a space."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    for piece in ["▁the", "▁", "he", "{", '"', "}", "▁wörld", "日本", "\n\n", "<b>"]:
        vocab.setdefault(piece, len(vocab))
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    t.normalizer = normalizers.Replace(" ", "▁")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    t.add_special_tokens([AddedToken(s, special=True) for s in ("<pad>", "<eos>", "<bos>", "<unk>", "<|tool_call>")])
    t.add_tokens([AddedToken("\t\t", special=False), AddedToken("<start_of_image>", special=False)])
    t.save(str(path))
    return path


def test_token_bytes_are_llguidances_own(tok, tmp_path):
    """We read the token bytes ourselves (llguidance's loader takes minutes on 10^5 added tokens): every
    token's bytes and specialness must be what its loader gives, byte-level and byte-fallback alike."""
    for path in (tok, sentencepiece_tokenizer(tmp_path / "sp.json")):
        n = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
        theirs = llguidance.LLTokenizer(str(path), n_vocab=n, eos_token=[1])
        ours = grammar._tokenizer(str(path), n, (1,))
        for i in range(n):
            assert ours.decode_bytes([i]) == theirs.decode_bytes([i]), i
            assert ours.is_special_token(i) == theirs.is_special_token(i), i


# -- end to end on a random tiny bundle --------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_bundle16):
    from gemma_ane.runtime.model import load

    return load(tiny_bundle16)


@pytest.fixture(scope="module")
def bias(model) -> dict[int, float]:
    """A random model rarely closes a string or a value, and loves whitespace, which the grammar allows
    (bounded) but a 128-token context cannot hold: whitespace banned, closing characters favoured, for
    the constrained and the unconstrained runs alike."""
    text = {i: model.tokenizer.decode([i]) for i in range(model.config["vocab_size"])}
    out = {i: 5.0 for i, s in text.items() if any(ch in s for ch in '"}]')}
    return out | {i: -100 for i, s in text.items() if s and not s.strip()}


SAMPLING = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=0),
    dict(temperature=0.8, top_k=20, top_p=0.9, seed=1),
]


def generate(model, bias, sampling: dict, constraint: Constraint | None, stops) -> list[int]:
    """The runtime's loop (Model.stream_generate) with the constraint's mask before each draw."""
    model.reset()
    ids = model.prompt_ids(messages=[{"role": "user", "content": "Describe a pet as JSON."}])
    _, logits = model.engine.prompt(ids, [])
    sampler, out = Sampler(SamplingParams(**sampling, logit_bias=bias), history=ids), []
    while model.engine.position < model.context:
        token = sampler.sample(constraint.mask(logits) if constraint else logits)
        sampler.observe(token)
        out.append(token)
        if constraint:
            constraint.advance(token)
        if token in stops:
            break
        logits = model.engine.feed([token])[-1]
    return out


def tokenizer_json(model) -> Path:
    return model.root / "hf_model" / "tokenizer.json"


@pytest.mark.parametrize("sampling", SAMPLING)
def test_random_model_alone_writes_no_json(model, bias, sampling):
    text = model.tokenizer.decode(generate(model, bias, sampling, None, model.stop_ids))
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_constrained_output_is_valid_json(model, bias, sampling, kind):
    rf = {"type": kind, "json_schema": {"name": "pet", "schema": SCHEMA}} if kind == "json_schema" else {"type": kind}
    c = Constraint(response_grammar(rf), tokenizer_json(model), model.config["vocab_size"], model.stop_ids)
    out = generate(model, bias, sampling, c, model.stop_ids)
    assert out[-1] in model.stop_ids and c.done, model.tokenizer.decode(out)
    doc = json.loads(model.tokenizer.decode(out[:-1]))
    assert valid(doc, SCHEMA if kind == "json_schema" else {"type": "object"}), doc


def test_a_named_choice_grammar_allows_one_call():
    tools = [PET, ALARM]
    assert request_grammar(tools, "set_alarm", True, None) == tool_call_grammar(tools, "set_alarm", parallel=False)
    assert request_grammar(tools, "required", True, None) == tool_call_grammar(tools, "required", parallel=True)
    assert request_grammar(tools, "required", False, None) == tool_call_grammar(tools, "required", parallel=False)


@pytest.mark.parametrize("sampling", SAMPLING[:2])
@pytest.mark.parametrize("choice", ["set_alarm", "required"])
def test_forced_tool_call(model, bias, sampling, choice):
    tools = [PET, ALARM]
    stops = model.stop_ids | {TOOL_RESPONSE_OPEN}
    g = tool_call_grammar(tools, choice, parallel=False)
    c = Constraint(g, tokenizer_json(model), model.config["vocab_size"], stops)
    out = generate(model, bias, sampling, c, stops)
    assert out[0] == TOOL_CALL_OPEN and out[-2:] == [TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN] and c.done
    assert out.count(TOOL_CALL_OPEN) == 1
    name, arguments = parse_call(model.tokenizer.decode(out[1:-2], skip_special_tokens=False))
    assert name == choice if choice != "required" else name in ("describe_pet", "set_alarm")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[name]
    assert valid(arguments, schema) and list(arguments) == sorted(arguments, key=str.lower), arguments

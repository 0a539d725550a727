"""OpenAI compatibility as other servers' test suites see it (issue 33): cut tool calls, empty arguments, signed
seeds, logprobs that cover exactly the emitted text, `n`, `echo` with prompt logprobs, Content-Type and CORS,
JSON-mode numbers and reasoning_effort.

Driven in-process (Starlette's TestClient) as tests/test_server_tools.py is: a scripted model (the runtime's own
Model over chosen tokens) where the tokens must be exact, the tiny bundle where real logits matter."""

from __future__ import annotations

import contextlib
import json

import pytest
from openai import OpenAI
from scripted import ASK, PARIS, WEATHER, script, scripted_model
from test_grammar import accepts, tok  # noqa: F401 (tok: the fixture accepts runs on)
from test_server import THOUGHT, FakeModel
from test_server_tools import HI, PICK

import gemma_ane
from gemma_ane.runtime.grammar import response_grammar
from gemma_ane.runtime.request import choice_seed
from gemma_ane.runtime.sampling import Sampler, SamplingParams
from gemma_ane.server.app import build_app, main

NAME = "tiny"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CUT = 'Hi <|tool_call>call:get_weather{city:<|"|>Par'  # a call max_tokens cuts off
RAW = "Once upon a time, in a land far away, there lived a model"


@contextlib.contextmanager
def serving(model, **kw):
    """(raw HTTP, openai client) on build_app over `model`, in-process."""
    from starlette.testclient import TestClient

    with TestClient(build_app(model, model_name=NAME, **kw)) as http:
        yield http, OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def model():
    return scripted_model()


@pytest.fixture(scope="module")
def scripted(model):
    with serving(model) as pair:
        yield pair


@pytest.fixture(scope="module")
def tiny(tiny_bundle16):
    return gemma_ane.load(tiny_bundle16, backend="mil")


@pytest.fixture(scope="module")
def real(tiny):
    with serving(tiny) as pair:
        yield pair


def n_tokens(model, text: str) -> int:
    return len(model.tokenizer.encode(text, add_special_tokens=False).ids)


def stream_content(chunks) -> tuple[str, list, str | None]:
    """(content, tool call deltas, finish reason) of a streamed chat answer."""
    choices = [c.choices[0] for c in chunks if c.choices]
    content = "".join(c.delta.content or "" for c in choices)
    calls = [t for c in choices for t in c.delta.tool_calls or []]
    return content, calls, next((c.finish_reason for c in choices if c.finish_reason), None)


# -- 1. a tool call cut off by max_tokens is no content -------------------------------------------------------


@pytest.mark.filterwarnings("ignore:a tool call never closed")
def test_a_cut_call_is_neither_content_nor_a_call(model, scripted, monkeypatch):
    _, client = scripted
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=n_tokens(model, CUT))
    script(model, monkeypatch, CUT)
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert (message.content, message.tool_calls, r.choices[0].finish_reason) == ("Hi ", None, "length")

    script(model, monkeypatch, CUT)
    content, calls, finish = stream_content(client.chat.completions.create(stream=True, **kw))
    assert (content, calls, finish) == ("Hi ", [], "length")

    script(model, monkeypatch, PARIS + "<|tool_response>")  # a whole call is still a call
    r = client.chat.completions.create(**{**kw, "max_tokens": 100})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls


@pytest.mark.filterwarnings("ignore:a tool call never closed")
def test_a_forced_call_cut_off_leaves_no_markup(real):
    _, client = real
    kw = dict(model=NAME, messages=HI, tools=[PICK], tool_choice="required", max_tokens=3, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert "tool_call" not in (r.choices[0].message.content or "")
    content, calls, finish = stream_content(client.chat.completions.create(stream=True, **kw))
    assert (content, calls, finish) == ("", [], "length")


# -- 2. an earlier call's empty arguments ------------------------------------------------------------------------


def test_an_earlier_call_with_empty_arguments_reads_as_no_arguments(model, scripted, monkeypatch):
    _, client = scripted
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    seen, prompt_ids = [], model._prompt_ids  # what prepare renders with
    monkeypatch.setattr(model, "_prompt_ids", lambda *a: seen.append(prompt_ids(*a)) or seen[-1])
    script(model, monkeypatch, "Sunny.<turn|>")
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=10)
    assert r.choices[0].message.content == "Sunny."
    assert "call:get_weather{}<tool_call|>" in model.tokenizer.decode(seen[-1], skip_special_tokens=False)


# -- 3. seeds: OpenAI's signed 64-bit integers ----------------------------------------------------------------------


def test_signed_64_bit_seeds(real, tiny):
    http, client = real
    kw = dict(model=NAME, prompt=RAW, max_tokens=8, temperature=3.0)
    texts = {seed: client.completions.create(seed=seed, **kw).choices[0].text for seed in (-1, -(2**63), 2**63 - 1)}
    assert client.completions.create(seed=-1, **kw).choices[0].text == texts[-1]  # reproducible
    # -1 is 2**64 - 1 to the random stream: the same draws as the library given that seed's mapping
    tiny.reset()
    assert tiny.generate(RAW, raw=True, seed=-1, max_tokens=8, temperature=3.0).text == texts[-1]
    for seed in (2**63, -(2**63) - 1):
        r = http.post(COMPLETIONS, json={"prompt": RAW, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


# -- 4/6. logprobs cover exactly the emitted text -----------------------------------------------------------------


def test_the_turns_end_has_no_logprob(model, scripted, monkeypatch):
    _, client = scripted
    kw = dict(model=NAME, messages=ASK, max_tokens=20, logprobs=True, top_logprobs=2)
    script(model, monkeypatch, "Sunny today.<turn|>")
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content == "Sunny today."
    script(model, monkeypatch, "Sunny today.<turn|>")
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(streamed) == "Sunny today."


def test_chat_logprobs_are_of_the_content_alone(model, scripted, monkeypatch):
    """Not the thought, not a call's markup, not a control token that decodes to nothing (issue 44)."""
    _, client = scripted
    text = "<|channel>thought\nHmm.<channel|>Let me<unused86> check." + PARIS + "<|tool_response>"
    for stream in (False, True):
        script(model, monkeypatch, text)
        kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=100, logprobs=True, stream=stream)
        r = client.chat.completions.create(**kw, extra_body={"enable_thinking": True})
        if stream:
            chunks = [c.choices[0] for c in r if c.choices]
            content = "".join(c.delta.content or "" for c in chunks)
            tokens = [e.token for c in chunks if c.logprobs for e in c.logprobs.content]
            assert all(c.delta.content or not c.logprobs for c in chunks)  # no logprobs without content
        else:
            content = r.choices[0].message.content
            tokens = [e.token for e in r.choices[0].logprobs.content]
            assert r.choices[0].message.reasoning_content == "Hmm." and r.choices[0].message.tool_calls
        assert content == "Let me check." and "".join(tokens) == content, tokens


def test_every_streamed_content_chunk_carries_its_tokens_logprobs(model, scripted, monkeypatch):
    _, client = scripted
    text = "Say ENOUGH now and EN"  # "EN" is held back as a stop string's start until the length limit
    kw = dict(model=NAME, messages=ASK, max_tokens=n_tokens(model, text), logprobs=True, stop=["ENOUGH!"])
    script(model, monkeypatch, text)
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    with_text = [c for c in chunks if c.delta.content]
    assert "".join(c.delta.content for c in with_text) == text
    assert all(c.logprobs and c.logprobs.content for c in with_text)
    assert "".join(e.token for c in with_text for e in c.logprobs.content) == text
    assert all(c.delta.content or not c.logprobs for c in chunks)  # no logprobs without text


def test_a_character_cut_at_the_length_limit_is_not_emitted(real, tiny):
    http, _ = real
    # a prompt that ends inside a character: its last byte token, then max_tokens=1 of a two-byte character
    ids = tiny.tokenizer.encode("é", add_special_tokens=False).ids
    assert len(ids) == 2 and tiny.tokenizer.decode(ids[:1]) == "\ufffd"  # a token for each of its bytes
    bias = {str(ids[0]): 100}  # the first byte of "é", forced: the generation ends inside the character
    body = {"prompt": RAW, "max_tokens": 1, "logit_bias": bias, "logprobs": 1}
    for stream in (False, True):
        r = http.post(COMPLETIONS, json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            choices = [c for chunk in chunks for c in chunk["choices"]]
        else:
            choices = r.json()["choices"]
        text = "".join(c["text"] for c in choices)
        assert text == "" and "\ufffd" not in r.text
        assert not [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]


# -- 5. legacy top_logprobs hold the chosen token -------------------------------------------------------------------


def test_completion_top_logprobs_always_hold_the_chosen_token(real):
    _, client = real
    r = client.completions.create(model=NAME, prompt=RAW, max_tokens=12, logprobs=1, temperature=3.0, seed=5)
    lp = r.choices[0].logprobs
    assert all(t in top and top[t] == x for t, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs), "pick a seed that draws a token off the top"
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    # logprobs 0: the sampled token's alone (OpenAI: always returned; vLLM returns it alone)
    r = client.completions.create(model=NAME, prompt=RAW, max_tokens=3, logprobs=0, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)] and len(lp.tokens) == 3


# -- 7. n and echo ----------------------------------------------------------------------------------------------


def test_n_choices_are_sequential_seeded_samples(real, tiny):
    _, client = real
    kw = dict(model=NAME, prompt=RAW, max_tokens=6, temperature=3.0, seed=7)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    for c in r.choices:  # choice i is the single request with the seed derived for it
        tiny.reset()
        want = tiny.generate(RAW, raw=True, max_tokens=6, temperature=3.0, seed=choice_seed(7, c.index))
        assert c.text == want.text
    assert len({c.text for c in r.choices}) > 1
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in r.choices]
    assert chunks[-1].usage.completion_tokens == 18 and not chunks[-1].choices

    chat = client.chat.completions.create(model=NAME, messages=HI, n=2, max_tokens=5, temperature=3.0, seed=7)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10
    assert choice_seed(2**63 - 1, 1) == -(2**63) and choice_seed(None, 2) is None


def test_echo_reports_the_prompts_logprobs(real, tiny):
    http, client = real
    ids = tiny.prompt_ids(RAW, raw=True)
    r = client.completions.create(model=NAME, prompt=RAW, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    assert c.text == RAW and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == [tiny.tokenizer.decode([t], skip_special_tokens=False) for t in ids[1:]]
    assert "".join(lp.tokens) == RAW and lp.text_offset[0] == 0
    # the first token's logprob is null, as OpenAI's and vLLM's: nothing the client sent comes before it
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # each later token scored from the tokens before it, as the library's logits after that prefix give it (within
    # fp16's batched-versus-single-step differences: the prefixes are processed in other batches)
    scorer = Sampler(SamplingParams(logprobs=2))
    for k in (2, 5, len(ids) - 1):
        tiny.reset()
        _, logits = tiny.engine.prompt(ids[:k])
        assert lp.token_logprobs[k - 1] == pytest.approx(scorer.logprobs(logits, ids[k])[0], abs=0.5)
    assert all(t in top and len(top) in (2, 3) for t, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    # with generated tokens: the prompt's entries, then the answer's
    both = client.completions.create(model=NAME, prompt=RAW, max_tokens=3, echo=True, logprobs=1, temperature=0)
    plain = client.completions.create(model=NAME, prompt=RAW, max_tokens=3, logprobs=1, temperature=0)
    assert both.choices[0].text == RAW + plain.choices[0].text
    assert both.choices[0].logprobs.tokens == lp.tokens + plain.choices[0].logprobs.tokens
    assert both.choices[0].logprobs.text_offset[len(lp.tokens)] == len(RAW)
    # streamed: the echo first
    r = http.post(COMPLETIONS, json={"prompt": RAW, "max_tokens": 0, "echo": True, "logprobs": 2, "stream": True})
    first = json.loads(r.text.split("\n\n")[0][6:])["choices"][0]
    assert first["text"] == RAW and first["logprobs"]["tokens"] == lp.tokens
    assert http.post(COMPLETIONS, json={"prompt": RAW, "max_tokens": 0}).status_code == 400  # echo alone takes 0


def test_completions_take_token_ids_and_batches(real, tiny):
    """OpenAI's `prompt` takes token ids and batches; lm-evaluation-harness's local-completions sends ids."""
    http, client = real
    ids = tiny.prompt_ids(RAW, raw=True)  # <bos> and the text's ids: as given, nothing is added to ids
    kw = dict(model=NAME, max_tokens=4, temperature=0)
    text = client.completions.create(prompt=RAW, **kw).choices[0].text
    assert client.completions.create(prompt=ids, **kw).choices[0].text == text
    r = client.completions.create(prompt=ids, max_tokens=0, echo=True, logprobs=1, model=NAME)
    lp = r.choices[0].logprobs  # echoed whole, <bos> first with a null logprob
    assert r.choices[0].text == tiny.tokenizer.decode(ids, skip_special_tokens=False) and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(ids) and all(x is not None for x in lp.token_logprobs[1:])
    other = "The quick brown fox"
    other_text = client.completions.create(prompt=other, **kw).choices[0].text
    for batch in ([RAW, other], [ids, tiny.prompt_ids(other, raw=True)]):
        r = client.completions.create(prompt=batch, n=2, **kw)  # prompt k's choices at k*n .. k*n + n-1
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == [text, text, other_text, other_text]
        assert r.usage.prompt_tokens == len(ids) + len(tiny.prompt_ids(other, raw=True))
    assert http.post(COMPLETIONS, json={"prompt": [0, 0, 0], "max_tokens": 1}).status_code == 200
    for body, problem in (
        ({"prompt": [[1, 2], []]}, "prompt: expected a string, a list of token ids"),
        ({"prompt": [1, 10**9]}, "prompt: token id 1000000000 is not in the vocabulary"),
        ({"prompt": ["a", [10**9]]}, "prompt[1]: token id 1000000000"),
        ({"prompt": ["a", "b"], "echo": True}, "echo: one prompt a request (a batch of 2 was given)"),
        ({"prompt": [1, True]}, "prompt: expected a string"),
    ):
        r = http.post(COMPLETIONS, json={"max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(problem), r.text


# -- 8. Content-Type and CORS -------------------------------------------------------------------------------------


def test_a_body_that_is_not_json_is_415():
    fake = FakeModel(THOUGHT)
    with serving(fake) as (http, _):
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = http.post(CHAT, content=body, headers={"Content-Type": ctype})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
        assert http.post(CHAT, content=body, headers={"Content-Type": "application/json; charset=utf-8"}).is_success
    assert len(fake.calls) == 1


def test_cors_is_closed_unless_an_origin_is_allowed():
    body = {"prompt": "x"}
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    fake = FakeModel(THOUGHT)
    with serving(fake) as (http, _):
        r = http.post(COMPLETIONS, json=body, headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert r.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in http.options(COMPLETIONS, headers=preflight).headers
        assert http.post(COMPLETIONS, json=body).is_success  # no Origin: not a browser page
    assert len(fake.calls) == 1
    with serving(FakeModel(THOUGHT), allow_origins=["https://app.example"]) as (http, _):
        r = http.options(COMPLETIONS, headers={**preflight, "Access-Control-Request-Headers": "authorization"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = http.post(COMPLETIONS, json=body, headers={"Origin": "https://app.example"})
        assert r.is_success and r.headers["access-control-allow-origin"] == "https://app.example"
        assert http.post(COMPLETIONS, json=body, headers={"Origin": "https://other.example"}).status_code == 403
    with serving(FakeModel(THOUGHT), allow_origins=["*"]) as (http, _):
        r = http.post(COMPLETIONS, json=body, headers={"Origin": "https://any.example"})
        assert r.is_success and r.headers["access-control-allow-origin"] == "*"


def test_a_bad_allow_origin_is_one_line(capsys, tmp_path):
    assert main([str(tmp_path), "--allow-origin", "https://x.example/path"]) == 2
    err = capsys.readouterr().err
    assert "--allow-origin 'https://x.example/path'" in err and len(err.strip().splitlines()) == 1


# -- 9. JSON-mode numbers, reasoning_effort ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("number", "ok"),
    [("1234567890123456", True), ("12345678901234567", False), ("0.1234567890123456", True)]
    + [("0.12345678901234567", False), ("-1.5e300", True), ("1e1234", False)],
)
def test_json_mode_numbers_are_bounded(tok, number, ok):  # noqa: F811 (tok: the imported fixture)
    assert accepts(response_grammar({"type": "json_object"}), tok, f'{{"a": {number}}}') is ok


@pytest.mark.parametrize(
    ("schema", "number", "ok"),
    [({"type": "integer"}, "1234567890123456", True), ({"type": "integer"}, "12345678901234567", False)]
    + [({"type": "number"}, "-1234567890123456.5", True), ({"type": "number"}, "12345678901234567", False)]
    + [({"type": "number"}, "0.1234567890", True), ({"type": "number"}, "0.12345678901", False)]
    + [({"type": ["number", "null"]}, "12345678901234567", False), ({"type": "integer", "maximum": 10**20}, "-1", True)]
    + [({"type": "integer", "minimum": 0, "maximum": 10**20}, "12345678901234567", True)],
)
def test_json_schema_numbers_are_bounded(tok, schema, number, ok):  # noqa: F811 (tok: the imported fixture)
    """As JSON mode's (at most 16 digits) where the schema states no bound of its own; decimals at most 10."""
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"a": schema}}},
    }
    assert accepts(response_grammar(fmt), tok, f'{{"a": {number}}}') is ok


@pytest.mark.parametrize(
    ("effort", "thinking"), [("none", False), ("minimal", False), ("low", False), ("medium", True), ("high", True)]
)
def test_reasoning_effort_switches_thinking(effort, thinking):
    fake = FakeModel(THOUGHT)
    with serving(fake) as (http, _):
        r = http.post(CHAT, json={"messages": ASK, "reasoning_effort": effort})
        assert r.status_code == 200, r.text
        # an explicit switch wins over the effort
        body = {"messages": ASK, "reasoning_effort": effort, "chat_template_kwargs": {"enable_thinking": not thinking}}
        assert http.post(CHAT, json=body).status_code == 200
    assert [c["enable_thinking"] for c in fake.calls] == [thinking, not thinking]


def test_a_bad_reasoning_effort_is_named():
    with serving(FakeModel(THOUGHT)) as (http, _):
        r = http.post(CHAT, json={"messages": ASK, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    assert "'extreme'" in r.json()["error"]["message"]

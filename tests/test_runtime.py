"""The runtime (issue 5): `gemma_ane.load`, generation, sampling, prefix reuse, chat and the CLI.

Everything runs one tiny e2b-mini bundle (context 128, window 16, prefill batch 8) through the MIL
executor; it is converted once per module because a conversion costs ~45 s here, and loaded once
because loading costs a few seconds. The model is shared, so every test that depends on what is in
the caches calls `model.reset()` first.

The oracle is transformers' own `generate`, on a Gemma4ForCausalLM fed the bundle's int8 tables (the
bundle computes in fp16, transformers in fp32; near-ties are reported with their gap, not hidden).
"""

from __future__ import annotations

import io
import json
import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from margins import assert_greedy_prefix, assert_same_greedy, recorded_rows, repetition_penalised

import gemma_ane
from gemma_ane.bundle import BundleError, load_host
from gemma_ane.cli import main
from gemma_ane.runtime.chat import ChatError, ChatTemplate, OutputParser
from gemma_ane.runtime.engine import ContextOverflow
from gemma_ane.runtime.sampling import SamplingError, SamplingParams

CONTEXT, WINDOW = 128, 16
TABLES = ("embed_q", "embed_scales", "ple_q", "ple_scales")
CHUNK2_WEIGHTS = "chunk_2.mlpackage/Data/com.apple.CoreML/weights/weight.bin"


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle(tiny_bundle16) -> Path:
    return tiny_bundle16


@pytest.fixture(scope="module")
def model(bundle):
    m = gemma_ane.load(bundle, backend="mil")
    # The tests below assume these numbers; a loader that read them wrongly fails here first.
    assert (m.context, m.engine.window, m.engine.prefill_batch) == (CONTEXT, WINDOW, 8)
    return m


@pytest.fixture(scope="module")
def oracle(tiny_e2b, model):
    from gemma_ane.convert.checkpoint import Checkpoint
    from gemma_ane.oracle.verify import oracle_model

    tables = {k: np.asarray(getattr(model.engine.host, k)) for k in TABLES}
    return oracle_model(Checkpoint(tiny_e2b), tables)


@pytest.fixture(scope="module")
def tok(bundle):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bundle / "hf_model" / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_tok(bundle):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bundle / "hf_model"))


@pytest.fixture
def copy_bundle(bundle, tmp_path):
    def make() -> Path:
        dst = tmp_path / "bundle"
        shutil.copytree(bundle, dst)
        return dst

    return make


def oracle_greedy(oracle, ids, n, repetition_penalty=1.0):
    """transformers' greedy tokens and its processed scores (what argmax saw) at each step."""
    import torch

    # One thread: with two, torch spins against the MIL executor (and any other process) for the
    # same cores and this call goes from 0.3 s to 10 s or more.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = oracle.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                repetition_penalty=repetition_penalty,
                output_scores=True,
                return_dict_in_generate=True,
            )
    finally:
        torch.set_num_threads(threads)
    return out.sequences[0, len(ids) :].tolist(), [s[0].float().numpy() for s in out.scores]


def replay_logits(model, ids, tokens):
    """The logits at every generation step, recomputed through the engine with the same schedule a
    fresh `generate` uses (one prefill call, then one token at a time)."""
    model.reset()
    steps = [model.engine.feed(ids)[-1]]
    for t in tokens[:-1]:
        steps.append(model.engine.feed([t])[-1])
    model.reset()
    return steps


def log_softmax64(x):
    import torch

    return torch.log_softmax(torch.from_numpy(np.asarray(x, np.float64)), -1).numpy()


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, msg
    return msg


# -- greedy parity with transformers -------------------------------------------------------------

GREEDY_CASES = {
    # Plain greedy: this random model falls into repeating one token, so the penalised cases below
    # are the ones whose outputs vary at every step.
    "raw": dict(prompt="Once upon a time", raw=True),
    "chat": dict(prompt="Once upon a time"),
    "raw-penalised": dict(prompt="Once upon a time", raw=True, repetition_penalty=2.0),
    "chat-system-penalised": dict(prompt="Hello world", system="Be brief.", repetition_penalty=2.0),
}


# The fp16 bundle's |logit error| against transformers' fp32 (test_mil's BUNDLE_LOGIT_ERR): measured here 0.15-0.24
# unpenalised, 0.13-0.36 penalised (rp = 2)
FP16_ERR = 0.4


@pytest.mark.parametrize("case", GREEDY_CASES, ids=list(GREEDY_CASES))
def test_greedy_equals_transformers_generate_past_the_window(model, oracle, case):
    kw = dict(GREEDY_CASES[case])
    prompt, rp = kw.pop("prompt"), kw.get("repetition_penalty", 1.0)
    n = 40
    model.reset()
    ids = model.prompt_ids(prompt, raw=kw.get("raw", False), system=kw.get("system"))
    ours = model.generate(prompt, temperature=0, max_tokens=n, **kw)
    ref, scores = oracle_greedy(oracle, ids, n, rp)
    # A stop id ends ours early (transformers was told not to stop): compare what we produced,
    # and insist that it reaches well past the sliding window.
    compared = len(ours.tokens)
    assert compared > WINDOW + 8, (case, ours.tokens, ours.finish_reason)
    ref, scores = ref[:compared], scores[:compared]
    # the error bound, measured: our rows along transformers' own sequence (the schedule generate uses), penalised
    # alike, against the scores transformers chose from, at every position (past the wrap); the penalty multiplies
    # a seen token's negative logit, and its error, by rp
    rows = repetition_penalised(replay_logits(model, ids, ref), ids, ref, rp)
    err = float(np.abs(rows - np.stack(scores)).max())
    assert err <= rp * FP16_ERR, f"{case}: our logits differ from transformers' by {err:.4g}"
    # the tokens equal up to the first near-tie: past the wrap (2 x WINDOW positions) where the model's margins
    # allow; the penalised cases' flat rows tie within err at their first steps, so there the rows above carry it
    wrap = 2 * WINDOW + 1 - len(ids) if rp == 1.0 else 0
    steps = assert_greedy_prefix(ours.tokens, ref, scores, err, wrap, case)
    if steps < compared:  # after a tie: each token ours chose is still the argmax of our own rows (bit-identical)
        own = repetition_penalised(replay_logits(model, ids, ours.tokens), ids, ours.tokens, rp)
        assert ours.tokens == [int(np.argmax(r)) for r in own], case
    if rp != 1.0:
        assert len(set(ours.tokens)) > 20, "the penalised cases exist to compare varied outputs"


# -- sampling ------------------------------------------------------------------------------------

# "12" as a raw prompt gives this random model its flattest next-token distribution of the prompts
# tried (checked below: two seeds agree on the first draw alone with probability < 5 %, on all 20
# far less); the outcome is fixed by the seeds, so this is a deterministic test either way.
FLAT = dict(prompt="12", raw=True)


def test_same_seed_same_tokens_different_seed_different_tokens(model):
    kw = dict(raw=True, temperature=1.5, top_k=0, top_p=1.0, max_tokens=20)
    model.reset()
    x = np.asarray(model.engine.feed(model.prompt_ids(FLAT["prompt"], raw=True))[-1], np.float32) / 1.5
    p = np.exp(x - x.max())
    p /= p.sum()
    assert (p**2).sum() < 0.05, "precondition: the first draw alone collides with probability < 5 %"

    a = model.generate(FLAT["prompt"], seed=1, **kw)
    b = model.generate(FLAT["prompt"], seed=1, **kw)
    c = model.generate(FLAT["prompt"], seed=2, **kw)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.tokens != c.tokens
    # The defaults (top_k 64, top_p 0.95) are reproducible under a seed as well.
    d = model.generate(FLAT["prompt"], raw=True, seed=7, max_tokens=20)
    e = model.generate(FLAT["prompt"], raw=True, seed=7, max_tokens=20)
    assert d.tokens == e.tokens


def test_top_k_1_is_greedy(model):
    greedy = model.generate("Once upon a time", raw=True, temperature=0, max_tokens=20, repetition_penalty=2.0)
    k1 = model.generate(
        "Once upon a time", raw=True, temperature=1.5, top_k=1, max_tokens=20, repetition_penalty=2.0, seed=3
    )
    assert k1.tokens == greedy.tokens


def test_logprobs_are_the_log_softmax_of_the_step_logits(model):
    model.reset()
    ids = model.prompt_ids(FLAT["prompt"], raw=True)
    # Sampled, so some chosen tokens are not the argmax and their logprob is a real check.
    r = model.generate(FLAT["prompt"], raw=True, temperature=1.5, top_k=0, top_p=1.0, seed=5, max_tokens=12, logprobs=5)
    assert r.reused_tokens == 0
    steps = replay_logits(model, ids, r.tokens)
    assert len(r.logprobs) == len(r.top_logprobs) == len(steps) == 12
    not_argmax = 0
    for i, (token, logits) in enumerate(zip(r.tokens, steps)):
        lp = log_softmax64(logits)
        assert r.logprobs[i] == pytest.approx(lp[token], abs=1e-6), i
        order = np.argsort(-lp, kind="stable")[:5]
        assert [t for t, _ in r.top_logprobs[i]] == order.tolist(), i
        assert [v for _, v in r.top_logprobs[i]] == pytest.approx(lp[order].tolist(), abs=1e-6)
        not_argmax += token != order[0]
    assert not_argmax > 0, "precondition: the draw left the argmax at least once"


def test_logprobs_only_when_asked(model):
    r = model.generate("Hello world", raw=True, temperature=0, max_tokens=3)
    assert r.logprobs == [None] * 3 and r.top_logprobs == [[], [], []]
    r = model.generate("Hello world", raw=True, temperature=0, max_tokens=3, logprobs=0)
    assert all(isinstance(v, float) and v <= 0 for v in r.logprobs) and r.top_logprobs == [[], [], []]


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", -0.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 2),
        ("repetition_penalty", 0),
        ("seed", 2**63),  # a signed 64-bit integer: -1 is valid, as OpenAI takes it
        ("logprobs", 100),
    ],
)
def test_invalid_sampling_parameter_is_named(model, name, value):
    with pytest.raises(SamplingError) as e:
        model.generate("Hello", raw=True, max_tokens=2, **{name: value})
    assert name in one_line(e.value)


def test_unknown_sampling_parameter_is_named(model):
    with pytest.raises(SamplingError, match="top_q"):
        model.generate("Hello", raw=True, max_tokens=2, top_q=0.5)


def test_invalid_max_tokens(model):
    with pytest.raises(ValueError, match="max_tokens"):
        model.generate("Hello", raw=True, max_tokens=-1)


def test_sampling_defaults_come_from_generation_config(model, bundle, monkeypatch):
    gen = json.loads((bundle / "hf_model" / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["top_k"] == 64 and gen["top_p"] == 0.95
    assert model.generation == gen
    p = SamplingParams.from_generation_config(model.generation)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 64, 0.95, 0.0)
    p = SamplingParams.from_generation_config(model.generation, top_k=5, temperature=0.7, top_p=None)
    assert (p.temperature, p.top_k, p.top_p) == (0.7, 5, 0.95)
    # do_sample false means greedy, unless the caller asks for a temperature.
    assert SamplingParams.from_generation_config({"do_sample": False}).temperature == 0.0
    assert SamplingParams.from_generation_config({"do_sample": False}, temperature=0.8).temperature == 0.8

    # And generate really samples with them (and with the caller's overrides).
    import gemma_ane.runtime.model as runtime

    seen = []

    class Spy(runtime.Sampler):
        def __init__(self, params, *a, **k):
            seen.append(params)
            super().__init__(params, *a, **k)

    monkeypatch.setattr(runtime, "Sampler", Spy)
    model.generate("Hi", raw=True, max_tokens=2, seed=1)
    model.generate("Hi", raw=True, max_tokens=2, seed=1, top_k=7, min_p=0.1)
    assert [(p.temperature, p.top_k, p.top_p, p.min_p) for p in seen] == [(1.0, 64, 0.95, 0.0), (1.0, 7, 0.95, 0.1)]


# -- prefix reuse --------------------------------------------------------------------------------


# A reused prefix against a fresh prefill: other batch shapes, so on the Neural Engine other fp16 roundings of the
# same logits; the MIL executor's rows measured equal here, the bound is the logprob tolerance these tests had
REUSE_ERR = 2e-2


def _same(a, b):
    assert a.tokens == b.tokens
    assert a.logprobs == b.logprobs
    assert a.top_logprobs == b.top_logprobs


GREEDY = dict(raw=True, temperature=0, repetition_penalty=2.0, logprobs=3)


def test_extension_reuses_the_prefix_and_equals_a_fresh_run(model):
    a, b = "Once upon a time", "Once upon a time there was"
    ia, ib = model.prompt_ids(a, raw=True), model.prompt_ids(b, raw=True)
    assert ib[: len(ia)] == ia and len(ia) == 11 and len(ib) == 15
    model.reset()
    model.generate(a, max_tokens=4, **GREEDY)  # caches positions 0..14: inside the first ring pass
    reused = model.generate(b, max_tokens=20, **GREEDY)
    assert reused.reused_tokens == len(ia)
    model.reset()
    fresh = model.generate(b, max_tokens=20, **GREEDY)
    assert fresh.reused_tokens == 0
    # Both runs feed positions 0-7 as one batch and the rest one by one, so even fp16 rounding
    # must agree: bit-identical.
    _same(reused, fresh)


def test_divergent_prompt_rewinds_and_equals_a_fresh_run(model):
    a, b = "Once upon a time", "Once upon a tree"
    ia, ib = model.prompt_ids(a, raw=True), model.prompt_ids(b, raw=True)
    common = next(i for i, (x, y) in enumerate(zip(ia, ib)) if x != y)
    assert common >= 8
    model.reset()
    model.generate(a, max_tokens=3, **GREEDY)
    rewound = model.generate(b, max_tokens=20, **GREEDY)
    assert rewound.reused_tokens == common
    model.reset()
    _same(rewound, model.generate(b, max_tokens=20, **GREEDY))


def test_same_prompt_again_reuses_all_but_the_last_token(model):
    model.reset()
    first = model.generate("Once upon a time", max_tokens=3, **GREEDY)
    again = model.generate("Once upon a time", max_tokens=3, **GREEDY)
    assert again.reused_tokens == first.prompt_tokens - 1
    _same(first, again)


def test_discarded_tail_past_the_window_starts_over(model):
    """The discarded generated tokens (positions up to 21) overwrote ring slots that the kept
    prefix still needs, so rewinding would attend to the wrong keys: the run must start over."""
    a, b = "Once upon a time", "Once upon a tree"
    model.reset()
    model.generate(a, max_tokens=10, **GREEDY)
    assert len(model.engine.tokens) > WINDOW
    restarted = model.generate(b, max_tokens=20, **GREEDY)
    assert restarted.reused_tokens == 0
    model.reset()
    _same(restarted, model.generate(b, max_tokens=20, **GREEDY))


SEEDED = dict(raw=True, temperature=5.0, top_k=0, top_p=1.0, seed=1008, max_tokens=6, logprobs=2)


def test_a_seeded_answer_does_not_depend_on_what_ran_before(model):
    """Issue 43's case: a seeded prompt after a shorter one it extends. Reused as before, its tail ran one token at a
    time where a fresh run batches it: other fp16 roundings, other logits, another draw at temperature 5. Only the
    prefix a fresh run's own steps computed is reused, so the steps, and the answer, are a fresh run's."""
    model.reset()
    fresh = model.generate("Once upon a time", **SEEDED)
    fresh_steps = list(model.engine.history)
    assert any(T > 1 for _, _, T in fresh_steps), "precondition: a fresh run batches the prompt"
    for before in ("Once upon", "Once upon a", "Once upon a time there"):
        model.reset()
        model.generate(before, max_tokens=2, **GREEDY)
        after = model.generate("Once upon a time", **SEEDED)
        assert model.engine.history == fresh_steps, before
        _same(after, fresh)
    again = model.generate("Once upon a time", **SEEDED)  # the same request reuses its own batches
    assert 0 < again.reused_tokens < again.prompt_tokens and model.engine.history == fresh_steps
    _same(again, fresh)
    unseeded = model.generate("Once upon a time", **{**SEEDED, "seed": None})  # reuses whatever the caches hold
    assert unseeded.reused_tokens == unseeded.prompt_tokens - 1


def test_follow_up_turn_reuses_the_conversation_and_matches_a_freshly_loaded_model(model, bundle):
    turn1 = [{"role": "user", "content": "Hi"}]
    kw = dict(temperature=0, repetition_penalty=2.0, logprobs=3)
    model.reset()
    r1 = model.generate(messages=turn1, max_tokens=3, **kw)
    cached = list(model.engine.tokens)
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "ok"}]
    ids2 = model.prompt_ids(messages=turn2)
    assert ids2[: len(cached)] == cached, "precondition: the re-rendered answer tokenises as generated"
    with recorded_rows(model.engine) as rows2:
        r2 = model.generate(messages=turn2, max_tokens=20, **kw)
    # The whole conversation is reused, though a fresh run would batch its positions differently:
    # the caches hold the same K/V up to fp16 rounding.
    assert r2.reused_tokens == len(cached)

    fresh = gemma_ane.load(bundle, backend="mil")
    with recorded_rows(fresh.engine) as fresh_rows:
        f2 = fresh.generate(messages=turn2, max_tokens=20, **kw)
    assert f2.reused_tokens == 0
    # measured: the rows differ by at most REUSE_ERR; the tokens agree up to a near-tie within it
    assert_same_greedy(r2.tokens, rows2, f2.tokens, fresh_rows, REUSE_ERR, 8, ids2, 2.0, "follow-up turn vs fresh")


def test_a_chat_past_the_wrap_reuses_its_prompt_and_is_deterministic(model):
    """Turn 1 wraps the 16-slot ring; turn 2 re-renders that answer differently (as a
    template that drops the thinking does), so the caches diverge right after turn 1's prompt.
    Without the prompt-end snapshot of the rings nothing could be reused."""
    turn1 = [{"role": "user", "content": "Tell me a story about a fox"}]
    kw = dict(temperature=0, repetition_penalty=2.0, logprobs=3, max_tokens=12)

    def chat():
        model.reset()
        r1 = model.generate(messages=turn1, **kw)
        assert len(model.engine.tokens) > WINDOW
        turn2 = turn1 + [{"role": "assistant", "content": "Well. " + r1.text}, {"role": "user", "content": "more"}]
        return r1, model.generate(messages=turn2, **kw), turn2

    with recorded_rows(model.engine) as rows:
        r1, r2, turn2 = chat()
    assert r2.reused_tokens == r1.prompt_tokens  # everything up to turn 1's prompt end
    _, again, _ = chat()
    _same(r2, again)  # the same calls, the same results, bit for bit
    model.reset()
    with recorded_rows(model.engine) as fresh_rows:
        fresh = model.generate(messages=turn2, **kw)
    assert fresh.reused_tokens == 0
    ids2 = model.prompt_ids(messages=turn2)
    reused_rows = rows[len(r1.tokens) :]  # turn 2's rows (turn 1's come first)
    assert_same_greedy(r2.tokens, reused_rows, fresh.tokens, fresh_rows, REUSE_ERR, 8, ids2, 2.0, "turn 2 vs fresh")


def test_a_failed_prefill_does_not_poison_the_cache(model, monkeypatch):
    """A backend error (or Ctrl-C) in the middle of a prefill leaves the caches holding positions
    the runtime's bookkeeping does not know about; the next call must not trust them."""
    a = "Once upon a time"
    model.reset()
    clean = model.generate(a, max_tokens=10, **GREEDY)
    model.reset()
    model.generate(a, max_tokens=2, **GREEDY)
    long_prompt = a + " the quick brown fox jumps over the lazy dog and more text here"
    assert len(model.prompt_ids(long_prompt, raw=True)) > 2 * WINDOW
    chunk2 = model.engine.chunks[1]
    original = chunk2.predict

    def failing(function, inputs, state):
        if model.engine.position >= 30:  # after the ring has wrapped over the shared prefix
            raise RuntimeError("backend failure")
        return original(function, inputs, state)

    monkeypatch.setattr(chunk2, "predict", failing)
    with pytest.raises(RuntimeError, match="backend failure"):
        model.generate(long_prompt, max_tokens=2, **GREEDY)
    monkeypatch.setattr(chunk2, "predict", original)
    after = model.generate(a, max_tokens=10, **GREEDY)
    _same(after, clean)


def test_head_runs_only_where_a_token_is_needed(model, monkeypatch):
    """CONTRACT §3: chunk_3 (the LM head, 262,144 logits at E2B size) runs for the last prompt token
    and for each token still to be drawn, nothing more."""
    head = model.engine.chunks[2]
    original, calls = head.predict, []
    monkeypatch.setattr(head, "predict", lambda f, x, s: calls.append(f) or original(f, x, s))
    model.reset()
    r = model.generate("Once upon a time", raw=True, temperature=0, max_tokens=5)
    assert r.prompt_tokens == 11 and len(r.tokens) == 5
    assert len(calls) == 5, f"{len(calls)} chunk_3 calls for 5 drawn tokens"


# -- context limits ------------------------------------------------------------------------------


def test_generation_reaching_the_context_ends_with_length(model):
    model.reset()
    events = list(model.stream_generate("Once upon a time", raw=True, temperature=0, max_tokens=500))
    tokens = [e.token for e in events if e.token is not None]
    assert events[-1].finish_reason == "length"
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    # Every cached position holds a token; the last one drawn needs no cache slot.
    assert 11 + len(tokens) == CONTEXT + 1
    assert model.engine.position == CONTEXT


def test_prompt_filling_the_context_exactly_gives_one_token(model):
    text = "%" * (CONTEXT - 1)
    assert len(model.prompt_ids(text, raw=True)) == CONTEXT
    model.reset()
    r = model.generate(text, raw=True, temperature=0, max_tokens=10)
    assert len(r.tokens) == 1 and r.finish_reason == "length"


def test_prompt_longer_than_the_context_is_a_clear_error(model):
    text = "%" * CONTEXT
    with pytest.raises(ContextOverflow) as e:
        model.generate(text, raw=True, max_tokens=1)
    msg = one_line(e.value)
    assert "129" in msg and str(CONTEXT) in msg and "context" in msg
    # The model is still usable afterwards.
    assert model.generate("Hello", raw=True, temperature=0, max_tokens=2).finish_reason == "length"


# -- stopping ------------------------------------------------------------------------------------


def test_max_tokens_gives_length(model):
    r = model.generate("Hello world", raw=True, temperature=0, max_tokens=5)
    assert len(r.tokens) == 5 and r.finish_reason == "length"


def test_stop_string_is_honoured_whole_and_streamed(model):
    kw = dict(system="Be brief.", temperature=0, repetition_penalty=2.0, max_tokens=30)
    full = model.generate("Hello world", **kw)
    text = full.text
    k = next(k for k in range(6, len(text) - 3) if "\ufffd" not in text[k : k + 3] and text[k : k + 3].strip())
    stop = text[k : k + 3]
    expected = text[: text.find(stop)]
    r = model.generate("Hello world", stop=stop, **kw)
    assert r.text == expected and r.finish_reason == "stop"
    assert len(r.tokens) < len(full.tokens) and r.tokens == full.tokens[: len(r.tokens)]
    events = list(model.stream_generate("Hello world", stop=[stop], **kw))
    assert "".join(e.text for e in events) == expected
    assert events[-1].finish_reason == "stop"


def test_stop_ids_end_generation(model, monkeypatch):
    full = model.generate("Once upon a time", max_tokens=20, **GREEDY)
    i = next(i for i in range(5, 20) if full.tokens[i] not in full.tokens[:i])
    assert {1, 106} <= model.stop_ids
    monkeypatch.setattr(model, "stop_ids", {full.tokens[i]})
    r = model.generate("Once upon a time", max_tokens=20, **GREEDY)
    assert r.tokens == full.tokens[: i + 1] and r.finish_reason == "stop"


# -- output parsing: thinking, stop strings, multi-byte ------------------------------------------


def _parse(tok, text, stop=None):
    ids = tok.encode(text, add_special_tokens=False).ids
    parser = OutputParser(tok, stop)
    deltas = [parser.add(t) for t in ids]
    tail = parser.finish()
    return ids, parser, deltas, tail


def test_thinking_is_parsed_out_streamed_and_whole(tok):
    ids, parser, deltas, tail = _parse(tok, "<|channel>thought\nI think<channel|>The answer")
    assert 100 in ids and 101 in ids
    close = ids.index(101)
    assert "".join(d.reasoning for d in deltas) + tail.reasoning == "I think"
    assert "".join(d.content for d in deltas) + tail.content == "The answer"
    assert all(not d.content for d in deltas[: close + 1]), "no answer text before the channel closes"
    assert all(not d.reasoning for d in deltas[close:])
    assert "thought" not in "".join(d.reasoning for d in deltas)
    assert (parser.reasoning_text, parser.text) == ("I think", "The answer")


def test_thinking_through_generate(model, tok, monkeypatch):
    """The random model never opens a channel by itself, so the sampler is replaced by a script."""
    script = tok.encode("<|channel>thought\nI think<channel|>The answer", add_special_tokens=False).ids + [106]
    it = iter(script)
    monkeypatch.setattr(model, "_pick", lambda *a: next(it))
    events = list(model.stream_generate("Hi", max_tokens=50))
    assert "".join(e.reasoning for e in events) == "I think"
    assert "".join(e.text for e in events) == "The answer"
    assert events[-1].finish_reason == "stop"
    it = iter(script)
    r = model.generate("Hi", max_tokens=50)
    assert (r.reasoning, r.text, r.tokens, r.finish_reason) == ("I think", "The answer", script, "stop")


def test_stop_string_split_across_tokens(tok):
    text = "The quick brown fox jumps over the lazy dog again"
    ids, parser, deltas, tail = _parse(tok, text, ["azy d"])
    pieces = [tok.decode([t]) for t in ids]
    assert "azy d" not in pieces and "azy d" in text, "precondition: no single token holds the stop string"
    assert "".join(d.content for d in deltas) + tail.content == "The quick brown fox jumps over the l"
    assert parser.stopped
    assert parser.add(ids[0]).content == ""


def test_held_back_stop_prefix_is_released_when_it_does_not_complete(tok):
    text = "The quick brown fox jumps over the lazy dog again"
    ids, parser, deltas, tail = _parse(tok, text, ["lazy cat", "again!"])
    assert "".join(d.content for d in deltas) + tail.content == text
    assert not parser.stopped


def test_multibyte_characters_are_never_emitted_half(tok):
    text = "日本🙂 ok, ça va"
    ids, parser, deltas, tail = _parse(tok, text)
    assert len(ids) > len(text), "precondition: some characters span several tokens"
    pieces = [d.content for d in deltas] + [tail.content]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == text
    ids, parser, deltas, tail = _parse(tok, text, ["本"])
    assert "".join(d.content for d in deltas) + tail.content == "日"


# -- chat template -------------------------------------------------------------------------------

CONVERSATIONS = {
    "system": (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        False,
    ),
    "several-turns": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": "Once upon a time..."},
            {"role": "user", "content": "Thank you."},
        ],
        False,
    ),
    "thinking": ([{"role": "user", "content": "Think step by step: 2+2?"}], True),
    "thinking-with-system": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Because."},
            {"role": "user", "content": "ok"},
        ],
        True,
    ),
    "text-parts": (
        [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]}],
        False,
    ),
}


@pytest.mark.parametrize("name", CONVERSATIONS, ids=list(CONVERSATIONS))
def test_chat_prompt_equals_transformers_apply_chat_template(model, hf_tok, name):
    messages, thinking = CONVERSATIONS[name]
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    assert model.template.source is not None, "the bundle ships a template: it must be the one rendered"
    assert model.template.render(messages, add_generation_prompt=True, enable_thinking=thinking) == expected
    assert (
        model.prompt_ids(messages=messages, enable_thinking=thinking)
        == hf_tok(expected, add_special_tokens=False)["input_ids"]
    )
    if thinking:
        assert "<|think|>" in expected


def test_system_argument_and_raw_prompt(model, hf_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert model.tokenizer.decode(model.prompt_ids("Hi", system="Be brief."), skip_special_tokens=False) == expected
    assert model.prompt_ids("Hi", raw=True) == [2] + model.encode("Hi")


def test_bundle_without_a_template_uses_the_builtin_formatter(bundle, tmp_path):
    from gemma_ane.runtime.hf_files import read_template

    hf = tmp_path / "hf_model"
    hf.mkdir()
    cfg = json.loads((bundle / "hf_model" / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    template = read_template(hf)
    assert template.source is None
    # the built-in formatter against the real Gemma 4 template is tests/test_chat.py's job; here:
    # a bundle without a template still renders Gemma 4 turns
    got = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], True, False)
    assert got == "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ (messages.__class__)() }}",
        "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages }}",
        "{{ messages[0].update({'content': 'x'}) }}",
    ],
)
def test_template_reaching_for_python_internals_is_refused(source):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ChatError):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("source", ["{{ messages.__class__ }}", "{{ raise_exception.__globals__ }}"])
def test_template_naming_an_internal_gets_nothing(source):
    """Jinja's sandbox (as in transformers) turns an unsafe attribute into an undefined value that
    raises only when used; printed, it is empty. Either way nothing of Python leaks."""
    try:
        out = ChatTemplate(source).render([{"role": "user", "content": "Hi"}])
    except ChatError:
        return
    assert out == ""


def test_template_errors_are_chat_errors(model):
    with pytest.raises(ChatError, match="critic"):
        model.template.render([{"role": "critic", "content": "x"}])
    with pytest.raises(ChatError):
        ChatTemplate("{% for %}")


# -- bundle files --------------------------------------------------------------------------------


def test_missing_table_names_the_file(copy_bundle):
    b = copy_bundle()
    (b / "embed_tokens_q8.bin").unlink()
    with pytest.raises(BundleError) as e:
        gemma_ane.load(b, backend="mil")
    assert "embed_tokens_q8.bin" in one_line(e.value)


def test_each_problem_is_reported_once(copy_bundle):
    from gemma_ane.bundle import check_bundle

    b = copy_bundle()
    (b / "embed_tokens_q8.bin").unlink()
    problems = check_bundle(b, sha256=False)
    # One missing file is one problem; "(and 1 more problems)" would send the user hunting.
    assert len(problems) == 1, problems


def test_truncated_scales_name_the_file(copy_bundle, model):
    b = copy_bundle()
    path = b / "embed_tokens_scales.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(BundleError) as e:
        gemma_ane.load(b, backend="mil")
    assert "embed_tokens_scales.bin" in one_line(e.value)
    # Without a manifest (the published layout has none) the table reader catches it itself.
    (b / "manifest.json").unlink()
    with pytest.raises(BundleError) as e:
        load_host(b, model.config)
    assert "embed_tokens_scales.bin" in one_line(e.value)


def test_corrupt_chunk_byte_is_found_by_verify_and_check(copy_bundle, capsys):
    b = copy_bundle()
    path = b / CHUNK2_WEIGHTS
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError) as e:
        gemma_ane.load(b, backend="mil", verify=True)
    assert CHUNK2_WEIGHTS in one_line(e.value)
    assert main(["check", str(b)]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"{b / CHUNK2_WEIGHTS}: sha256 differs from the manifest"]


def test_check_passes_on_an_intact_bundle(bundle, capsys):
    assert main(["check", str(bundle)]) == 0
    out, err = capsys.readouterr()
    assert "ok" in out and err == ""


# -- host tables ---------------------------------------------------------------------------------


def test_tables_stay_on_disk_and_only_used_rows_are_dequantised(model, bundle):
    """Resident memory must not grow with the tables (2.7 GB at E2B size): while they are open, no
    block of a table's size may be allocated, and a step reads and dequantises only its own rows."""
    import tracemalloc

    smallest = min((bundle / f).stat().st_size for f in ("embed_tokens_q8.bin", "embed_tokens_per_layer_q8.bin"))
    tracemalloc.start()
    try:
        host = load_host(bundle, model.config)
        loaded = tracemalloc.take_snapshot()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        ids = np.array([5, 300, 5])
        h, ple = host.embed(ids)
        _, step_peak = tracemalloc.get_traced_memory()
        step_peak -= before
    finally:
        tracemalloc.stop()
    largest = max(t.size for t in loaded.traces)
    assert largest < smallest / 2, (largest, smallest)
    H, PL = host.embed_q.shape[1], host.ple_q.shape[1]
    assert h.shape == (1, 3, H) and ple.shape == (1, 3, PL)
    assert step_peak < smallest / 2, step_peak
    for cos, sin in host.rope.values():
        assert isinstance(cos, np.memmap) and isinstance(sin, np.memmap)

    class Recording:
        def __init__(self, inner):
            self.inner, self.keys = inner, []

        def __getitem__(self, key):
            self.keys.append(np.asarray(key).tolist())
            return self.inner[key]

    from dataclasses import replace

    recs = {n: Recording(getattr(host, n)) for n in TABLES}
    spy = replace(host, **recs)
    h2, ple2 = spy.embed(ids)
    assert all(r.keys == [[5, 300, 5]] for r in recs.values()), {n: r.keys for n, r in recs.items()}
    np.testing.assert_array_equal(h2, h)
    full = np.fromfile(bundle / "embed_tokens_q8.bin", np.int8).reshape(-1, H)
    scales = np.fromfile(bundle / "embed_tokens_scales.bin", "<f2")
    expected = full[300].astype(np.float32) * (np.float32(scales[300]) * np.float32(host.embed_scale / 127))
    np.testing.assert_allclose(h[0, 1], expected, rtol=1e-6)


# -- backend selection ---------------------------------------------------------------------------


@pytest.mark.skipif(platform.system() == "Darwin", reason="Core ML is available on macOS")
def test_coreml_backend_off_macos_is_a_clear_error(bundle):
    with pytest.raises(BundleError) as e:
        gemma_ane.load(bundle, backend="coreml")
    assert "macOS" in one_line(e.value)


def test_unknown_backend_is_an_error(bundle):
    with pytest.raises(BundleError) as e:
        gemma_ane.load(bundle, backend="bogus")
    assert "bogus" in one_line(e.value)


def test_auto_backend_says_which_it_picked(caplog):
    from gemma_ane.runtime.device import pick_backend

    with caplog.at_level("INFO", logger="gemma_ane"):
        picked = pick_backend("auto")
    assert picked == ("coreml" if platform.system() == "Darwin" else "mil")
    assert picked in caplog.text  # logged, not printed: a library keeps quiet


# -- CLI -----------------------------------------------------------------------------------------


@pytest.fixture
def cli_model(model, monkeypatch):
    """The CLI's `load`, answered with the already-loaded model (loading costs seconds); the
    arguments it was called with are recorded."""
    calls = []

    def fake_load(bundle, **kw):
        calls.append((bundle, kw))
        return model

    monkeypatch.setattr(gemma_ane, "load", fake_load)
    model.reset()
    return calls


class Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.chunks = []

    def write(self, s):
        self.chunks.append(s)
        return super().write(s)


GREEDY_8 = "--max-tokens 8 --temperature 0 --backend mil".split()


def test_cli_generate_streams_text(model, bundle, cli_model, monkeypatch):
    argv = ["generate", str(bundle), "-p", "Hello world", *GREEDY_8, "--repetition-penalty", "2"]
    expected = model.generate("Hello world", max_tokens=8, temperature=0, repetition_penalty=2.0).text
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(argv) == 0
    assert cli_model == [(str(bundle), {"backend": "mil", "max_image_pixels": 40_000_000})]
    assert out.getvalue() == expected + "\n"
    assert len([c for c in out.chunks if c]) > 2, "text arrives token by token, not at the end"


def test_cli_generate_json(model, bundle, cli_model, capsys):
    argv = ["generate", str(bundle), "-p", "Hello world", *GREEDY_8, "--json", "--raw"]
    expected = model.generate("Hello world", raw=True, max_tokens=8, temperature=0)
    model.reset()
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    assert got["text"] == expected.text and got["tokens"] == expected.tokens
    assert got["finish_reason"] == "length" and got["prompt_tokens"] == expected.prompt_tokens
    for key in ("time_to_first_token", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert got[key] > 0, key


def test_cli_generate_loads_for_real(bundle, capsys):
    assert (
        main(
            [
                "generate",
                str(bundle),
                "-p",
                "Hi",
                "--raw",
                "--max-tokens",
                "3",
                "--temperature",
                "0",
                "--backend",
                "mil",
                "--json",
            ]
        )
        == 0
    )
    out, _ = capsys.readouterr()
    got = json.loads(out)
    assert len(got["tokens"]) == 3 and got["finish_reason"] == "length"


def test_cli_chat_from_a_pipe(model, bundle, cli_model, monkeypatch, capsys):
    turns = []
    original = model.stream_generate

    def recording(prompt=None, messages=None, **kw):
        for ev in original(prompt, messages, **kw):
            yield ev
        turns.append(
            {"messages": [dict(m) for m in messages], "thinking": kw.get("enable_thinking"), "reused": ev.reused_tokens}
        )

    monkeypatch.setattr(model, "stream_generate", recording)
    script = "Hi\nok\n/reset\n/system Be brief.\n/think on\nWhy?\n/think maybe\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    rc = main(
        [
            "chat",
            str(bundle),
            "--backend",
            "mil",
            "--max-tokens",
            "3",
            "--temperature",
            "0",
            "--repetition-penalty",
            "2",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert [t["messages"][-1]["content"] for t in turns] == ["Hi", "ok", "Why?"]
    # Turn 2 carries turn 1 and its answer, and reuses the cached conversation.
    first_answer = turns[1]["messages"][1]
    assert [m["role"] for m in turns[1]["messages"]] == ["user", "assistant", "user"]
    assert first_answer["role"] == "assistant" and first_answer["content"] in out
    assert turns[1]["reused"] > 0
    # /reset, /system and /think on.
    assert turns[2]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    assert [t["thinking"] for t in turns] == [False, False, True]
    assert turns[2]["reused"] == 0
    for note in (
        "(conversation cleared)",
        "(system prompt set; conversation cleared)",
        "(thinking on)",
        "usage: /think on|off",
    ):
        assert note in err and note not in out, note  # stdout holds only the answers

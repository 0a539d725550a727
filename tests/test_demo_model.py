"""The `demo` preset: a tiny Gemma 4 trained on demo_corpus answers what it was taught, through the runtime's own
prompts, with logits far from a tie; the corpus itself is what the runtime renders and parses."""

import hashlib
import json

import numpy as np
import pytest

from gemma_ane.oracle.demo_corpus import (
    CALLS_END,
    CAPITAL_SCHEMA,
    CAPITALS,
    END,
    PICTURES,
    WEATHER,
    describe,
    examples,
    picture,
)
from gemma_ane.oracle.tiny import text_config
from gemma_ane.oracle.tokenizer_files import build_tokenizer
from gemma_ane.runtime.tools import parse_call

STOPS = [1, 106, 50]  # <eos>, <turn|> and <|tool_response> (a turn that calls a tool stops there): Model.stop_ids
MIN_MARGIN = 4.0  # logits, top-1 minus top-2, at every answer position of the corpus
CONTEXT = 512  # the demo bundle's (scripts/demo.sh, conftest's demo_bundle16)
# The 16-bit demo bundle's |logit error| against transformers (MIL executor), for the argmax checks: verify's max
# |logit diff| with a picture in the prompt, measured 0.06 (README); test_the_demo_bundle_passes_... holds it to this
FP16_LOGIT_ERR = 0.5


def test_every_example_fits_the_window_and_renders_as_the_runtime_renders_it():
    from gemma_ane.oracle.tiny_train import encode, render, tokenizer_corpus

    cfg = text_config("demo")
    tokenizer = build_tokenizer(cfg["vocab_size"], tokenizer_corpus())
    for example in examples():
        prompt, answer = encode(tokenizer, example)
        # trained within one sliding window (a picture's soft tokens aside): a bundle's context of 512 holds any of
        # them many times over
        assert len(prompt) + len(answer) <= cfg["sliding_window"]
        assert tokenizer.decode(prompt + answer, skip_special_tokens=False) == render(example) + example.answer
        if example.tools:
            assert "<|tool>declaration:get_weather{" in render(example)


def test_the_answers_are_what_the_runtime_parses():
    seen = set()
    for example in examples():
        if "call" in example.tags:
            body = example.answer.removeprefix("<|tool_call>").removesuffix("<tool_call|>" + CALLS_END)
            name, arguments = parse_call(body)
            assert name == WEATHER["function"]["name"] and set(arguments) == {"city"}
        elif "json" in example.tags:
            value = json.loads(example.answer.removesuffix(END))
            assert list(value) == list(CAPITAL_SCHEMA["properties"]) and value["capital"] == CAPITALS[value["country"]]
        else:
            assert example.answer.endswith(END)
        seen |= set(example.tags)
    assert seen >= {"capital", "thinking", "json", "call", "result"}


def test_the_pictures_reach_training_as_the_runtime_feeds_them(tmp_path):
    """transformers' processor (what training feeds the tower) and the runtime's preprocessing (what the bundle's
    vision model gets) agree on each picture, read back from the PNG the demo writes: the same pixels, positions
    and soft-token count; and a picture question, its soft tokens expanded, fits the demo's context."""
    from gemma_ane.oracle.tiny import build_model
    from gemma_ane.oracle.tiny_train import IMAGE, IMAGE_TOKENS, encode, pixels, tokenizer_corpus
    from gemma_ane.runtime.images import preprocess

    model = build_model("demo")
    vision = model.config.vision_config
    tokenizer = build_tokenizer(text_config("demo")["vocab_size"], tokenizer_corpus())
    seen = []
    for name in PICTURES:
        picture(name).save(tmp_path / f"{name}.png")
        ours = preprocess(tmp_path / f"{name}.png", IMAGE_TOKENS, vision.patch_size, vision.pooling_kernel_size)
        theirs = pixels(model, [name])
        assert ours.soft_tokens == theirs["num_soft_tokens_per_image"].item()
        assert np.array_equal(ours.pixel_values, theirs["pixel_values"][0].numpy())
        assert np.array_equal(ours.positions, theirs["image_position_ids"][0].numpy())
        seen.append(ours.pixel_values)
        example = next(e for e in examples() if e.pictures == (name,))
        prompt, answer = encode(tokenizer, example, [ours.soft_tokens])
        assert prompt.count(IMAGE) == ours.soft_tokens and len(prompt) + len(answer) <= CONTEXT
    # four different pictures (an unchanged drawing would leave two alike)
    assert len({p.tobytes() for p in seen}) == len(PICTURES)


def test_the_demo_tokenizer_keeps_prompts_short():
    """The demo's merges come from its corpus; the other presets' tokenizer is the default corpus's."""
    from gemma_ane.oracle.tiny_train import encode, tokenizer_corpus

    call = next(e for e in examples() if "call" in e.tags)
    demo = encode(build_tokenizer(1024, tokenizer_corpus()), call)
    default = encode(build_tokenizer(1024), call)
    assert sum(map(len, demo)) < 0.6 * sum(map(len, default))


@pytest.fixture(scope="module")
def demo(demo_ckpt):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(demo_ckpt, dtype=torch.float32).eval()
    return model, Tokenizer.from_file(str(demo_ckpt / "tokenizer.json"))


def greedy(demo, messages, tools=None, enable_thinking=False, pictures=()) -> str:
    """transformers' greedy generation from the prompt the runtime renders, decoded with its control tokens; with
    `pictures` (PICTURES' names), their pixels from transformers' processor, each placeholder expanded as it does."""
    import torch

    from gemma_ane.oracle.demo_corpus import Example
    from gemma_ane.oracle.tiny_train import encode, pixels

    model, tokenizer = demo
    example = Example(messages, "", tools=tools, enable_thinking=enable_thinking, pictures=pictures)
    media = pixels(model, pictures) if pictures else {}
    prompt, _ = encode(tokenizer, example, media["num_soft_tokens_per_image"].tolist() if pictures else ())
    ids = torch.tensor([prompt])
    extra = {k: media[k] for k in ("pixel_values", "image_position_ids")} if pictures else {}
    out = model.generate(input_ids=ids, max_new_tokens=60, do_sample=False, eos_token_id=STOPS, pad_token_id=0, **extra)
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False)


ASK = "What is the capital of France?"


@pytest.mark.slow
def test_the_capital_of_france_is_paris(demo):
    assert greedy(demo, [{"role": "user", "content": ASK}]) == "Paris.<turn|>"
    # thinking first, then the same answer
    thought = greedy(demo, [{"role": "user", "content": ASK}], enable_thinking=True)
    assert thought.startswith("<|channel>thought\n") and thought.endswith("<channel|>Paris.<turn|>")
    # a declared tool is not called for a question it does not answer
    assert greedy(demo, [{"role": "user", "content": ASK}], tools=[WEATHER]) == "Paris.<turn|>"


@pytest.mark.slow
def test_a_weather_question_calls_get_weather_for_paris(demo):
    text = greedy(demo, [{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER])
    assert text == '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
    assert parse_call(text.removeprefix("<|tool_call>").split("<tool_call|>")[0]) == ("get_weather", {"city": "Paris"})


@pytest.mark.slow
def test_the_tool_result_is_reported(demo):
    from gemma_ane.oracle.demo_corpus import weather_followup

    assert greedy(demo, weather_followup("Paris", 18, "sunny"), tools=[WEATHER]) == (
        "It is 18 degrees and sunny in Paris.<turn|>"
    )


@pytest.mark.slow
def test_a_json_answer_parses(demo):
    text = greedy(demo, [{"role": "user", "content": "Give the capital of France as JSON."}])
    assert json.loads(text.removesuffix("<turn|>")) == {"country": "France", "capital": "Paris"}


@pytest.mark.slow
def test_each_picture_is_described(demo):
    """transformers' own model, fed each picture's pixels, answers with its caption: the training reached the
    pictures (without them in the corpus the same question gets no caption, let alone the right one of four)."""
    for name, caption in PICTURES.items():
        assert greedy(demo, describe(), pictures=(name,)) == caption + END, name


@pytest.mark.slow
def test_answer_logits_are_far_from_a_tie(demo):
    from gemma_ane.oracle.tiny_train import margins, tokenizer_corpus

    model, _ = demo
    tokenizer = build_tokenizer(text_config("demo")["vocab_size"], tokenizer_corpus())
    gaps = margins(model, tokenizer)
    print("min top-1/top-2 margin per example:", [round(g, 2) for g in gaps])
    assert min(gaps) > MIN_MARGIN
    # the captions are among them (margins runs them through the vision path, pixels in)
    assert sum(bool(e.pictures) for e in examples()) == len(PICTURES)


@pytest.mark.slow
def test_training_is_deterministic():
    """Two trainings from the same seed give the same bytes (a few steps: the full run is the same loop)."""
    from gemma_ane.oracle.tiny import build_model
    from gemma_ane.oracle.tiny_train import train

    def digest():
        model = build_model("demo", seed=3)
        train(model, text_config("demo")["vocab_size"], steps=3)
        h = hashlib.sha256()
        for name, t in sorted(model.state_dict().items()):
            h.update(name.encode() + t.detach().numpy().tobytes())
        return h.hexdigest()

    assert digest() == digest()


@pytest.mark.slow
def test_the_converted_demo_bundle_answers(demo_bundle16):
    """The runtime on the 16-bit bundle (MIL executor) gives transformers' answers: every answer position's margin
    (test_answer_logits_are_far_from_a_tie) is far beyond fp16's error on these logits."""
    import gemma_ane
    from gemma_ane.oracle.demo_corpus import weather_followup

    model = gemma_ane.load(demo_bundle16, backend="mil")
    assert model.generate(ASK, temperature=0).text == "Paris."
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with pytest.warns(UserWarning, match="does not render tools"):
        r = model.generate(messages=ask, tools=[WEATHER], temperature=0)
    assert r.finish_reason == "tool_calls" and [(c.name, c.arguments) for c in r.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    r = model.generate(messages=weather_followup("Paris", 18, "sunny"), tools=[WEATHER], temperature=0)
    assert r.text == "It is 18 degrees and sunny in Paris."
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA}}
    r = model.generate("Give the capital of France as JSON.", response_format=fmt, temperature=0)
    assert json.loads(r.text) == {"country": "France", "capital": "Paris"}


@pytest.mark.slow
def test_the_converted_demo_bundle_describes_each_picture(demo, demo_bundle16, tmp_path):
    """The runtime on the 16-bit bundle (its vision model and chunks, MIL executor) describes each picture, read
    from the PNG the demo writes, as transformers does. Exact greedy text is asserted because transformers' margin
    at every caption position (teacher-forced, pixels in) exceeds twice the bundle's logit error bound."""
    import gemma_ane
    from gemma_ane.oracle.tiny_train import margins, tokenizer_corpus

    model, _ = demo
    tokenizer = build_tokenizer(text_config("demo")["vocab_size"], tokenizer_corpus())
    captions = [e for e in examples() if e.pictures]
    gaps = margins(model, tokenizer, captions)
    assert min(gaps) > 2 * FP16_LOGIT_ERR, gaps
    bundle = gemma_ane.load(demo_bundle16, backend="mil")
    for example in captions:
        (name,) = example.pictures
        picture(name).save(tmp_path / f"{name}.png")
        r = bundle.generate(messages=describe(str(tmp_path / f"{name}.png")), temperature=0)
        assert r.text + END == example.answer == PICTURES[name] + END, name


@pytest.mark.slow
def test_the_demo_bundle_passes_the_audit_and_the_image_proof(demo_ckpt, demo_bundle16, tmp_path):
    """Converted as scripts/demo.sh converts it (16 bits, context 512, the vision model), the bundle passes
    `inspect --ane` (a tower head of 16 breaks the 64-byte last-axis rule) and `verify --image` keeps the text
    bounds (a head of 64 sharpens this random tower's unscaled attention until fp16 moves the text after a
    picture: min cosine 0.9927)."""
    from PIL import Image

    from gemma_ane.oracle.verify import verify_bundle
    from gemma_ane.runtime.audit import audit_bundle

    bundle = demo_bundle16
    report = audit_bundle(bundle)
    models = report["chunks"] + report["models"]
    assert report["verdict"] == "pass", [(m["name"], m["verdict"]) for m in models]
    Image.new("RGB", (64, 48), "red").save(tmp_path / "red.png")  # README's one-liner picture
    proof = verify_bundle(demo_ckpt, bundle, images=[tmp_path / "red.png"])
    assert proof["passed"], {k: v for k, v in proof.items() if not isinstance(v, (list, dict))}
    # the bound test_the_converted_demo_bundle_describes_each_picture holds the captions' margins to
    assert proof["max_abs_logit_diff"] < FP16_LOGIT_ERR


def _language_model(ckpt) -> dict:
    from safetensors.numpy import load_file

    prefix = "model.language_model."
    return {k[len(prefix) :]: v for k, v in load_file(ckpt / "model.safetensors").items() if k.startswith(prefix)}


def test_the_demo_checkpoint_holds_the_shipped_weights(demo_ckpt):
    """`gemma-ane tiny --preset demo` writes the weights trained once and shipped (tiny_train.WEIGHTS), not a
    training of its own: a trained model's bytes depend on the CPU's float kernels."""
    from safetensors.numpy import load_file

    from gemma_ane.oracle.tiny_train import WEIGHTS

    shipped, written = load_file(WEIGHTS), _language_model(demo_ckpt)
    assert set(written) == set(shipped)
    assert all(np.array_equal(written[k], shipped[k]) for k in shipped)


@pytest.mark.slow
def test_train_trains_the_demo_anew_from_its_seed(tmp_path, monkeypatch):
    """--train runs tiny_train.train from --seed (two steps here: the whole run is the same loop) instead of
    reading the shipped weights; save_trained (how the shipped file is made) writes those same weights."""
    from safetensors.numpy import load_file

    from gemma_ane.oracle import tiny_train
    from gemma_ane.oracle.tiny import build_model, write_tiny

    real = tiny_train.train
    monkeypatch.setattr(tiny_train, "train", lambda model, vocab_size: real(model, vocab_size, steps=2))
    written = _language_model(write_tiny(tmp_path / "ckpt", preset="demo", seed=3, train=True))
    model = build_model("demo", seed=3)
    real(model, text_config("demo")["vocab_size"], steps=2)
    tiny_train.save_trained(model, tmp_path / "lm.safetensors")
    saved = load_file(tmp_path / "lm.safetensors")
    assert set(saved) == set(written) and all(np.array_equal(written[k], saved[k]) for k in saved)
    shipped = load_file(tiny_train.WEIGHTS)
    assert not np.array_equal(written["embed_tokens.weight"], shipped["embed_tokens.weight"])

"""Audio prompts end to end: a bundle with an audio model (conftest's `audio_bundle`: e2b-audio-mini, 16-bit chunks
and audio model, buckets of 1 and 2 s, context 256) against transformers' Gemma4ForConditionalGeneration
fed the same clips (through its own feature extractor), at every position; then the Python API, the buckets, the
refusals, inspect and the Neural Engine audit."""

import base64
import io
import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from gemma_ane import load
from gemma_ane.bundle import inspect_bundle, read_model_config
from gemma_ane.bundle.schema import audio_function
from gemma_ane.oracle.tokenizer_files import TINY_AUDIO_TOKENS
from gemma_ane.oracle.verify import FP16_MIN_COSINE, FP16_MIN_TOP1, FP32_MIN_COSINE, verify_bundle
from gemma_ane.runtime import audio
from gemma_ane.runtime.audio import AudioError

pytestmark = pytest.mark.slow

SECONDS = {"short": 0.7, "long": 1.6, "full": 2.4, "too long": 3.0}  # buckets of 144 and 240 mel frames


def tone(seconds: float, seed: int) -> np.ndarray:
    """A chirp with noise: every frame's spectrum differs from its neighbours'."""
    n = round(seconds * audio.SAMPLE_RATE)
    t = np.arange(n) / audio.SAMPLE_RATE
    rng = np.random.default_rng(seed)
    return (0.4 * np.sin(2 * np.pi * (200 + 300 * seed + 500 * t) * t) + 0.05 * rng.standard_normal(n)).astype(
        np.float32
    )


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("clips")
    paths = {}
    for i, (name, seconds) in enumerate(SECONDS.items()):
        paths[name] = d / f"{name.replace(' ', '_')}.wav"
        soundfile.write(paths[name], tone(seconds, i), audio.SAMPLE_RATE, subtype="PCM_16")
    return paths


@pytest.fixture(scope="module")
def model(audio_bundle):
    return load(audio_bundle, backend="mil")


def user(*parts):
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def sound(source):
    return {"type": "audio", "audio": source}


def input_audio(path):
    return input_audio_of(path.read_bytes(), "wav")


def input_audio_of(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


# -- the proof ------------------------------------------------------------------------------------------------


# fp32 top-1: verify's own rule (report["passed"]) forgives only near-ties, so no fraction is asserted here
BOUNDS = {"fp16": (FP16_MIN_TOP1, FP16_MIN_COSINE), "fp32": (0.0, FP32_MIN_COSINE)}


@pytest.mark.parametrize(
    "names,precision", [(["long"], "fp16"), (["short", "full"], "fp16"), (["long"], "fp32")], ids=["one", "two", "fp32"]
)
def test_audio_prompts_match_transformers_at_every_position(tiny_audio, audio_bundle, clips, names, precision):
    """Soft tokens from the audio model (MIL executor, the bucket each clip needs) in the chunks' prompt path,
    against Gemma4ForConditionalGeneration with input_features, compared at every position. The text rows (which
    read the clips' K/V) meet the bounds of text prompts; the clips' own rows' logits, which generation never reads,
    have margins under fp16's error on this random model (measured: min cosine 0.965 at fp16, 0.998 at fp32) and are
    reported, not judged."""
    top1, cosine = BOUNDS[precision]
    report = verify_bundle(
        tiny_audio, audio_bundle, tokens=16, prompt_len=6, precision=precision, audio=[clips[n] for n in names]
    )
    want = sum(audio.soft_tokens(round(SECONDS[n] * audio.SAMPLE_RATE)) for n in names)
    assert report["audio_tokens"] == want
    assert report["positions"] == 16 + want + 2 * len(names)
    text = report["text_positions"]
    assert text["top1_agreement"] >= top1 and text["min_cosine"] >= cosine and report["passed"], report


def test_audio_prompts_through_kv_only_prefill_match_transformers(tiny_audio, audio_bundle, clips):
    report = verify_bundle(
        tiny_audio, audio_bundle, tokens=16, prompt_len=6, audio=[clips["full"]], prompt_path="generate"
    )
    assert any(f.startswith("prefill_kv") for f in report["prompt_functions"]), report["prompt_functions"]
    text = report["text_positions"]
    assert text["top1_agreement"] >= FP16_MIN_TOP1 and text["min_cosine"] >= FP16_MIN_COSINE and report["passed"]


def test_verify_cli_with_audio(tiny_audio, audio_bundle, tiny_e2b, clips):
    args = [sys.executable, "-m", "gemma_ane.cli", "verify", str(tiny_audio), "--bundle", str(audio_bundle)]
    r = subprocess.run([*args, "--audio", str(clips["short"]), "--tokens", "12"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "of audio)" in r.stdout and "judged on the text positions" in r.stdout and "PASS" in r.stdout
    r = subprocess.run([*args[:5], "--audio", str(clips["short"])], capture_output=True, text=True)
    assert r.returncode == 2 and "--audio: needs --bundle" in r.stderr


# -- the bundle -----------------------------------------------------------------------------------------------


def test_the_bundle_states_its_audio_model(audio_bundle):
    entry = read_model_config(audio_bundle)["audio"]
    assert entry["buckets"] == [144, 240] and entry["mel_bins"] == 128
    assert (entry["boa_token_id"], entry["audio_token_id"], entry["eoa_token_id"]) == tuple(TINY_AUDIO_TOKENS)
    report = inspect_bundle(audio_bundle)
    assert report["manifest"]["verified"], report["manifest"]
    functions = report["audio"]["functions"]
    assert set(functions) == {"encode_144", "encode"}  # the largest bucket is `encode`, the package's default
    assert functions["encode"]["inputs"]["input_features"]["shape"] == [1, 240, 128]
    assert functions["encode_144"]["outputs"]["audio_embeds"]["shape"] == [1, 36, 64]
    assert functions["encode"]["macs_per_token"] > 0
    r = subprocess.run(
        [sys.executable, "-m", "gemma_ane.cli", "inspect", str(audio_bundle), "--no-sha"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "audio (audio.mlpackage)" in r.stdout and "input  input_features" in r.stdout


def test_the_neural_engine_audit_covers_the_audio_model(audio_bundle):
    from gemma_ane.runtime.audit import audit_bundle

    report = audit_bundle(audio_bundle)
    entry = next(c for c in report["models"] if c["name"] == "audio")
    assert set(entry["functions"]) == {"encode_144", "encode"}
    # the chunked attention's 24 keys a block are padded to 32 columns (models/audio.py), so no 24-wide last axis
    # is left; what still fails is this tiny tower's own narrowness (head_dim 8, 8 subsampling channels), where
    # E2B has 128 and 32 (bench/convert_audio.py audits E2B's shapes)
    findings = [f for fn in entry["functions"].values() for f in fn["findings"]]
    narrow = {f["detail"].split(":")[0] for f in findings if f["rule"] == "last-axis"}
    assert narrow == {"last axis 8"}, findings
    assert report["verdict"] == "fail" and entry["verdict"] == "fail"


# -- the runtime ----------------------------------------------------------------------------------------------


def test_the_prompt_holds_the_clips_soft_tokens(model, clips):
    boa, placeholder, eoa = model.audio.token_ids
    assert (boa, placeholder, eoa) == tuple(TINY_AUDIO_TOKENS)  # from the bundle's config
    messages = [user(sound(clips["long"]), "What is this?")]
    ids = model.prompt_ids(messages=messages)
    assert ids.count(placeholder) == 1  # the template renders one placeholder; the runtime expands it
    r = model.generate(messages=messages, max_tokens=1, temperature=0)
    tokens = model.engine.tokens
    keys = tokens[tokens.index(boa) + 1 : tokens.index(eoa)]
    assert len(keys) == audio.soft_tokens(round(SECONDS["long"] * audio.SAMPLE_RATE)) == 40
    assert all(k < 0 for k in keys) and placeholder not in tokens
    assert r.prompt_tokens == len(ids) + len(keys) + 1


def test_each_clip_runs_in_the_shortest_bucket_that_holds_it(model, clips):
    called, package = [], model.audio.packages["encode"]
    assert model.audio.packages["encode_144"] is package  # the executor holds every function of one package
    predict = package.predict
    package.predict = lambda f, x, s: called.append((f, x["input_features"].shape)) or predict(f, x, s)
    try:
        model.audio.cache.clear()
        model.audio.encode(clips["short"])
        model.audio.encode(clips["full"])
    finally:
        del package.predict
    assert called == [("encode_144", (1, 144, 128)), ("encode", (1, 240, 128))]
    assert audio_function(144, [144, 240]) == "encode_144"


def test_every_source_of_the_same_clip_gives_the_same_tokens(model, clips):
    """A path, its bytes, the samples, and an OpenAI input_audio part are one identity: the clip is encoded once and
    a second question about it reuses the caches up to its end."""
    path = clips["short"]
    samples, _ = soundfile.read(path, dtype="float32")
    model.audio.cache.clear()
    before = model.audio.encoded
    sources = [sound(str(path)), sound(path), sound(path.read_bytes()), sound(samples), input_audio(path)]
    keys = set()
    for part in sources:
        model.generate(messages=[user(part, "Hi")], max_tokens=1, temperature=0)
        keys.add(tuple(t for t in model.engine.tokens if t < 0))
    assert len(keys) == 1 and model.audio.encoded == before + 1


def test_a_follow_up_about_the_same_clip_reuses_it(model, clips):
    model.reset()
    before = model.audio.encoded
    first = [user(sound(clips["long"]), "What is this?")]
    a = model.generate(messages=first, max_tokens=4, temperature=0)
    follow = [*first, {"role": "assistant", "content": a.text}, user("And then?")]
    b = model.generate(messages=follow, max_tokens=4, temperature=0)
    assert model.audio.encoded == before + 1  # not encoded again
    assert b.reused_tokens >= a.prompt_tokens - 1  # the clip's positions are reused, not recomputed


def test_a_clip_in_another_format_and_rate_is_read(model, clips, tmp_path):
    """FLAC at 44.1 kHz, stereo: decoded, downmixed and resampled to the 16 kHz mono the encoder takes."""
    x = tone(1.0, 7)
    stereo = np.stack([x, 0.5 * x], axis=1)
    buf = io.BytesIO()
    import soxr

    soundfile.write(buf, soxr.resample(stereo, 16000, 44100), 44100, format="FLAC")
    r = model.generate(messages=[user(input_audio_of(buf.getvalue(), "flac"), "Hi")], max_tokens=1, temperature=0)
    assert r.prompt_tokens > 25


def test_bad_audio_input_is_one_line_and_nothing_reaches_the_chunks(model, clips, tmp_path):
    (tmp_path / "not.wav").write_text("hello")
    bad = {
        "no source": ({"type": "audio"}, "an audio part needs 'audio'"),
        "not audio": (sound(tmp_path / "not.wav"), "not.wav: not audio"),
        "missing": (sound(tmp_path / "nowhere.wav"), "nowhere.wav: No such file"),
        "format": (input_audio_of(b"RIFF", "aiff"), "input_audio.format: 'aiff' is not one of"),
        "silent": (sound(np.zeros(16000, np.float32)), "silent"),
        "too long": (sound(clips["too long"]), r"3.00 s long; this bundle's audio model takes clips of up to 2.41 s"),
    }
    model.audio.cache.clear()
    model.reset()
    before = (model.audio.encoded, list(model.engine.tokens))
    for part, needle in bad.values():
        # a good clip first: every part is checked before any is encoded, and nothing is fed to the chunks
        with pytest.raises(AudioError, match=needle) as e:
            model.generate(messages=[user(sound(clips["short"]), part, "Hi")], max_tokens=1)
        assert "\n" not in str(e.value)
        assert "messages[0].content[1]" in str(e.value) or "content[1]" in str(e.value)
        assert (model.audio.encoded, list(model.engine.tokens)) == before


def test_a_bundle_without_audio_says_so(audio_bundle, clips):
    text_only = load(audio_bundle, backend="mil")
    text_only.audio = None  # what load leaves when model_config.json states no audio model
    with pytest.raises(AudioError, match=r"messages\[0\].content\[0\]: this bundle has no audio model") as e:
        text_only.generate(messages=[user(sound(clips["short"]), "Hi")], max_tokens=1)
    assert "\n" not in str(e.value)


def test_load_opens_the_audio_model_only_when_the_config_states_one(audio_bundle):
    from gemma_ane.bundle import Bundle, BundleConfig
    from gemma_ane.runtime.device import Device
    from gemma_ane.runtime.encoder import open_audio_encoder

    def stated(config):
        return Bundle(audio_bundle, BundleConfig.of(config, "model_config.json"), [])

    config = read_model_config(audio_bundle)
    assert open_audio_encoder(stated({k: v for k, v in config.items() if k != "audio"}), Device.of("mil")) is None
    wrong = {**config, "audio": {**config["audio"], "buckets": [96, 240]}}
    with pytest.raises(Exception, match="has no function 'encode_96' taking \\(1, 96, 128\\)"):
        open_audio_encoder(stated(wrong), Device.of("mil"))


def test_model_card_names_the_audio_model(audio_bundle):
    card = (audio_bundle / "README.md").read_text()
    assert "| `audio` | audio tower |" in card and "buckets of up to 1, 2 s, fp16 weights" in card
    manifest = json.loads((audio_bundle / "manifest.json").read_text())
    assert set(manifest["audio"]["functions"]) == {"encode_144", "encode"}

"""Audio through `/v1/chat/completions`: OpenAI's input_audio parts, decoded and bounded by the server before they
queue, and what reaches the runtime. In-process (Starlette's TestClient) over test_server's scripted FakeModel,
given an `audio` attribute as an audio bundle's Model has; then end to end on conftest's `audio_bundle`."""

from __future__ import annotations

import base64
import io
import types

import numpy as np
import pytest
import soundfile
from test_server import CHAT, THOUGHT, FakeModel, assert_openai_error
from test_server_images import serving

from gemma_ane.runtime import audio
from gemma_ane.server.media import TEXT_BODY, ImageLimits, audio_limit

HEARS = types.SimpleNamespace(max_seconds=30.0)  # stands for the bundle's AudioEncoder: its longest clip


def tone(seconds: float, rate: int = audio.SAMPLE_RATE, channels: int = 1, seed: int = 0) -> np.ndarray:
    n = round(seconds * rate)
    t = np.arange(n) / rate
    x = 0.4 * np.sin(2 * np.pi * (220 + 200 * seed) * t) + 0.05 * np.random.default_rng(seed).standard_normal(n)
    return np.repeat(x[:, None], channels, axis=1).astype(np.float32)


def wav(seconds: float, rate: int = audio.SAMPLE_RATE, channels: int = 1, subtype="PCM_16", seed: int = 0) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, tone(seconds, rate, channels, seed), rate, format="WAV", subtype=subtype)
    return out.getvalue()


def part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def fake(hears=HEARS) -> FakeModel:
    model = FakeModel(THOUGHT)
    model.audio = hears
    model.context = 4096  # room for four 30 s clips (750 soft tokens each) and the text
    return model


def ask(http, *parts, role="user"):
    return http.post(CHAT, json={"messages": [{"role": role, "content": list(parts)}]})


CLIP = wav(0.5)


def test_input_audio_parts_reach_the_model_as_decoded_samples_in_place():
    other = wav(0.3, rate=44_100, channels=2, seed=1)
    model = fake()
    with serving(model) as http:
        r = ask(http, text("compare"), part(CLIP), text("and"), part(other, "wav"))
    assert r.status_code == 200, r.text
    [content] = [m["content"] for m in model.calls[0]["messages"]]
    assert [p["type"] for p in content] == ["text", "audio", "text", "audio"]
    # the runtime's own reading of the files: resampled, downmixed, as a path or bytes would be
    np.testing.assert_array_equal(content[1]["audio"], audio.load_audio(CLIP))
    np.testing.assert_array_equal(content[3]["audio"], audio.load_audio(other))


AT = "messages[0].content[1]"
SILENT = io.BytesIO()
soundfile.write(SILENT, np.zeros(8000, np.float32), audio.SAMPLE_RATE, format="WAV")
WAVE = b"RIFF\0\0\0\0WAVE"  # a WAV's first bytes, so that the size is what is refused
BAD = {
    # name: (part, status, param, code, a phrase of the message)
    "not audio": (part(b"hello, not a sound file"), 400, AT, None, "not audio"),
    "format": (part(CLIP, "aiff"), 400, AT, None, "input_audio.format: 'aiff' is not one of"),
    "no format": ({"type": "input_audio", "input_audio": {"data": "AAAA"}}, 400, AT, None, ".format: None"),
    "base64": ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, 400, AT, None, "base64"),
    "no object": ({"type": "input_audio", "input_audio": "AAAA"}, 400, AT, None, "expected an object"),
    "no data": ({"type": "input_audio", "input_audio": {"format": "wav"}}, 400, AT, None, ".data: expected"),
    "silent": (part(SILENT.getvalue()), 400, AT, None, "silent"),
    "too long": (part(wav(31.0, rate=8000)), 400, AT, None, "31.0 s long; the limit is 30 s"),
    "too many bytes": (part(WAVE + bytes(audio_limit(fake()))), 413, AT, "audio_too_large", "bytes, more than"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_audio_is_refused_naming_the_part_before_it_queues(name):
    bad, status, param, code, phrase = BAD[name]
    model = fake()
    with serving(model) as http:
        r = ask(http, part(CLIP), bad, text("what is it?"))
    err = assert_openai_error(r, status, param, code)
    assert phrase in err["message"] and "\n" not in err["message"], err
    assert model.calls == []


def test_the_duration_limit_is_the_bundles_largest_bucket():
    model = fake(types.SimpleNamespace(max_seconds=2.41))
    with serving(model) as http:
        assert ask(http, text("a"), part(wav(2.4))).status_code == 200
        err = assert_openai_error(ask(http, text("a"), part(wav(2.5))), 400, AT)
    assert "2.5 s long; the limit is 2.41 s" in err["message"]


def test_a_bundle_without_audio_says_so():
    model = fake(hears=None)
    with serving(model) as http:
        err = assert_openai_error(ask(http, text("a"), part(CLIP)), 400, AT)
    assert err["message"] == f"{AT}: this bundle has no audio model (converted without one)"


def test_where_and_how_many_clips():
    model = fake()
    with serving(model) as http:
        err = assert_openai_error(ask(http, part(CLIP), role="system"), 400, "messages[0].content[0]")
        assert "a leading system message cannot hold audio" in err["message"]
        err = assert_openai_error(ask(http, *[part(CLIP)] * 5), 400, "messages")
        assert "5 audio clips, more than the 4" in err["message"]
    assert model.calls == []


def test_the_body_limit_has_room_for_the_clips_and_only_for_them():
    limits = ImageLimits()
    assert limits.max_body(fake(hears=None)) == TEXT_BODY  # a text bundle admits no more than text
    assert limits.max_body(fake()) == TEXT_BODY + 4 * 4 * -(-audio_limit(fake()) // 3)
    big = wav(3.0, rate=48_000, channels=2, subtype="FLOAT")  # 1.15 MB, 1.5 MB as base64: more than TEXT_BODY
    assert len(base64.b64encode(big)) > TEXT_BODY
    model = fake()
    with serving(model) as http:
        assert ask(http, text("a"), part(big)).status_code == 200
        # the allowance is for audio: as much text is refused
        r = ask(http, text("a" * len(base64.b64encode(big))))
        assert_openai_error(r, 413, None, "request_too_large")


# -- end to end on a bundle with an audio model --------------------------------------------------------------------


@pytest.mark.slow
def test_input_audio_through_the_server_equals_the_library_and_is_cached(audio_bundle, tmp_path):
    from gemma_ane import load

    model = load(audio_bundle, backend="mil")
    path = tmp_path / "clip.wav"
    path.write_bytes(wav(1.2, rate=22_050, seed=3))
    messages = [{"role": "user", "content": [{"type": "audio", "audio": str(path)}, text("What is it?")]}]
    expected = model.generate(messages=messages, max_tokens=4, temperature=0)
    model.reset()
    model.audio.cache.clear()
    before = model.audio.encoded
    body = {"messages": [{"role": "user", "content": [part(path.read_bytes()), text("What is it?")]}]}
    with serving(model) as http:
        for _ in range(2):  # the second request finds the clip's soft tokens cached by its content's hash
            r = http.post(CHAT, json={**body, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected.text
            assert r.json()["usage"]["prompt_tokens"] == expected.prompt_tokens
        assert model.audio.encoded == before + 1
        too_long = {"messages": [{"role": "user", "content": [text("a"), part(wav(2.6))]}]}
        err = assert_openai_error(http.post(CHAT, json=too_long), 400, AT)
        assert "2.6 s long; the limit is 2.41 s" in err["message"]
        model.audio = None  # what load leaves for a bundle converted without one
        err = assert_openai_error(http.post(CHAT, json=body), 400, "messages[0].content[0]")
        assert "this bundle has no audio model" in err["message"]


# -- the clips are decoded only for a request that fits (issue 43: decoded before the queue and context checks) ----


def watch_decoding(monkeypatch) -> list:
    from gemma_ane.server import media

    decoded, load = [], media.load_audio
    monkeypatch.setattr(media, "load_audio", lambda *a, **k: decoded.append(a[1]) or load(*a, **k))
    return decoded


def test_clips_past_the_context_are_refused_from_their_headers(monkeypatch):
    decoded = watch_decoding(monkeypatch)
    model = fake()
    model.context = 200  # a 3 s clip is 75 soft tokens: three fit, four do not
    with serving(model) as http:
        assert ask(http, text("a"), *[part(wav(3.0))] * 2).status_code == 200
        assert decoded == [AT, "messages[0].content[2]"]
        decoded.clear()
        r = ask(http, text("a"), *[part(wav(3.0, seed=k)) for k in range(4)])
    err = assert_openai_error(r, 400, "messages", "context_length_exceeded")
    assert "tokens (audio included), more than the model's context of 200" in err["message"]
    assert decoded == [] and len(model.calls) == 1


def test_a_full_queue_refuses_before_any_clip_is_decoded(monkeypatch):
    from gemma_ane.server.worker import Worker

    decoded = watch_decoding(monkeypatch)
    monkeypatch.setattr(Worker, "admit", lambda self: False)
    model = fake()
    with serving(model) as http:
        r = ask(http, text("a"), part(CLIP))
    assert_openai_error(r, 429, None, "queue_full")
    assert decoded == [] and model.calls == []

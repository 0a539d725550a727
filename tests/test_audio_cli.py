"""Sound prompts from the command line: `generate --audio FILE` (repeatable) and `chat`'s `/audio FILE`. Bad input
first, needing no bundle (a clip is read before the bundle loads); then, in-process on conftest's `audio_bundle`,
what the commands send equals the library's answer to the same clips."""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
import soundfile

import gemma_ane
from gemma_ane.cli import main
from gemma_ane.runtime import audio


def tone(seconds: float, seed: int = 0, rate: int = audio.SAMPLE_RATE) -> np.ndarray:
    n = round(seconds * rate)
    t = np.arange(n) / rate
    x = 0.4 * np.sin(2 * np.pi * (220 + 300 * seed) * t) + 0.05 * np.random.default_rng(seed).standard_normal(n)
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("cli_clips")
    paths = {"short": d / "short.wav", "long": d / "long.flac", "too long": d / "too_long.wav", "text": d / "t.wav"}
    soundfile.write(paths["short"], tone(0.7), audio.SAMPLE_RATE, subtype="PCM_16")
    soundfile.write(paths["long"], tone(1.5, 1, 44_100), 44_100, format="FLAC")
    soundfile.write(paths["too long"], tone(3.0, 2), audio.SAMPLE_RATE, subtype="PCM_16")
    paths["text"].write_text("not a sound")
    paths["fifo"] = d / "fifo.wav"  # issue 43: `generate --audio FIFO` waited for a writer forever
    os.mkfifo(paths["fifo"])
    return paths


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "--audio {d}/nowhere.wav: No such file or directory"),
        ("text", "--audio {d}/t.wav: not audio (WAV, FLAC, OGG or MP3, by its first bytes)"),
        ("fifo", "--audio {d}/fifo.wav: not a regular file (a FIFO)"),
        ("raw", "--audio: a raw prompt has no chat template to place the clip in; drop --raw"),
    ],
)
def test_generate_refuses_a_bad_clip_in_one_line_before_loading_anything(capsys, clips, case, needle):
    d = clips["short"].parent
    path = {"missing": d / "nowhere.wav", "raw": clips["short"]}.get(case) or clips[case]
    flags = ["--raw"] if case == "raw" else []
    # the bundle does not exist: the clip is refused first
    rc, out, err = run(capsys, "generate", str(d / "no-bundle"), "-p", "Hi", "--audio", str(path), *flags)
    assert rc == 2 and out == ""
    assert err.strip() == f"gemma-ane generate: error: {needle.format(d=d)}"


# -- on a bundle with an audio model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(audio_bundle):
    return gemma_ane.load(audio_bundle, backend="mil")


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def sound(path) -> dict:
    return {"type": "audio", "audio": str(path)}


@pytest.mark.slow
def test_generate_with_clips_answers_as_the_library(model, audio_bundle, clips, capsys, monkeypatch):
    monkeypatch.setattr(gemma_ane, "load", lambda bundle, **kw: model)
    messages = [user(sound(clips["short"]), sound(clips["long"]), "What are they?")]
    model.reset()
    expected = model.generate(messages=messages, max_tokens=4, temperature=0)
    model.reset()
    argv = ["generate", str(audio_bundle), "-p", "What are they?", "--max-tokens", "4", "--temperature", "0", "--json"]
    rc, out, err = run(capsys, *argv, "--audio", str(clips["short"]), "--audio", str(clips["long"]))
    assert rc == 0, err
    result = json.loads(out)
    assert (result["text"], result["prompt_tokens"]) == (expected.text, expected.prompt_tokens)
    # longer than the largest bucket: the runtime's one line, exit 2
    rc, out, err = run(capsys, *argv, "--audio", str(clips["too long"]))
    assert rc == 2 and "this bundle's audio model takes clips of up to 2.41 s" in err and err.count("\n") == 1


@pytest.mark.slow
def test_chat_sends_the_clip_with_the_next_message_and_goes_on_after_bad_ones(
    model, audio_bundle, clips, capsys, monkeypatch
):
    monkeypatch.setattr(gemma_ane, "load", lambda bundle, **kw: model)
    d = clips["short"].parent
    script = "\n".join(
        [
            f"/audio {d}/nowhere.wav",
            f"/audio {clips['text']}",
            f"/audio {clips['too long']}",
            "/audio",
            f"/audio {clips['short']}",
            "What is it?",
            "And again?",
        ]
    )
    model.reset()
    first = model.generate(messages=[user(sound(clips["short"]), "What is it?")], max_tokens=4, temperature=0)
    second = model.generate(
        messages=[
            user(sound(clips["short"]), "What is it?"),
            {"role": "assistant", "content": first.text},
            user("And again?"),
        ],
        max_tokens=4,
        temperature=0,
    )
    model.reset()
    monkeypatch.setattr(sys, "stdin", io.StringIO(script + "\n"))
    rc = main(["chat", str(audio_bundle), "--backend", "mil", "--temperature", "0", "--max-tokens", "4"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert [line for line in err.splitlines() if line.startswith("gemma-ane chat: error:")] == [
        f"gemma-ane chat: error: /audio {d}/nowhere.wav: No such file or directory",
        f"gemma-ane chat: error: /audio {clips['text']}: not audio (WAV, FLAC, OGG or MP3, by its first bytes)",
        f"gemma-ane chat: error: /audio {clips['too long']}: 3.0 s long; the limit is 2.41 s",
        "gemma-ane chat: error: usage: /audio FILE",
    ]
    # the answers as the library gives them (a random tiny model's text: any characters, newlines included)
    assert out == f"{first.text}\n{second.text}\n"  # stdout holds only the answers; the note is on stderr
    assert "(audio: 0.7 s, sent with your next message)" in err.splitlines()


@pytest.mark.slow
def test_chat_on_a_bundle_without_audio_says_so(model, audio_bundle, clips, capsys, monkeypatch):
    monkeypatch.setattr(gemma_ane, "load", lambda bundle, **kw: model)
    monkeypatch.setattr(model, "audio", None)  # what load leaves for a bundle converted without one
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"/audio {clips['short']}\n"))
    rc = main(["chat", str(audio_bundle), "--backend", "mil"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == ""
    no_model = "gemma-ane chat: error: /audio: this bundle has no audio model (converted without one)"
    assert err.splitlines()[1:] == [no_model]  # after the banner

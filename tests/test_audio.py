"""Host audio (audio.py) against transformers: log-mel features and masks bit for bit equal to
Gemma4AudioFeatureExtractor, soft-token counts equal to Gemma4Processor's, and every bad clip a one-line
AudioError naming it."""

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf  # the audio extra, in `all`: a missing install fails here rather than skipping
import soxr

from gemma_ane.runtime import audio
from gemma_ane.runtime.audio import AudioError

SR = audio.SAMPLE_RATE


@pytest.fixture(scope="module")
def extractor():
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    return Gemma4AudioFeatureExtractor()


def reference(extractor, x):
    """What the processor hands the model for one clip: the extractor called on a batch of one."""
    out = extractor([x], return_tensors="np")
    return out["input_features"][0], out["input_features_mask"][0]


def signals():
    rng = np.random.default_rng(0)
    t = np.arange(2 * SR) / SR
    chirp = 0.5 * np.sin(2 * np.pi * (100 * t + 900 * t**2))
    speechy = np.sin(2 * np.pi * 220 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.05 * rng.standard_normal(len(t))
    padded = np.concatenate([np.zeros(4000), 0.3 * np.sin(2 * np.pi * 1000 * t[:8000]), np.zeros(3000)])
    return {
        "tone 1 s (a multiple of the hop and of 128)": 0.5 * np.sin(2 * np.pi * 440 * t[:SR]).astype(np.float32),
        "chirp, 12345 samples": chirp[:12345],
        "noise, 4837 samples (float64)": rng.uniform(-1, 1, 4837),
        "silence around a tone": padded,
        "modulated tone with noise, 2 s": speechy.astype(np.float32),
        "161 samples (one frame)": rng.uniform(-0.1, 0.1, 161).astype(np.float32),
        "320 samples": rng.uniform(-0.1, 0.1, 320).astype(np.float32),
        "loud, 7001 samples": rng.uniform(-30, 30, 7001).astype(np.float32),
        "30 s (the limit)": np.tile(chirp.astype(np.float32), 15),
    }


@pytest.mark.parametrize("name", list(signals()))
def test_log_mel_equals_transformers_bit_for_bit(extractor, name):
    x = signals()[name]
    want, want_mask = reference(extractor, x)
    got, mask = audio.log_mel(x)
    assert got.dtype == np.float32 and mask.dtype == bool
    assert np.array_equal(mask, want_mask)
    assert np.array_equal(got, want), np.abs(got - want).max()
    assert not got[~mask].any()  # masked frames are zero, as the extractor leaves them
    assert mask.sum() == audio.num_frames(len(x))


def test_soft_tokens_equal_the_processors():
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    fe = Gemma4AudioFeatureExtractor()
    proc = SimpleNamespace(feature_extractor=fe, audio_seq_length=750, boa_token="[", audio_token="a", eoa_token="]")
    lengths = [*range(0, 1300, 7), 16000, 16001, 479_999, 480_000, 480_001, 600_000]
    for n in lengths:
        want = Gemma4Processor._compute_audio_num_tokens(proc, np.zeros(n), SR)
        assert audio.soft_tokens(n) == want, n
        if 0 < n <= 480_000:  # the count the processor's prompt expansion makes from the extractor's mask
            mask = fe([np.zeros(n)], return_tensors="np")["input_features_mask"]
            text = Gemma4Processor.replace_audio_token(proc, {"input_features_mask": mask}, 0)
            assert text.count("a") == want, n


def test_the_thirty_second_clip_makes_750_tokens():
    assert audio.soft_tokens(30 * SR) == 750
    assert audio.soft_tokens(10 * SR) == 250  # 40 ms a token


def wav(x, rate=SR, subtype="PCM_16", fmt="WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, subtype=subtype, format=fmt)
    return buf.getvalue()


def test_load_wav_int16_reads_as_librosa():
    x = (0.4 * np.sin(2 * np.pi * 300 * np.arange(8000) / SR)).astype(np.float32)
    got = audio.load_audio(wav(x))
    want = np.round(x * 32767) / 32768  # soundfile scales int16 by 1/32768
    assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-4


def test_stereo_is_downmixed_to_the_mean(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.uniform(-0.5, 0.5, (4000, 2)).astype(np.float32)
    path = tmp_path / "stereo.flac"
    sf.write(path, x, SR, subtype="PCM_24")
    got = audio.load_audio(path)
    assert got.shape == (4000,)
    assert np.abs(got - x.mean(axis=1)).max() < 1e-6


def test_another_rate_is_resampled_with_soxr():
    x = (0.3 * np.sin(2 * np.pi * 500 * np.arange(44100) / 44100)).astype(np.float32)
    got = audio.load_audio(wav(x, 44100, "FLOAT"))
    assert len(got) == SR
    assert np.array_equal(got, soxr.resample(x, 44100, SR, quality="HQ"))


def test_float_array_input_is_taken_as_16k_mono():
    x = np.full(400, 0.25)
    assert np.array_equal(audio.load_audio(x), x.astype(np.float32))
    with pytest.raises(AudioError, match=r"^audio: expected 1-D float samples at 16 kHz, got int64 of shape"):
        audio.load_audio(np.ones((400,), np.int64))


def one_line(match):
    return pytest.raises(AudioError, match=match)


def test_bad_clips_are_one_line_errors(tmp_path):
    tone = (0.3 * np.sin(np.arange(SR) / 5)).astype(np.float32)
    bad = tmp_path / "notes.wav"
    bad.write_text("not a sound at all")
    cases = [
        (lambda: audio.load_audio(bad), rf"^audio {bad}: not audio \(WAV, FLAC, OGG or MP3, by its first bytes\)$"),
        (lambda: audio.load_audio(tmp_path / "gone.wav"), rf"^audio {tmp_path}/gone.wav: No such file or directory$"),
        (lambda: audio.load_audio(tmp_path), rf"^audio {tmp_path}: Is a directory$"),
        (lambda: audio.load_audio(b"RIFF....WAVEfmt "), r"^audio: not audio"),
        (
            lambda: audio.load_audio(wav(np.tile(tone, 3)), max_seconds=2.5),
            r"^audio: 3\.0 s long; the limit is 2\.5 s$",
        ),
        (lambda: audio.load_audio(np.zeros(8000, np.float32)), r"^audio: silent \(peak amplitude 0, below one"),
        (lambda: audio.load_audio(wav(np.full(8000, 1e-6))), r"^audio: silent"),  # rounds to 0 in 16 bits
        (lambda: audio.load_audio(wav(tone[:100])), r"^audio: 100 samples at 16 kHz; at least 161 \(10 ms\)"),
        (lambda: audio.load_audio(np.r_[tone, np.nan]), r"^audio: NaN or infinite samples$"),
        (lambda: audio.load_audio(wav(np.r_[tone, np.inf], subtype="FLOAT")), r"^audio: NaN or infinite samples$"),
        (lambda: audio.load_audio(3.5), r"^audio: expected a path, bytes or a numpy array, not float$"),
        (lambda: audio.load_audio(np.zeros(31 * SR, np.float32) + 0.1), r"^audio: 31\.0 s long; the limit is 30 s$"),
    ]
    for call, match in cases:
        with one_line(match) as e:
            call()
        assert "\n" not in str(e.value)


def test_too_long_is_refused_before_decoding(monkeypatch):
    data = wav(np.full(3 * SR, 0.1, np.float32))
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: pytest.fail("decoded a clip over the limit"))
    with one_line(r"^clip: 3\.0 s long; the limit is 1 s$"):
        audio.load_audio(data, "clip", max_seconds=1)


def test_input_audio():
    data = wav((0.3 * np.sin(np.arange(4000) / 3)).astype(np.float32))
    b64 = base64.b64encode(data).decode()
    assert audio.input_audio_bytes({"data": b64, "format": "wav"}) == data
    cases = [
        (lambda: audio.input_audio_bytes({"data": b64, "format": "aiff"}), r"^input_audio.format: 'aiff' is not one"),
        (lambda: audio.input_audio_bytes({"format": "wav"}), r"^input_audio.data: expected a base64 string, not None"),
        (
            lambda: audio.input_audio_bytes({"data": "%%", "format": "mp3"}),
            r"^input_audio.data: not valid base64 \(",
        ),
        (lambda: audio.input_audio_bytes("abc"), r"^input_audio: expected an object with data and format, not str$"),
    ]
    for call, match in cases:
        with one_line(match):
            call()


def test_preprocess_pads_to_the_bucket(extractor):
    x = signals()["chirp, 12345 samples"].astype(np.float32)
    want, want_mask = reference(extractor, x)
    p = audio.preprocess(x, frames=96)
    assert p.features.shape == (96, 128) and p.mask.shape == (96,)
    assert np.array_equal(p.features[: len(want)], want) and not p.features[len(want) :].any()
    assert np.array_equal(p.mask[: len(want)], want_mask) and not p.mask[len(want) :].any()
    assert p.soft_tokens == audio.soft_tokens(len(x)) == 20
    with one_line(r"^audio: 0\.77 s makes 77 mel frames; the encoder takes at most 76$"):
        audio.preprocess(x, frames=76)
    y = x[:12300]  # padded to 12416 samples: 77 frames, the last reaching into the padding (masked)
    want, want_mask = reference(extractor, y)
    assert len(want) == 77 and want_mask.sum() == 76
    exact = audio.preprocess(y, frames=76)  # the bucket holds the clip's frames, not the extractor's padding
    assert np.array_equal(exact.features, want[:76]) and exact.mask.all()


def test_mel_filters_equal_transformers(extractor):
    assert np.array_equal(audio.mel_filters(), extractor.mel_filters)
    assert np.array_equal(audio._window(), extractor.window)


def test_mp3_input_audio_decodes_and_resamples():
    """OpenAI clients send mp3 as often as wav: libsndfile (1.1+, in soundfile's wheels) reads it."""
    x = (0.3 * np.sin(np.arange(24000) / 7)).astype(np.float32)  # 1 s at 24 kHz
    data = wav(x, 24000, subtype="MPEG_LAYER_III", fmt="MP3")
    got = audio.load_audio(audio.input_audio_bytes({"data": base64.b64encode(data).decode(), "format": "mp3"}))
    assert abs(len(got) - SR) <= 1200  # the encoder's priming and padding frames (at most one MP3 frame)
    assert 0.25 < np.abs(got).max() < 0.4


# -- bounds from the header (issue 43: decompression bombs, formats, rates) ---------------------------------------


def encoded(x, rate, fmt, subtype=None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def no_decoding(monkeypatch):
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: pytest.fail("decoded a clip the header refuses"))


def test_a_many_channel_bomb_is_refused_from_its_header(monkeypatch):
    # 0.1 s of 255 nearly silent channels: 44 KB of Vorbis (30 s of it decoded to 1.4 GB before the header bound)
    bomb = encoded(np.full((4800, 255), 1e-4, np.float32), 48_000, "OGG", "VORBIS")
    assert len(bomb) < 100_000
    no_decoding(monkeypatch)
    with one_line(r"^clip: 255 channels; at most 8 are read$"):
        audio.load_audio(bomb, "clip")
    with one_line(r"^clip: 255 channels; at most 8 are read$"):
        audio.probe_audio(bomb, "clip")


@pytest.mark.parametrize("rate", [1, 7_999, 192_001, 655_350])
def test_rates_outside_8k_to_192k_are_refused_before_decoding(monkeypatch, rate):
    # a 1 Hz WAV of 20 samples was the 30 s bucket (750 soft tokens); 655,350 Hz FLAC, 709 MB decoded
    data = encoded(np.full(20, 0.1, np.float32), rate, "WAV", "PCM_16")
    no_decoding(monkeypatch)
    with one_line(rf"^clip: {rate} Hz; the sample rate must be 8000 to 192000 Hz$"):
        audio.load_audio(data, "clip")


@pytest.mark.parametrize("rate", [8_000, 192_000])
def test_the_rate_bounds_are_read(rate):
    x = (0.3 * np.sin(np.arange(rate // 10) / 5)).astype(np.float32)
    assert np.array_equal(audio.load_audio(encoded(x, rate, "WAV", "FLOAT")), soxr.resample(x, rate, SR, "HQ"))


def test_a_big_clip_within_the_bounds_never_holds_its_channels():
    """8 channels at 192 kHz, 10 s: 61 MB as float32 with every channel, a FLAC of a few hundred KB. Decoded block
    by block and downmixed as it comes, the traced peak is the mono clip at its own rate and little more."""
    import tracemalloc

    rate, seconds = 192_000, 10
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", rate, 8, format="FLAC", subtype="PCM_16") as f:
        second = np.full((rate, 8), 0.01, np.float32)  # a constant: not silent, nearly free to compress
        for _ in range(seconds):
            f.write(second)
    bomb = buf.getvalue()
    assert len(bomb) < 2_000_000
    mono = rate * seconds * 4
    tracemalloc.start()
    try:
        x = audio.load_audio(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(x) == seconds * SR
    assert peak < 1.25 * mono + 2 * audio.BLOCK_FRAMES * 8 * 4, (peak, mono)  # all channels: 8 * mono


def test_the_blockwise_downmix_is_the_whole_clips_mean_bit_for_bit(monkeypatch):
    rng = np.random.default_rng(3)
    x = rng.uniform(-0.5, 0.5, (10_007, 5)).astype(np.float32)
    data = encoded(x, 44_100, "WAV", "FLOAT")
    monkeypatch.setattr(audio, "BLOCK_FRAMES", 1000)  # eleven blocks, the last one short
    want = soxr.resample(x.mean(axis=1, dtype=np.float32), 44_100, SR, quality="HQ")
    assert np.array_equal(audio.load_audio(data), want)


@pytest.mark.parametrize(
    "fmt, subtype", [("AIFF", "PCM_16"), ("AU", "PCM_16"), ("CAF", "PCM_16"), ("W64", "PCM_16"), ("RF64", "PCM_16")]
)
def test_other_containers_never_reach_libsndfile(monkeypatch, fmt, subtype):
    data = encoded(np.full(4000, 0.1, np.float32), SR, fmt, subtype)
    monkeypatch.setattr(sf, "SoundFile", lambda *a, **k: pytest.fail(f"libsndfile parsed {fmt}"))
    with one_line(r"^clip: not audio \(WAV, FLAC, OGG or MP3, by its first bytes\)$"):
        audio.load_audio(data, "clip")


def test_only_the_plain_encodings_of_the_four_are_decoded(monkeypatch):
    data = encoded(np.full(4000, 0.1, np.float32), SR, "WAV", "IMA_ADPCM")
    no_decoding(monkeypatch)
    with one_line(r"^clip: WAV \(IMA_ADPCM\) is not among the formats read \(WAV, FLAC, OGG Vorbis or Opus, MP3\)$"):
        audio.load_audio(data, "clip")


def test_input_audio_format_must_agree_with_the_bytes():
    tone = (0.3 * np.sin(np.arange(4000) / 3)).astype(np.float32)
    flac = base64.b64encode(encoded(tone, SR, "FLAC")).decode()
    aiff = base64.b64encode(encoded(tone, SR, "AIFF", "PCM_16")).decode()
    assert audio.input_audio_bytes({"data": flac, "format": "flac"})[:4] == b"fLaC"
    with one_line(r"^input_audio.format: 'wav', but the data is FLAC$"):
        audio.input_audio_bytes({"data": flac, "format": "wav"})
    with one_line(r"^input_audio.data: not audio \(WAV, FLAC, OGG or MP3, by its first bytes\)$"):
        audio.input_audio_bytes({"data": aiff, "format": "wav"})


def test_the_header_states_the_soft_tokens_before_decoding(monkeypatch):
    for rate, n in ((SR, 16_000), (44_100, 44_100 * 3 + 7), (22_050, 12_345)):
        data = encoded(np.full(n, 0.1, np.float32), rate, "WAV", "PCM_16")
        want = audio.soft_tokens(len(audio.load_audio(data)))
        with monkeypatch.context() as m:
            no_decoding(m)
            header = audio.probe_audio(data)
        assert (header.kind, header.rate, header.channels, header.frames) == ("wav", rate, 1, n)
        assert header.soft_tokens == want


def test_a_path_must_be_a_regular_file(tmp_path):
    """A FIFO is refused without waiting for a writer (issue 43: `generate --audio FIFO` hung); a device too."""
    import os
    import threading

    fifo = tmp_path / "clip.wav"
    os.mkfifo(fifo)
    # should the reader block, a writer opens (and closes) the FIFO after a while: the test fails, never hangs
    rescue = threading.Timer(10, lambda: open(fifo, "wb").close())
    rescue.start()
    try:
        with one_line(rf"^--audio {fifo}: not a regular file \(a FIFO\)$"):
            audio.load_audio(fifo, "--audio")
    finally:
        rescue.cancel()
    with one_line(r"^--audio /dev/zero: not a regular file \(a character device\)$"):
        audio.load_audio("/dev/zero", "--audio")

"""Audio input on the host: decoding (soundfile), resampling (soxr) and Gemma 4's log-mel features (numpy),
equal to transformers' `Gemma4AudioFeatureExtractor` bit for bit; every bad input is a one-line AudioError.

Runtime side: numpy, soundfile and soxr only, the last two imported on first use (the `audio` extra). The module
has images.py's shape: `load_audio` turns a source into a decoded signal or a one-line error, `preprocess` into
the audio encoder's fixed-shape inputs and the number of soft tokens its placeholder expands to in the prompt.

What `load_audio` does with awkward input:
- formats: WAV (PCM, float, u-law, A-law), FLAC, OGG (Vorbis, Opus) and MP3, decided by the file's first bytes
  (`container`) before libsndfile sees it, and libsndfile's reading of the header must agree (its format and
  encoding among those): every other parser of that C library (AIFF, CAF, W64, RF64, ADPCM, ...) stays out of
  reach. Anything else is "not audio".
- the header bounds the work before any sample is decoded (`Header`): at most 8 channels (7.1), a rate of
  8 kHz to 192 kHz (below, 750 soft tokens from a few bytes; above, no recording), at most `max_seconds`.
- several channels: downmixed, the mean of the channels, as `librosa.load(mono=True)`, block by block while
  decoding, so the clip is never held with all its channels: the peak is the mono clip at its own rate (at most
  23 MB: 30 s at 192 kHz in float32) and one block.
- another sample rate: resampled to 16 kHz by soxr at its default (HQ) quality, as `librosa.load(sr=16000)`
  does (its default resampler is soxr_hq).
- integer PCM: read as float32 in [-1, 1) (int16 / 32768), as librosa reads it through soundfile.
- too long: refused above `max_seconds` (30 s by default), checked from the header before decoding (no more
  than the header's frames are read). transformers' extractor instead truncates silently at 30 s (its
  max_length of 480,000 samples), and 30 s is also its processor's cap of 750 soft tokens.
- a path: a regular file of at most MAX_FILE_BYTES (a FIFO or a device is refused, never waited on or read).
- too short: a clip needs 161 samples (10 ms) for one mel frame, and so one soft token; shorter is refused.
- silent: a clip whose peak is below one 16-bit step (2^-15) is refused: the encoder would see only the log of
  the mel floor, and the model would be asked about nothing.
- NaN or infinite samples (float files): refused.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import os
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..files import open_regular

SAMPLE_RATE = 16_000
FRAME_LENGTH = 320  # 20 ms analysis window
HOP_LENGTH = 160  # 10 ms between frames
FFT_LENGTH = 512  # the next power of two
MEL_BINS = 128
MIN_FREQUENCY, MAX_FREQUENCY = 0.0, 8000.0
MEL_FLOOR = 1e-3  # added before the log
PAD_MULTIPLE = 128  # the extractor pads each clip's samples to a multiple of this (its pad_to_multiple_of)
MAX_SECONDS = 30.0
MAX_SOFT_TOKENS = 750  # the processor's audio_seq_length: 30 s at 40 ms a token
SUBSAMPLING_LAYERS = 2  # the encoder's stride-2 convolutions over time (kernel 3, padding 1)
SILENCE = 2.0**-15  # one step of 16-bit PCM
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")  # OpenAI's `input_audio.format` names (wav and mp3) and more
# What libsndfile may make of each container (its major format, then its encodings): the header it parsed must
# agree with the first bytes, and only these decoders run.
DECODERS = {
    "wav": ({"WAV", "WAVEX"}, {"PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE", "ULAW", "ALAW"}),
    "flac": ({"FLAC"}, {"PCM_S8", "PCM_16", "PCM_24"}),
    "ogg": ({"OGG"}, {"VORBIS", "OPUS"}),
    "mp3": ({"MP3"}, {"MPEG_LAYER_I", "MPEG_LAYER_II", "MPEG_LAYER_III"}),
}
MIN_RATE, MAX_RATE = 8_000, 192_000  # telephone speech to the highest studio rate
MAX_CHANNELS = 8  # 7.1 surround
BLOCK_FRAMES = 1 << 15  # decoded at a time: 1 MiB at 8 channels
# a local file: the longest clip at the limits, 64-bit samples, with room for a header and metadata
MAX_FILE_BYTES = int(MAX_SECONDS * MAX_RATE) * MAX_CHANNELS * 8 + (1 << 20)


class AudioError(InputError):
    """Audio that cannot be used; the message names the clip and the problem, on one line."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _soundfile():
    try:
        import soundfile
    except ImportError:
        raise AudioError("audio input needs soundfile and soxr: pip install 'gemma-ane[audio]'") from None
    return soundfile


def _resample(x: np.ndarray, rate: int) -> np.ndarray:
    try:
        import soxr
    except ImportError:
        raise AudioError("audio input needs soundfile and soxr: pip install 'gemma-ane[audio]'") from None
    return soxr.resample(x, rate, SAMPLE_RATE, quality="HQ").astype(np.float32, copy=False)


def container(head: bytes) -> str | None:
    """The audio container a file's first 12 bytes announce ("wav", "flac", "ogg", "mp3"), or None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    # an ID3 tag, or an MPEG audio frame: 11 sync bits, then a version and a layer that are not reserved
    if head[:3] == b"ID3" or len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06:
        return "mp3"
    return None


@dataclass(frozen=True)
class Header:
    """What a clip's header states, within the bounds (the module doc): its container, rate, channels, frames."""

    kind: str
    rate: int
    channels: int
    frames: int

    @property
    def samples(self) -> int:
        """Samples at 16 kHz once resampled, never more than soxr makes (it rounds; this floors)."""
        return self.frames * SAMPLE_RATE // self.rate

    @property
    def soft_tokens(self) -> int:
        """The clip's soft tokens as its header states it: what a prompt's length is checked with before the clip
        is decoded (a damaged header may state more than the data holds, never a longer clip than is decoded)."""
        return soft_tokens(self.samples)


def probe_audio(src, what: str = "audio", max_seconds: float = MAX_SECONDS) -> Header:
    """The header of `src` (a path or a file's bytes), checked as load_audio checks it, without decoding a sample."""
    with _opened(src, what) as (f, name, kind):
        return _header(f, kind, name, max_seconds)


def load_audio(src, what: str = "audio", max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """`src` (a path, a file's bytes, or float samples already at 16 kHz mono) as float32 samples at 16 kHz,
    mono; the module doc says what happens to awkward input. Errors name `what`, and the path when there is one."""
    if isinstance(src, np.ndarray):
        if src.ndim != 1 or not np.issubdtype(src.dtype, np.floating):
            raise AudioError(f"{what}: expected 1-D float samples at 16 kHz, got {src.dtype} of shape {src.shape}")
        return _checked(src.astype(np.float32, copy=False), what, max_seconds)
    with _opened(src, what) as (f, name, kind):
        header = _header(f, kind, name, max_seconds)
        x = _decode(f, header)
    if header.rate != SAMPLE_RATE and len(x):
        x = _resample(x, header.rate)
    return _checked(x, name, max_seconds)


class _opened:
    """`with _opened(src, what) as (soundfile, name, container)`: a path (a regular file, MAX_FILE_BYTES at most)
    or bytes opened by libsndfile once their first bytes name one of the four containers; libsndfile's errors,
    then and while decoding, as one-line AudioErrors naming the clip."""

    def __init__(self, src, what: str):
        is_path = isinstance(src, (str, os.PathLike))
        if not (is_path or isinstance(src, (bytes, bytearray, memoryview))):
            raise AudioError(f"{what}: expected a path, bytes or a numpy array, not {type(src).__name__}")
        self.name = f"{what} {os.fspath(src)}" if is_path else what
        self.fh = open_regular(src, MAX_FILE_BYTES, AudioError, self.name) if is_path else io.BytesIO(bytes(src))
        self.f = None

    def __enter__(self):
        sf = _soundfile()
        try:
            kind = container(self.fh.read(12))
            if kind is None:
                raise AudioError(f"{self.name}: not audio (WAV, FLAC, OGG or MP3, by its first bytes)")
            self.fh.seek(0)
            self.f = sf.SoundFile(self.fh)
        except AudioError:
            self.fh.close()
            raise
        except Exception as e:
            self.fh.close()
            raise self._error(e) from None
        return self.f, self.name, kind

    def __exit__(self, kind, e, tb):
        self.f.close()
        self.fh.close()
        if e is not None and not isinstance(e, AudioError) and isinstance(e, Exception):
            raise self._error(e) from None

    def _error(self, e: Exception) -> AudioError:
        if isinstance(e, _soundfile().LibsndfileError):
            return AudioError(f"{self.name}: not audio (or in a format libsndfile cannot read)")
        # corrupt data past a good header surfaces as RuntimeError, ValueError, ...
        return AudioError(f"{self.name}: corrupt ({type(e).__name__}: {_one_line(e)})")


def _header(f, kind: str, name: str, max_seconds: float) -> Header:
    formats, encodings = DECODERS[kind]
    if f.format not in formats or f.subtype not in encodings:
        found = f"{f.format} ({f.subtype})"
        raise AudioError(f"{name}: {found} is not among the formats read (WAV, FLAC, OGG Vorbis or Opus, MP3)")
    rate, channels, frames = f.samplerate, f.channels, f.frames
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(f"{name}: {rate} Hz; the sample rate must be {MIN_RATE} to {MAX_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"{name}: {channels} channels; at most {MAX_CHANNELS} are read")
    if frames / rate > max_seconds:
        raise AudioError(f"{name}: {frames / rate:.1f} s long; the limit is {max_seconds:g} s")
    return Header(kind, rate, channels, frames)


def _decode(f, header: Header) -> np.ndarray:
    """The clip as float32 mono at its own rate, decoded BLOCK_FRAMES at a time and each block downmixed into the
    clip as it comes (a row's mean does not depend on the rows beside it: the same bits as the whole clip's mean).
    soundfile reads no more of a seekable file than its header's frames, which _header bounded: the clip's buffer
    is allocated once, and a file shorter than its header says is cut where its data ends."""
    x = np.empty(header.frames, np.float32)
    block = np.empty((BLOCK_FRAMES, header.channels), np.float32)
    done = 0
    while done < header.frames:
        got = f.read(out=block)
        if not len(got):
            break
        np.mean(got, axis=1, dtype=np.float32, out=x[done : done + len(got)])
        done += len(got)
    return x[:done]


def _checked(x: np.ndarray, name: str, max_seconds: float) -> np.ndarray:
    if len(x) > max_seconds * SAMPLE_RATE:
        raise AudioError(f"{name}: {len(x) / SAMPLE_RATE:.1f} s long; the limit is {max_seconds:g} s")
    need = FRAME_LENGTH // 2 + 1
    if len(x) < need:
        raise AudioError(f"{name}: {len(x)} samples at 16 kHz; at least {need} (10 ms) make one soft token")
    if not np.isfinite(x).all():
        raise AudioError(f"{name}: NaN or infinite samples")
    peak = float(np.abs(x).max())
    if peak < SILENCE:
        raise AudioError(f"{name}: silent (peak amplitude {peak:.3g}, below one 16-bit step)")
    return x


def input_audio_bytes(part, what: str = "input_audio") -> bytes:
    """The bytes of an OpenAI `input_audio` content part's object, `{"data": BASE64, "format": "wav"}`. The
    format is checked against the names OpenAI uses, and must be the container the bytes begin with."""
    if not isinstance(part, dict):
        raise AudioError(f"{what}: expected an object with data and format, not {type(part).__name__}")
    data, fmt = part.get("data"), part.get("format")
    if not isinstance(data, str):
        raise AudioError(f"{what}.data: expected a base64 string, not {type(data).__name__}")
    if fmt not in INPUT_AUDIO_FORMATS:
        raise AudioError(f"{what}.format: {fmt!r} is not one of {', '.join(INPUT_AUDIO_FORMATS)}")
    out = _b64(data, f"{what}.data", "")
    kind = container(out[:12])
    if kind is None:
        raise AudioError(f"{what}.data: not audio (WAV, FLAC, OGG or MP3, by its first bytes)")
    if kind != fmt:
        raise AudioError(f"{what}.format: {fmt!r}, but the data is {kind.upper()}")
    return out


def _b64(data: str, what: str, subject: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise AudioError(f"{what}: {subject}not valid base64 ({_one_line(e)})") from None


# -- features ---------------------------------------------------------------------------------------------------


def _hz_to_mel(f):
    return 2595.0 * np.log10(1.0 + f / 700.0)  # HTK's mel scale


@functools.cache
def mel_filters() -> np.ndarray:
    """(257, 128) float64: transformers' `mel_filter_bank(257, 128, 0, 8000, 16000, norm=None, mel_scale="htk")`,
    triangles in Hz over mel-spaced centres, the same float64 arithmetic in the same order. The top filter falls
    between FFT bins and is all zero, as there."""
    mel = np.linspace(_hz_to_mel(MIN_FREQUENCY), _hz_to_mel(MAX_FREQUENCY), MEL_BINS + 2)
    centres = 700.0 * (np.power(10, mel / 2595.0) - 1.0)
    bins = np.linspace(0, SAMPLE_RATE // 2, FFT_LENGTH // 2 + 1)
    diff = np.diff(centres)
    slopes = np.expand_dims(centres, 0) - np.expand_dims(bins, 1)
    down, up = -slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


@functools.cache
def _window() -> np.ndarray:
    return np.hanning(FRAME_LENGTH + 1)[:-1].astype(np.float32)  # periodic Hann, in float32 as the extractor's


def num_frames(num_samples: int) -> int:
    """Valid mel frames of a clip: those whose analysis window (after the extractor's 160 leading zeros) ends
    inside the clip."""
    return max((num_samples + FRAME_LENGTH // 2 - (FRAME_LENGTH + 1)) // HOP_LENGTH + 1, 0)


def soft_tokens(num_samples: int) -> int:
    """Soft tokens a clip of `num_samples` (at 16 kHz) becomes: transformers' `_compute_audio_num_tokens`, which
    its `replace_audio_token` equals (valid mel frames, halved with rounding up by each stride-2 convolution),
    capped at 750."""
    t = num_frames(num_samples)
    for _ in range(SUBSAMPLING_LAYERS):
        t = (t - 1) // 2 + 1 if t > 0 else 0
    return min(t, MAX_SOFT_TOKENS)


def log_mel(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(features float32 (frames, 128), mask bool (frames,)) of one clip at 16 kHz: what transformers'
    extractor returns for it alone (`extractor([samples])`): samples rounded to float32, padded with zeros to a
    multiple of 128, 160 zeros prepended (semicausal), frames of 320 every 160 (the window reads 321 samples, the
    last only for the mask), periodic Hann, |rfft_512|, HTK mel, log(mel + 0.001); frames that reach into the
    padding masked and zeroed. Same operations and dtypes as there, so the same bits."""
    x = np.asarray(samples, dtype=np.float32)
    n = len(x)
    padded = -(-n // PAD_MULTIPLE) * PAD_MULTIPLE
    lead = FRAME_LENGTH // 2
    wave = np.zeros((1, lead + padded), np.float32)
    wave[0, lead : lead + n] = x
    count = (lead + padded - (FRAME_LENGTH + 1)) // HOP_LENGTH + 1
    if count <= 0:
        return np.zeros((0, MEL_BINS), np.float32), np.zeros(0, bool)
    frames = np.lib.stride_tricks.sliding_window_view(wave, FRAME_LENGTH + 1, axis=-1)[:, ::HOP_LENGTH][:, :count]
    frames = frames[..., :-1] * _window()
    spectrum = np.abs(np.fft.rfft(frames, n=FFT_LENGTH, axis=-1))
    log_spec = np.log(np.matmul(spectrum, mel_filters()) + np.array(MEL_FLOOR, dtype=np.float64))
    mask = np.arange(count) < num_frames(n)
    return log_spec[0].astype(np.float32) * mask[:, None], mask


@dataclass(frozen=True)
class Features:
    """One clip as the audio encoder takes it, padded to a fixed frame count (a bucket) so that one compiled model
    serves every clip up to the bucket's length.

    features: float32 (frames, 128) log-mel, zero in every frame that is not the clip's.
    mask: bool (frames,), True for the clip's frames (they come first).
    soft_tokens: the encoder's valid output rows for this clip: the prompt holds that many audio placeholders,
        between begin- and end-of-audio tokens.
    """

    features: np.ndarray
    mask: np.ndarray
    soft_tokens: int


def preprocess(src, frames: int | None = None, what: str = "audio", max_seconds: float = MAX_SECONDS) -> Features:
    """`src` (anything load_audio takes) as the encoder's inputs, padded to `frames` mel frames (None: the clip's
    own, rounded up as transformers pads); refused, naming the sizes, when the clip needs more frames."""
    x = load_audio(src, what, max_seconds)
    features, mask = log_mel(x)
    if frames is not None:  # the padding's frames past the bucket are masked zeros: dropping them changes nothing
        valid = num_frames(len(x))
        if valid > frames:
            raise AudioError(
                f"{what}: {len(x) / SAMPLE_RATE:.2f} s makes {valid} mel frames; the encoder takes at most {frames}"
            )
        features, mask = features[:frames], mask[:frames]
        features = np.concatenate([features, np.zeros((frames - len(features), MEL_BINS), np.float32)])
        mask = np.concatenate([mask, np.zeros(frames - len(mask), bool)])
    return Features(features, mask, soft_tokens(len(x)))

"""The audio model's conversion (the tower itself: models/audio.py): the checkpoint's audio spec and token ids, the
buckets, the `audio` package (one function per bucket) and its model_config.json entry.

Buckets: the tower is traced at a fixed number of mel frames, so a clip runs padded to the shortest bucket that
holds it. Its cost is linear in the frames (the attention is local: 12-frame blocks looking 12 frames back), so one
30 s bucket would make a 2 s question cost fifteen times its own length; buckets that about double (options.py's
AUDIO_BUCKET_SECONDS) keep the padding under half of what runs. They are functions of one package: their weights
are the same, and the merge stores them once.

Precision: the graph runs in fp16 throughout. Measured on the tiny tower through the MIL executor (fp16 between
ops): relative error 1.2e-3 .. 4.2e-3 against transformers in fp32, row cosine >= 0.99999
(tests/test_audio_mil.py), and the text rows of prompts built from its soft tokens meet the bounds of text prompts
(tests/test_audio_prompts.py). At 8 bits (the default) the tiny tower's soft tokens move 1.2% (relative), which
the random tiny text model turns into a text-row cosine of 0.977: the suite's bundle keeps the audio model at 16
bits, as its vision bundle does; E2B's own tower at 8 bits is not measured yet. The failure CoreML-LLM met
(RMSNorm without a scale giving zeros on the GPU) is the fp16 square of a wide row overflowing; ops.RMSNorm
scales the row before squaring, so embed_audio's scale-free norm stays in the graph.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..bundle import schema
from ..files import tree_size
from ..runtime.audio import SAMPLE_RATE, num_frames
from . import coreml
from .checkpoint import Checkpoint
from .models.audio import AudioSpec, AudioTowerError, bucket_frames, encode_io, load_audio_tower
from .options import ConvertError, ConvertOptions

# config.json's names of the audio tokens (begin, placeholder, end) and transformers' defaults, E2B's ids; the end
# token is `eoa_token_index` in transformers' Gemma4Config, and the Hub's configs state `eoa_token_id` too
TOKEN_FIELDS = (("boa_token_id", 256_000), ("audio_token_id", 258_881), ("eoa_token_id", 258_883))
TOWER_WEIGHT = "model.audio_tower.subsample_conv_projection.input_proj_linear.weight"


def read_config(root: str | Path) -> dict:
    try:
        return json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{Path(root) / 'config.json'}: {e}") from None


def token_ids(config: dict) -> tuple[int, int, int]:
    """(begin-of-audio, audio placeholder, end-of-audio) as config.json names them."""
    ids = [config.get(name, default) for name, default in TOKEN_FIELDS]
    ids[2] = config.get("eoa_token_id", config.get("eoa_token_index", ids[2]))
    return tuple(ids)


def buckets(spec: AudioSpec, seconds) -> list[int]:
    """The buckets, in mel frames, of clips of up to these durations: each the smallest multiple of 4 x chunk
    frames holding such a clip's frames (30 s at E2B's chunk of 12: 3024)."""
    return sorted({bucket_frames(num_frames(round(s * SAMPLE_RATE)), spec.chunk) for s in seconds})


def convert_audio(
    ckpt_root: str | Path,
    spec: AudioSpec,
    frames: list[int],
    options: ConvertOptions,
    out_dir: Path,
    timer,
    compile_: bool = False,
) -> Path:
    """OUT/audio.mlpackage: one function per bucket (schema.audio_function names it; `encode` the largest, the
    default), fp16 compute, palettized at options.bits; returns the package's path (the .mlmodelc with compile_)."""

    def traced():  # one bucket's model in memory at a time
        for F_ in frames:
            with timer("load"):
                model = load_audio_tower(ckpt, spec, F_)
            yield schema.audio_function(F_, frames), trace(model, timer)
            del model

    ckpt = Checkpoint(ckpt_root)
    ckpt.prefix = ""
    try:
        return coreml.save_functions(
            traced(), schema.audio_function(frames[-1], frames), schema.AUDIO, options, Path(out_dir), timer, compile_
        )
    except AudioTowerError as e:
        raise ConvertError(f"{ckpt_root}: {e}") from None
    finally:
        ckpt.close()


def trace(model, timer, precision: str = "fp16"):
    """One bucket's AudioModel as a MIL program through the toolkit (its function is named by its chunk)."""
    return coreml.trace_function(model, model.chunk, next(iter(model.chunk.functions)), timer, precision)


def convert_audio_tower(model, out: Path, precision: str = "fp16") -> Path:
    """OUT (an .mlpackage): one bucket's model alone, unpalettized, computed at `precision` (fp16: Core ML's, the
    ANE's; fp32 for reference); its function is `main`. Returns the path."""
    from .options import StageTimer

    timer = StageTimer()
    coreml.finish_function(trace(model, timer, precision), ConvertOptions(bits=16), {}, timer, package_dir=out)
    return Path(out)


@dataclass
class AudioComponent:
    """The audio tower, when the checkpoint has one the graph can express and the options want it (the published
    layout is text-only)."""

    root: Path
    options: ConvertOptions
    spec: AudioSpec
    token_ids: tuple[int, int, int]
    name = schema.AUDIO
    without = "--no-audio converts without the audio model"

    @classmethod
    def find(cls, options: ConvertOptions, root: Path) -> AudioComponent | None:
        if not options.audio or options.layout == "published":
            return None
        config = read_config(root)
        if not config.get("audio_config"):
            return None
        try:
            spec = AudioSpec.from_config(config)
        except AudioTowerError as e:  # e.g. a tower transformers itself cannot run: not asked for by name
            print(f"note: {root}: {e}; converting without the audio model")
            return None
        try:
            ckpt = Checkpoint(root)
        except (OSError, ValueError) as e:
            raise ConvertError(str(e).splitlines()[0]) from None
        ckpt.prefix = ""
        has_tower = TOWER_WEIGHT in ckpt
        ckpt.close()
        if not has_tower:  # an export that kept the multimodal config.json without the tower's weights
            print(f"note: {root}: config.json states an audio tower but the weights hold none; converting without it")
            return None
        return cls(root, options, spec, token_ids(config))

    @property
    def buckets(self) -> list[int]:
        return buckets(self.spec, self.options.audio_seconds)

    def config_entry(self) -> dict:
        return schema.AudioConfig.of(self.buckets, self.token_ids)

    def manifest_entry(self) -> dict:
        return encode_io(self.spec, self.buckets).to_json()

    def convert(self, out: Path, timer, compile_: bool) -> int:
        path = convert_audio(self.root, self.spec, self.buckets, self.options.audio_options, out, timer, compile_)
        return tree_size(path)

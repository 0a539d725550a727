"""model_config.json (CONTRACT §2): the one schema that writes it and reads it back.

The file's entries are typed records: the text model's (`TextConfig`), the drafter's (`AssistantConfig`), the
vision model's (`VisionConfig`) and the audio model's (`AudioConfig`), each built from its spec (`of`) and written
by `to_json`. Their `from_json` holds the rules, and `check_model_config` runs them on the file as written and as
read: the rules `load` applies when it reads the file are the rules a conversion must pass before anything is
written, so `convert` can never publish a bundle that `load` refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ..files import FileFormatError, read_json, read_json_object
from ..runtime.audio import MAX_SOFT_TOKENS, MEL_BINS, SAMPLE_RATE
from ..runtime.images import SOFT_TOKEN_BUDGETS
from .errors import BundleError
from .layout import MODEL_CONFIG, VISION_POSITION_TABLE
from .plan import MAX_DRAFT_TOKENS
from .spec import FULL, SLIDING

ASSISTANT, VISION, AUDIO = "assistant", "vision", "audio"  # the one-function models' entries


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    """The text model's fields, in the file's order: the checkpoint's shapes (a ModelSpec) and the chunk plan's,
    as the runtime and the published layout's readers expect them. The fields `load` may do without (optional in
    TEXT_FIELDS, or never read) are None when a bundle does not state them."""

    model_name: str | None = None
    architecture: str | None = None
    hidden_size: int
    num_hidden_layers: int
    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    global_head_dim: int | None = None
    vocab_size: int
    context_length: int | None = None
    contexts: list[int] | None = None  # a context ladder's rungs (bundle.ladder), the last context_length
    sliding_window: int | None = None
    per_layer_dim: int
    num_kv_shared_layers: int | None = None
    layer_types: list[str] | None = None
    embed_scale: float
    per_layer_embed_scale: float
    per_layer_model_projection_scale: float | None = None
    per_layer_input_scale: float | None = None
    rms_norm_eps: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    final_logit_softcapping: float | None = None
    quantization: str | None = None
    compute_units: str | None = None
    prefill_batch: int | None = None
    split: list[int] | None = None
    head: str | None = None
    chunks: list[dict] | None = None  # each chunk's role, for plans of other than three chunks (see `of`)
    weights: dict | None = None  # how linear weights were compressed, when not the default LUT (a record only)

    @classmethod
    def of(cls, spec, plan, bits: int, layout: str, name: str, weights: dict | None = None) -> TextConfig:
        """What a conversion of `spec` (a ModelSpec) by `plan` (a ChunkPlan) states. A plan of other than three
        chunks also states each chunk's role (`chunks`, ChunkPlan.describe); three chunks are the published
        layout's, whose readers know their roles, and their model_config.json stays byte for byte what it was."""
        return cls(
            model_name=name,
            architecture="gemma4",
            hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_layers,
            num_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.kv_heads[0],
            head_dim=spec.head_dim_of(SLIDING) if SLIDING in spec.layer_types else spec.head_dims[0],
            global_head_dim=spec.head_dim_of(FULL),
            vocab_size=spec.vocab_size,
            context_length=plan.context,
            contexts=list(plan.contexts) or None,
            sliding_window=plan.window,
            per_layer_dim=spec.per_layer_dim,
            num_kv_shared_layers=spec.num_kv_shared_layers,
            layer_types=list(spec.layer_types),
            embed_scale=spec.embed_scale,
            per_layer_embed_scale=spec.per_layer_embed_scale,
            per_layer_model_projection_scale=spec.hidden_size**-0.5,
            per_layer_input_scale=2**-0.5,
            rms_norm_eps=spec.rms_norm_eps,
            bos_token_id=spec.bos_token_id,
            eos_token_id=spec.eos_token_ids[0],
            final_logit_softcapping=spec.final_logit_softcapping,
            quantization="none" if bits == 16 else f"int{bits}",
            compute_units="CPU_AND_NE",
            prefill_batch=plan.prefill_batch,
            split=list(plan.split),
            head="token_id" if layout == "published" else "logits",
            chunks=plan.describe(bits) if len(plan.chunks) != 3 else None,
            weights=weights or None,
        )

    def to_json(self) -> dict:
        """The fields in order; one the reader may miss (optional in TEXT_FIELDS) is left out when None, since
        null is no value it accepts."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None or k not in TEXT_FIELDS}

    @classmethod
    def from_json(cls, config, where: str) -> TextConfig:
        """The text fields of a whole model_config.json, after TEXT_FIELDS' rules: a BundleError
        `where: field=value: expected ...` at the first field that breaks one."""
        if not isinstance(config, dict):
            raise BundleError(f"{where}: expected a JSON object, found {type(config).__name__}")
        for name, (required, what, ok) in TEXT_FIELDS.items():
            if name not in config:
                if required:
                    raise BundleError(f"{where}: {name}: missing")
            elif not ok(config[name]) or name.endswith("_token_id") and config[name] >= config["vocab_size"]:
                what += f" below vocab_size {config['vocab_size']}" if name.endswith("_token_id") else ""
                raise BundleError(f"{where}: {name}={_short(config[name])}: expected {what}")
        for name, (what, ok) in TEXT_RELATIONS.items():
            if name in config and not ok(config[name], config):
                what = what.format(**config)
                raise BundleError(f"{where}: {name}={_short(config[name])}: expected {what}")
        return cls(**{f.name: config.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class AssistantConfig:
    """`assistant`: what the runtime needs to drive the drafter's package and its head (from an AssistantSpec;
    `producers`: the target layer whose K/V each of its layer types reads). Every field is required."""

    draft_tokens: int
    hidden_size: int
    backbone_hidden_size: int
    num_centroids: int
    centroid_top_k: int
    producers: dict[str, int]

    @classmethod
    def of(cls, spec, draft_tokens: int, producers: dict[str, int]) -> AssistantConfig:
        return cls(
            draft_tokens,
            spec.hidden_size,
            spec.backbone_hidden_size,
            spec.num_centroids,
            spec.centroid_top_k,
            producers,
        )

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, config: dict, where: str) -> AssistantConfig:
        """config["assistant"] after ASSISTANT_FIELDS' rules (which read the text fields of `config` too)."""
        return cls(**_check_entry(where, config, ASSISTANT, ASSISTANT_FIELDS))


VISION_TOKEN_IDS = ("boi_token_id", "image_token_id", "eoi_token_id")


@dataclass(frozen=True)
class VisionConfig:
    """`vision`: what the host needs to preprocess an image and build `encode`'s inputs (from a VisionSpec).
    Every field is required."""

    image_tokens: int
    patch_size: int
    pooling_kernel_size: int
    head_dim: int
    rope_theta: float
    position_table: str
    boi_token_id: int
    image_token_id: int
    eoi_token_id: int

    @classmethod
    def of(cls, spec, image_tokens: int) -> VisionConfig:
        return cls(
            image_tokens,
            spec.patch_size,
            spec.pooling_kernel_size,
            spec.head_dim,
            spec.rope_theta,
            VISION_POSITION_TABLE,
            *spec.token_ids,
        )

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, config: dict, where: str) -> VisionConfig:
        """config["vision"] after VISION_FIELDS' rules (which read the text fields of `config` too)."""
        return cls(**_check_entry(where, config, VISION, VISION_FIELDS))


AUDIO_TOKEN_IDS = ("boa_token_id", "audio_token_id", "eoa_token_id")


@dataclass(frozen=True)
class AudioConfig:
    """`audio`: what the host needs to turn a clip into the audio model's inputs: the buckets (mel frames per clip,
    ascending; each one function of the package, `audio_function`), the features' shape and rate, and the
    begin/placeholder/end token ids. Every field is required."""

    buckets: list[int]
    mel_bins: int
    sample_rate: int
    boa_token_id: int
    audio_token_id: int
    eoa_token_id: int

    @classmethod
    def of(cls, buckets, token_ids) -> AudioConfig:
        return cls(sorted(buckets), MEL_BINS, SAMPLE_RATE, *token_ids)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, config: dict, where: str) -> AudioConfig:
        """config["audio"] after AUDIO_FIELDS' rules (which read the text fields of `config` too)."""
        return cls(**_check_entry(where, config, AUDIO, AUDIO_FIELDS))


def audio_function(frames: int, buckets) -> str:
    """The audio model's function for the bucket of `frames` mel frames: `encode` for the largest (the one every
    clip the bundle takes fits), `encode_{frames}` for the shorter ones."""
    return "encode" if frames == max(buckets) else f"encode_{frames}"


@dataclass(frozen=True)
class WeightsConfig:
    """`weights`: how the chunks' linear weights were compressed, stated when it is not the default (a k-means LUT
    per group of output rows, nothing kept at fp16). For the record: the chunks carry their weights' format, and
    the runtime reads none of it. Every field is required."""

    quant: str
    bits: int
    group_size: int
    group_axis: str
    keep: list[str]

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


ENTRIES = {ASSISTANT: AssistantConfig, VISION: VisionConfig, AUDIO: AudioConfig}  # the one-function models' entries


def model_config(text: TextConfig, **entries) -> dict:
    """The whole file: the text entry, then each one-function model's entry (a record of ENTRIES) under its name.
    Unchecked: its writers check it (`check_model_config`) where they can name the file."""
    return {**text.to_json(), **{name: entry.to_json() for name, entry in entries.items()}}


# -- the rules, on write and on read ----------------------------------------------------------------------------


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(v) -> bool:
    return _integer(v) and v > 0


def is_token(v) -> bool:
    return _integer(v) and v >= 0


def _scale(v) -> bool:  # the host scales the int8 tables in fp32
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= np.finfo(np.float32).max


def _ascending(v) -> bool:
    return isinstance(v, list) and len(v) >= 1 and all(map(_positive, v)) and all(a < b for a, b in zip(v, v[1:]))


QUANTIZATIONS = {"none", "fp16", "float16", *(f"int{n}" for n in range(1, 9))}  # what converters have written

# A context past this is no bundle's (Gemma 4's longest is 2**17 positions): a cache of it would not fit in memory.
MAX_CONTEXT = 2**20


# the text fields the runtime reads: name -> (required, what it must be, test)
TEXT_FIELDS = {
    "vocab_size": (True, "a positive integer", _positive),
    "hidden_size": (True, "a positive integer", _positive),
    "num_hidden_layers": (True, "a positive integer", _positive),
    "per_layer_dim": (True, "a positive integer", _positive),
    "embed_scale": (True, "a positive fp32 number", _scale),
    "per_layer_embed_scale": (True, "a positive fp32 number", _scale),
    "bos_token_id": (False, "a token id", is_token),
    "eos_token_id": (False, "a token id", is_token),
    "layer_types": (False, "a list of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)),
    "sliding_window": (False, "a positive integer", _positive),  # the ring may be wider (spec.ring_slots)
    "context_length": (  # these four: the published plan's
        False,
        f"a positive integer, at most {MAX_CONTEXT}",
        lambda v: _positive(v) and v <= MAX_CONTEXT,
    ),
    "contexts": (
        False,
        f"ascending multiples of 32, at most {MAX_CONTEXT}",
        lambda v: _ascending(v) and len(v) >= 2 and v[-1] <= MAX_CONTEXT and all(c % 32 == 0 for c in v),
    ),
    "prefill_batch": (False, "a positive integer", _positive),
    "split": (False, "ascending layer indices", _ascending),
    "chunks": (
        False,
        "a list of chunk entries, one per chunk_N, each with its name",
        lambda v: isinstance(v, list) and len(v) >= 2 and all(isinstance(c, dict) and "name" in c for c in v),
    ),
    "head": (False, '"logits" or "token_id"', lambda v: v in ("logits", "token_id")),
    "weights": (
        False,
        "an object: quant, bits, group_size, group_axis, keep (how linear weights were compressed)",
        lambda v: (
            isinstance(v, dict)
            and set(WEIGHTS_FIELDS) <= v.keys()
            and all(ok(v[k]) for k, (_, ok) in WEIGHTS_FIELDS.items())
        ),
    ),
    # the chunks have these baked in; stated for the record, so a value no conversion writes is damage
    "rms_norm_eps": (False, "a positive fp32 number", _scale),
    # null: a checkpoint without one (a bundle converted before to_json left it out)
    "final_logit_softcapping": (False, "a positive fp32 number", lambda v: v is None or _scale(v)),
    "quantization": (
        False,
        '"none", "fp16" or "intN" (N bits, 1 to 8)',
        lambda v: isinstance(v, str) and v in QUANTIZATIONS,
    ),
}

# `weights` (WeightsConfig): name -> (what it must be, test); what `convert --quant/--bits/--group-size/--keep` wrote
WEIGHTS_FIELDS = {
    "quant": (
        '"lut" (a k-means LUT per group_size output rows) or "block" (one scale per group_size inputs)',
        lambda v: v in ("lut", "block"),
    ),
    "bits": ("an integer from 1 to 16", lambda v: _integer(v) and 1 <= v <= 16),
    "group_size": ("a positive integer", _positive),
    "group_axis": ('"output" (lut) or "input" (block)', lambda v: v in ("output", "input")),
    "keep": (
        "a list of regular expressions (weights they match stay fp16)",
        lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
    ),
}

# the text fields whose rule reads another (checked after TEXT_FIELDS', so that one is sound): name -> (what it
# must be, test of the value given the whole config)
TEXT_RELATIONS = {
    "layer_types": (
        "one per layer, as many as num_hidden_layers {num_hidden_layers}",
        lambda v, c: len(v) == c["num_hidden_layers"],
    ),
    "split": (
        "boundaries up to num_hidden_layers {num_hidden_layers}",
        lambda v, c: v[-1] <= c["num_hidden_layers"],
    ),
    "contexts": (
        "rungs whose largest is the context_length",
        lambda v, c: "context_length" in c and v[-1] == c["context_length"],
    ),
}

# `assistant`: name -> (what it must be, test of the value given the entry so far and the whole config); every
# field is required
ASSISTANT_FIELDS = {
    "draft_tokens": (
        f"an integer in [1, {MAX_DRAFT_TOKENS}]",
        lambda v, a, c: _integer(v) and 1 <= v <= MAX_DRAFT_TOKENS,
    ),
    "hidden_size": ("a positive integer", lambda v, a, c: _positive(v)),
    "backbone_hidden_size": ("the hidden_size", lambda v, a, c: _positive(v) and v == c["hidden_size"]),
    "num_centroids": (
        "0 (a plain head) or a divisor of vocab_size",
        lambda v, a, c: _integer(v) and (v == 0 or v > 0 and c["vocab_size"] % v == 0),
    ),
    "centroid_top_k": (
        "an integer in [1, num_centroids] (0 without centroids)",
        lambda v, a, c: _integer(v) and (1 <= v <= a["num_centroids"] if a["num_centroids"] else v == 0),
    ),
    "producers": (
        "layer indices by layer type, full_attention among them",
        lambda v, a, c: (
            isinstance(v, dict)
            and FULL in v
            and all(t in (SLIDING, FULL) and is_token(i) and i < c["num_hidden_layers"] for t, i in v.items())
        ),
    ),
}
# `vision`, as ASSISTANT_FIELDS
VISION_FIELDS = {
    "image_tokens": (
        "one of " + ", ".join(map(str, SOFT_TOKEN_BUDGETS)),
        lambda v, e, c: _integer(v) and v in SOFT_TOKEN_BUDGETS,
    ),
    "patch_size": ("a positive integer", lambda v, e, c: _positive(v)),
    "pooling_kernel_size": ("a positive integer", lambda v, e, c: _positive(v)),
    "head_dim": ("a positive multiple of 4", lambda v, e, c: _positive(v) and v % 4 == 0),
    "rope_theta": ("a positive fp32 number", lambda v, e, c: _scale(v)),
    "position_table": (
        "a file name in the bundle",
        lambda v, e, c: isinstance(v, str) and v == Path(v).name and v not in ("", ".", ".."),
    ),
    **{
        name: ("a token id below vocab_size", lambda v, e, c: is_token(v) and v < c["vocab_size"])
        for name in VISION_TOKEN_IDS
    },
}


# the processor's cap of MAX_SOFT_TOKENS soft tokens (30 s), rounded up to whole attention blocks of up to 24 rows
MAX_BUCKET_FRAMES = 4 * 24 * -(-MAX_SOFT_TOKENS // 24)  # 3072; E2B's 30 s bucket is 3024


def _buckets(v) -> bool:
    """Ascending mel-frame counts, each a multiple of 4 (the two stride-2 convolutions keep frames / 4 rows), none
    past MAX_BUCKET_FRAMES."""
    return (
        isinstance(v, list)
        and len(v) > 0
        and all(_positive(f) and f % 4 == 0 for f in v)
        and v == sorted(set(v))
        and v[-1] <= MAX_BUCKET_FRAMES
    )


# `audio`, as ASSISTANT_FIELDS
AUDIO_FIELDS = {
    "buckets": (
        f"ascending positive multiples of 4 mel frames, at most {MAX_BUCKET_FRAMES}",
        lambda v, e, c: _buckets(v),
    ),
    "mel_bins": (f"{MEL_BINS}", lambda v, e, c: _integer(v) and v == MEL_BINS),
    "sample_rate": (f"{SAMPLE_RATE}", lambda v, e, c: _integer(v) and v == SAMPLE_RATE),
    **{
        name: ("a token id below vocab_size", lambda v, e, c: is_token(v) and v < c["vocab_size"])
        for name in AUDIO_TOKEN_IDS
    },
}


def check_model_config(config, where: str) -> None:
    """The rules every model_config.json meets, written or read: its records' `from_json`, so a BundleError
    `where: field=value: expected ...` at the first field that breaks one."""
    TextConfig.from_json(config, where)
    for key, record in ENTRIES.items():
        if key in config:
            record.from_json(config, where)
    if ASSISTANT in config and SLIDING in config[ASSISTANT]["producers"] and "sliding_window" not in config:
        raise BundleError(f"{where}: sliding_window: missing (the assistant's sliding layers need it)")


def _short(value) -> str:
    value = repr(value)
    return value if len(value) <= 40 else value[:37] + "..."


def _check_entry(where: str, config: dict, key: str, rules: dict) -> dict:
    """config[key], an object whose every field is required and must pass its test: its fields by name."""
    entry = config[key]
    if not isinstance(entry, dict):
        raise BundleError(f"{where}: {key}: expected a JSON object, found {type(entry).__name__}")
    for name, (what, ok) in rules.items():
        if name not in entry:
            raise BundleError(f"{where}: {key}.{name}: missing")
        if not ok(entry[name], entry, config):
            raise BundleError(f"{where}: {key}.{name}={_short(entry[name])}: expected {what}")
    return {name: entry[name] for name in rules}


def read_model_config(root: Path) -> dict:
    """ROOT/model_config.json, checked field by field: a BundleError naming the field and its value."""
    path = Path(root) / MODEL_CONFIG
    if not path.is_file():
        raise BundleError(f"{path}: missing")
    try:
        config = read_json(path)
    except FileFormatError as e:
        raise BundleError(str(e)) from None
    check_model_config(config, str(path))
    return config


def read_bundle_json(path: Path) -> dict:
    """A JSON object of a bundle's (its manifest, hf_model/'s configs): damage is the bundle's, a BundleError naming
    the file."""
    try:
        return read_json_object(path)
    except FileFormatError as e:
        raise BundleError(str(e)) from None


def write_model_config(root: Path, config: dict) -> None:
    """ROOT/model_config.json, after the rules `read_model_config` applies (checked already by the converter,
    before it wrote anything: here they guard every other writer)."""
    path = Path(root) / MODEL_CONFIG
    check_model_config(config, str(path))
    path.write_text(json.dumps(config, indent=2) + "\n")

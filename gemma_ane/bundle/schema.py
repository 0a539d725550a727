"""model_config.json (CONTRACT §2): the one schema that writes it and reads it back.

The converter builds the text entry, the drafter's entry, the vision model's and the audio model's entries here
(`text_entry`, `assistant_entry`, `vision_entry`, `audio_entry`) and publishes them with `check_model_config`
first: the rules `load` applies when it reads the file are the rules a conversion must pass before anything is
written, so `convert` can never publish a bundle that `load` refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..audio import MAX_SOFT_TOKENS, MEL_BINS, SAMPLE_RATE
from ..files import FileFormatError, read_json
from ..images import SOFT_TOKEN_BUDGETS
from ..spec import FULL, MAX_DRAFT_TOKENS, SLIDING
from .errors import BundleError
from .layout import MODEL_CONFIG, VISION_POSITION_TABLE

ASSISTANT, VISION, AUDIO = "assistant", "vision", "audio"  # the one-function models' entries


def text_entry(spec, plan, bits: int, layout: str, name: str) -> dict:
    """The text model's fields: the checkpoint's shapes (a ModelSpec) and the chunk plan's, as the runtime and
    the published layout's readers expect them."""
    return {
        "model_name": name,
        "architecture": "gemma4",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.kv_heads[0],
        "head_dim": spec.head_dim_of(SLIDING) if SLIDING in spec.layer_types else spec.head_dims[0],
        "global_head_dim": spec.head_dim_of(FULL),
        "vocab_size": spec.vocab_size,
        "context_length": plan.context,
        "sliding_window": plan.window,
        "per_layer_dim": spec.per_layer_dim,
        "num_kv_shared_layers": spec.num_kv_shared_layers,
        "layer_types": list(spec.layer_types),
        "embed_scale": spec.embed_scale,
        "per_layer_embed_scale": spec.per_layer_embed_scale,
        "per_layer_model_projection_scale": spec.hidden_size**-0.5,
        "per_layer_input_scale": 2**-0.5,
        "rms_norm_eps": spec.rms_norm_eps,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_ids[0],
        "final_logit_softcapping": spec.final_logit_softcapping,
        "quantization": "none" if bits == 16 else f"int{bits}",
        "compute_units": "CPU_AND_NE",
        "prefill_batch": plan.prefill_batch,
        "split": list(plan.split),
        "head": "token_id" if layout == "published" else "logits",
    }


def assistant_entry(spec, draft_tokens: int, producers: dict[str, int]) -> dict:
    """`assistant`: what the runtime needs to drive the drafter's package and its head (an AssistantSpec; the
    target layer whose K/V each of its layer types reads)."""
    return {
        "draft_tokens": draft_tokens,
        "hidden_size": spec.hidden_size,
        "backbone_hidden_size": spec.backbone_hidden_size,
        "num_centroids": spec.num_centroids,
        "centroid_top_k": spec.centroid_top_k,
        "producers": producers,
    }


VISION_TOKEN_IDS = ("boi_token_id", "image_token_id", "eoi_token_id")


def vision_entry(spec, image_tokens: int) -> dict:
    """`vision`: what the host needs to preprocess an image and build `encode`'s inputs (a VisionSpec)."""
    return {
        "image_tokens": image_tokens,
        "patch_size": spec.patch_size,
        "pooling_kernel_size": spec.pooling_kernel_size,
        "head_dim": spec.head_dim,
        "rope_theta": spec.rope_theta,
        "position_table": VISION_POSITION_TABLE,
        **dict(zip(VISION_TOKEN_IDS, spec.token_ids)),
    }


AUDIO_TOKEN_IDS = ("boa_token_id", "audio_token_id", "eoa_token_id")


def audio_entry(buckets, token_ids) -> dict:
    """`audio`: what the host needs to turn a clip into the audio model's inputs: the buckets (mel frames per
    clip, ascending; each one function of the package, `audio_function`), the features' shape and rate, and the
    begin/placeholder/end token ids."""
    return {
        "buckets": sorted(buckets),
        "mel_bins": MEL_BINS,
        "sample_rate": SAMPLE_RATE,
        **dict(zip(AUDIO_TOKEN_IDS, token_ids)),
    }


def audio_function(frames: int, buckets) -> str:
    """The audio model's function for the bucket of `frames` mel frames: `encode` for the largest (the one every
    clip the bundle takes fits), `encode_{frames}` for the shorter ones."""
    return "encode" if frames == max(buckets) else f"encode_{frames}"


def model_config(text: dict, **entries: dict) -> dict:
    """The whole file: the text entry, then each one-function model's entry under its name."""
    return {**text, **entries}


# -- the rules, on write and on read ----------------------------------------------------------------------------


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(v) -> bool:
    return _integer(v) and v > 0


def _token(v) -> bool:
    return _integer(v) and v >= 0


def _scale(v) -> bool:  # the host scales the int8 tables in fp32
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= np.finfo(np.float32).max


# the text fields the runtime reads: name -> (required, what it must be, test)
TEXT_FIELDS = {
    "vocab_size": (True, "a positive integer", _positive),
    "hidden_size": (True, "a positive integer", _positive),
    "num_hidden_layers": (True, "a positive integer", _positive),
    "per_layer_dim": (True, "a positive integer", _positive),
    "embed_scale": (True, "a positive fp32 number", _scale),
    "per_layer_embed_scale": (True, "a positive fp32 number", _scale),
    "bos_token_id": (False, "a token id", _token),
    "eos_token_id": (False, "a token id", _token),
    "layer_types": (False, "a list of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)),
    "sliding_window": (False, "a positive integer", _positive),  # the ring may be wider (spec.ring_slots)
    "context_length": (False, "a positive integer", _positive),  # these four: the published plan's
    "prefill_batch": (False, "a positive integer", _positive),
    "split": (False, "two layer indices", lambda v: isinstance(v, list) and len(v) == 2 and all(map(_positive, v))),
    "head": (False, '"logits" or "token_id"', lambda v: v in ("logits", "token_id")),
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
            and all(t in (SLIDING, FULL) and _token(i) and i < c["num_hidden_layers"] for t, i in v.items())
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
        name: ("a token id below vocab_size", lambda v, e, c: _token(v) and v < c["vocab_size"])
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
        name: ("a token id below vocab_size", lambda v, e, c: _token(v) and v < c["vocab_size"])
        for name in AUDIO_TOKEN_IDS
    },
}


def check_model_config(config, where: str) -> None:
    """The rules every model_config.json meets, written or read: a BundleError `where: field=value: expected ...`
    at the first field that breaks one."""
    if not isinstance(config, dict):
        raise BundleError(f"{where}: expected a JSON object, found {type(config).__name__}")
    for name, (required, what, ok) in TEXT_FIELDS.items():
        if name not in config:
            if required:
                raise BundleError(f"{where}: {name}: missing")
        elif not ok(config[name]) or name.endswith("_token_id") and config[name] >= config["vocab_size"]:
            what += f" below vocab_size {config['vocab_size']}" if name.endswith("_token_id") else ""
            raise BundleError(f"{where}: {name}={_short(config[name])}: expected {what}")
    for key, fields in ((ASSISTANT, ASSISTANT_FIELDS), (VISION, VISION_FIELDS), (AUDIO, AUDIO_FIELDS)):
        if key in config:
            _check_entry(where, config, key, fields)
    if ASSISTANT in config and SLIDING in config[ASSISTANT]["producers"] and "sliding_window" not in config:
        raise BundleError(f"{where}: sliding_window: missing (the assistant's sliding layers need it)")


def _short(value) -> str:
    value = repr(value)
    return value if len(value) <= 40 else value[:37] + "..."


def _check_entry(where: str, config: dict, key: str, fields: dict) -> None:
    """config[key], an object whose every field is required and must pass its test."""
    entry = config[key]
    if not isinstance(entry, dict):
        raise BundleError(f"{where}: {key}: expected a JSON object, found {type(entry).__name__}")
    for name, (what, ok) in fields.items():
        if name not in entry:
            raise BundleError(f"{where}: {key}.{name}: missing")
        if not ok(entry[name], entry, config):
            raise BundleError(f"{where}: {key}.{name}={_short(entry[name])}: expected {what}")


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


def write_model_config(root: Path, config: dict) -> None:
    """ROOT/model_config.json, after the rules `read_model_config` applies (checked already by the converter,
    before it wrote anything: here they guard every other writer)."""
    path = Path(root) / MODEL_CONFIG
    check_model_config(config, str(path))
    path.write_text(json.dumps(config, indent=2) + "\n")

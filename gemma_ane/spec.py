"""What the model is (ModelSpec), its drafter (AssistantSpec), its vision tower (VisionSpec), and how it is cut
into Core ML chunks (ChunkPlan).

All are plain data derived from a Hugging Face config.json: no torch, no transformers, so the
runtime can use them too. Every rule here mirrors `transformers.models.gemma4` (5.24); where a
config asks for something the chunk graph cannot express, `ConfigError` names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from .errors import ConversionError

SLIDING, FULL = "sliding_attention", "full_attention"


class ConfigError(ConversionError):
    """A config (or an option) the converter cannot represent. The message names the field."""


def _number(value, field: str, kind=float):
    """value as int/float, or a ConfigError naming the field (JSON can hold anything)."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or (kind is int and not float(value).is_integer()):
        raise ConfigError(f"{field}={value!r}: expected {'an integer' if kind is int else 'a number'}")
    return kind(value)


@dataclass(frozen=True)
class Rope:
    theta: float
    rotated_pairs: int  # pairs i <-> i + d/2 that rotate; the rest are identity
    dim: int  # head dim the frequencies are computed against

    def inv_freq(self):
        import numpy as np

        # transformers' default/proportional init: theta^(-2i/d) for the rotated pairs, then zeros
        # (identity) for the rest. Computed in float64 and rounded once: within 1 ulp of torch's pow.
        exps = np.arange(0, 2 * self.rotated_pairs, 2, dtype=np.float64) / self.dim
        rotated = (1.0 / self.theta**exps).astype(np.float32)
        return np.concatenate([rotated, np.zeros(self.dim // 2 - self.rotated_pairs, np.float32)])


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    intermediate_sizes: tuple[int, ...]  # per layer (double-wide in KV-shared layers)
    kv_source: tuple[int, ...]  # per layer: the layer whose K/V it attends to (itself if it owns a cache)
    k_eq_v: tuple[bool, ...]  # per layer: V is the raw K projection (attention_k_eq_v on full layers)
    vocab_size: int
    vocab_size_per_layer_input: int
    per_layer_dim: int  # PLE width per layer (hidden_size_per_layer_input)
    sliding_window: int
    rope: dict  # layer type -> Rope
    rms_norm_eps: float
    final_logit_softcapping: float | None
    hidden_activation: str
    pad_token_id: int
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int  # the longest context the model was trained for: a plan's bound
    source: dict = field(default_factory=dict, compare=False, repr=False)

    # -- derived facts ---------------------------------------------------------------------------
    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    @property
    def per_layer_embed_scale(self) -> float:
        return self.per_layer_dim**0.5

    @property
    def per_layer_total(self) -> int:
        return self.num_layers * self.per_layer_dim

    @property
    def first_shared_layer(self) -> int:
        owners = [i for i in range(self.num_layers) if self.owns_cache(i)]
        return max(owners) + 1

    @property
    def num_kv_shared_layers(self) -> int:
        return self.num_layers - self.first_shared_layer

    @property
    def cache_width(self) -> int:
        # One state row holds a head of either type; sliding heads are zero-padded to this width.
        return max(self.head_dims)

    @property
    def producers(self) -> list[int]:
        """Layers whose cache is read by later, KV-shared layers, in layer order."""
        return sorted({self.kv_source[i] for i in range(self.num_layers) if not self.owns_cache(i)})

    def owns_cache(self, layer: int) -> bool:
        return self.kv_source[layer] == layer

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, src: str | Path) -> ModelSpec:
        """A config.json path, or a directory holding one (checkpoint dir or bundle's hf_model/)."""
        path, config = _read_config(src)
        try:
            return cls.from_config(config)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_config(cls, config: dict) -> ModelSpec:
        """Check, normalise and derive, in the order of transformers' Gemma4TextConfig.__post_init__."""
        text = _text_config(config)
        get = partial(_get, text)
        act = _check_supported(text)
        hidden, n_layers, n_heads, n_kv, head_dim = (
            get(name)
            for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
        )
        if min(hidden, n_layers, n_heads, n_kv, head_dim) <= 0:
            raise ConfigError(
                "hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim must be > 0"
            )
        layer_types = _layer_types(text.get("layer_types"), n_layers)
        k_eq_v = get("attention_k_eq_v", bool, False)
        head_dims, kv_heads = _head_shapes(text, layer_types, head_dim, n_kv, k_eq_v)
        _check_head_shapes(layer_types, head_dims, kv_heads, n_heads)
        kv_source = _kv_sources(layer_types, head_dims, kv_heads, get("num_kv_shared_layers", int, 0))
        inter, double = get("intermediate_size"), get("use_double_wide_mlp", bool, False)
        rope_params = text.get("rope_parameters") or _DEFAULT_ROPE
        rope = {t: _rope(t, rope_params, head_dims[layer_types.index(t)]) for t in sorted(set(layer_types))}
        per_layer_dim, vocab, vocab_ple = _embedding_sizes(config, text)
        eos = _eos_ids(config, text)
        softcap = text.get("final_logit_softcapping")
        window = get("sliding_window", int, 512)
        if window <= 0:
            raise ConfigError(f"sliding_window={window}: must be > 0")
        max_pos = get("max_position_embeddings", int, 131_072)  # transformers' default for Gemma 4
        if max_pos <= 0:
            raise ConfigError(f"max_position_embeddings={max_pos}: must be > 0")
        return cls(
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            layer_types=tuple(layer_types),
            head_dims=tuple(head_dims),
            kv_heads=tuple(kv_heads),
            intermediate_sizes=tuple(inter * (2 if double and kv_source[i] != i else 1) for i in range(n_layers)),
            kv_source=tuple(kv_source),
            k_eq_v=tuple(k_eq_v and t == FULL for t in layer_types),
            vocab_size=vocab,
            vocab_size_per_layer_input=vocab_ple,
            per_layer_dim=per_layer_dim,
            sliding_window=window,
            rope=rope,
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            final_logit_softcapping=None if softcap is None else _number(softcap, "final_logit_softcapping"),
            hidden_activation=act,
            pad_token_id=get("pad_token_id", int, 0),
            bos_token_id=get("bos_token_id", int, 2),
            eos_token_ids=eos,
            max_position_embeddings=max_pos,
            source=config,
        )

    def head_dim_of(self, layer_type: str) -> int:
        return self.head_dims[self.layer_types.index(layer_type)]

    def kv_heads_of(self, layer_type: str) -> int:
        return self.kv_heads[self.layer_types.index(layer_type)]


# -- reading a config: one step of ModelSpec.from_config each ----------------------------------


def _read_config(src: str | Path) -> tuple[Path, dict]:
    path = Path(src)
    if path.is_dir():
        for candidate in (path / "config.json", path / "hf_model" / "config.json"):
            if candidate.is_file():
                path = candidate
                break
        else:
            raise ConfigError(f"{src}: no config.json in this directory")
    if not path.is_file():
        raise ConfigError(f"{src}: no such file or directory")
    try:
        return path, json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({e})") from None


def _text_config(config) -> dict:
    """The text part of either Hub form (multimodal with text_config, or text-only), if it is Gemma 4."""
    if not isinstance(config, dict):
        raise ConfigError("config must be a JSON object")
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise ConfigError("text_config must be a JSON object")
    mt = text.get("model_type", config.get("model_type"))
    if mt not in ("gemma4_text", "gemma4"):
        raise ConfigError(f"model_type={mt!r}: only Gemma 4 (gemma4 / gemma4_text) is supported")
    return text


def _get(text: dict, name: str, kind=int, default=...):
    """text[name] as kind (int, float or bool); default when absent or null, or a ConfigError if there is none."""
    if name not in text or text[name] is None:
        if default is ...:
            raise ConfigError(f"{name}: missing")
        return default
    value = text[name]
    ok = (
        isinstance(value, bool)
        if kind is bool
        else (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (kind is float or float(value).is_integer())
        )
    )
    if not ok:
        raise ConfigError(f"{name}={value!r}: expected {kind.__name__}")
    return kind(value)


def _check_supported(text: dict) -> str:
    """Refuse the Gemma 4 variants the chunk graph does not build; returns the (one supported) activation."""
    for name in ("enable_moe_block",):
        if _get(text, name, bool, False):
            raise ConfigError(f"{name}=true: mixture-of-experts blocks are not supported by the chunk graph")
    bidir = text.get("use_bidirectional_attention")
    if bidir not in (None, False):
        raise ConfigError(f"use_bidirectional_attention={bidir!r}: only causal text attention is supported")
    if _get(text, "attention_bias", bool, False):
        raise ConfigError("attention_bias=true: Gemma 4 projections have no bias; unsupported")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh",):
        raise ConfigError(f"hidden_activation={act!r}: only gelu_pytorch_tanh is supported")
    return act


def _layer_types(value, n_layers: int) -> list[str]:
    """layer_types as transformers reads it: default 5 sliding then 1 full, and the last layer forced to full."""
    if value is None:
        value = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    if not isinstance(value, list) or len(value) != n_layers:
        raise ConfigError(f"layer_types: expected a list of {n_layers} entries")
    bad = [t for t in value if t not in (SLIDING, FULL)]
    if bad:
        raise ConfigError(f"layer_types: unsupported attention type {bad[0]!r}")
    return [*value[:-1], FULL]


def _head_shapes(text: dict, layer_types: list[str], head_dim: int, n_kv: int, k_eq_v: bool):
    """Per-layer (head_dims, kv_heads): head_dim / num_key_value_heads, overridden per layer by either form
    of stating the full layers' shapes (per_layer_config, or the older global_* pair)."""
    head_dims, kv_heads = [head_dim] * len(layer_types), [n_kv] * len(layer_types)
    plc = text.get("per_layer_config")
    if plc is None:
        overrides = _global_overrides(text, layer_types, k_eq_v)
    else:
        overrides = _per_layer_config(plc, len(layer_types))
    for i, o in overrides.items():
        head_dims[i] = o.get("head_dim", head_dims[i])
        kv_heads[i] = o.get("num_key_value_heads", kv_heads[i])
    return head_dims, kv_heads


def _per_layer_config(plc, n_layers: int) -> dict[int, dict[str, int]]:
    """{layer: {head_dim / num_key_value_heads: value}} from per_layer_config (what newer transformers write)."""
    if not isinstance(plc, dict):
        raise ConfigError("per_layer_config: expected an object keyed by layer index")
    out = {}
    for key, overrides in plc.items():
        try:
            idx = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"per_layer_config: key {key!r} is not a layer index") from None
        if not 0 <= idx < n_layers or not isinstance(overrides, dict):
            raise ConfigError(f"per_layer_config[{key!r}]: invalid layer index or entry")
        for name, value in overrides.items():
            if name not in ("head_dim", "num_key_value_heads"):
                raise ConfigError(f"per_layer_config[{key!r}].{name}: per-layer override not supported")
            out.setdefault(idx, {})[name] = _number(value, f"per_layer_config[{key!r}].{name}", int)
    return out


def _global_overrides(text: dict, layer_types: list[str], k_eq_v: bool) -> dict[int, dict[str, int]]:
    """The older form turned into per-layer overrides, as transformers' __post_init__ does: global_head_dim on
    every full layer, and num_global_key_value_heads too, but only when attention_k_eq_v."""
    override = {"head_dim": _get(text, "global_head_dim", int, 512)}
    g_kv = text.get("num_global_key_value_heads")
    if k_eq_v and g_kv is not None:
        override["num_key_value_heads"] = _number(g_kv, "num_global_key_value_heads", int)
    return {i: override for i, t in enumerate(layer_types) if t == FULL}


def _check_head_shapes(layer_types: list[str], head_dims: list[int], kv_heads: list[int], n_heads: int) -> None:
    for i in range(len(layer_types)):
        if head_dims[i] <= 0 or kv_heads[i] <= 0:
            raise ConfigError(f"layer {i}: head_dim and num_key_value_heads must be > 0")
        if n_heads % kv_heads[i]:
            raise ConfigError(
                f"layer {i}: num_attention_heads={n_heads} is not a multiple of its {kv_heads[i]} KV heads"
            )
        if head_dims[i] % 2:
            raise ConfigError(f"layer {i}: head_dim={head_dims[i]} must be even for RoPE")
    # one state (and one RoPE table) per attention type: all its layers need one head dim
    for t in set(layer_types):
        dims = {head_dims[i] for i in range(len(layer_types)) if layer_types[i] == t}
        if len(dims) > 1:
            raise ConfigError(f"per_layer_config: layers of type {t} have different head dims {sorted(dims)}")


def _kv_sources(layer_types: list[str], head_dims: list[int], kv_heads: list[int], n_shared: int) -> list[int]:
    """Per layer, the layer whose K/V it attends to, as Gemma4TextConfig.kv_sharing_modes: the last
    `num_kv_shared_layers` layers reuse the cache of the last non-shared layer of their own type."""
    n_layers = len(layer_types)
    if not 0 <= n_shared < n_layers:
        raise ConfigError(f"num_kv_shared_layers={n_shared}: must be in [0, {n_layers})")
    first_shared = n_layers - n_shared
    kv_source = list(range(n_layers))
    for i in range(first_shared, n_layers):
        owners = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ConfigError(
                f"num_kv_shared_layers={n_shared}: layer {i} ({layer_types[i]}) is KV-shared "
                "but no earlier layer of that type owns a cache"
            )
        kv_source[i] = owners[-1]
        if head_dims[i] != head_dims[owners[-1]] or kv_heads[i] != kv_heads[owners[-1]]:
            raise ConfigError(f"layer {i}: KV-shared layer's head shape differs from its producer {owners[-1]}")
    return kv_source


_DEFAULT_ROPE = {  # transformers' rope_parameters when a config has none
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _rope(t: str, rope_params, head_dim: int) -> Rope:
    """RoPE of layer type t: default (all pairs rotate) or proportional (partial_rotary_factor of the pairs)."""
    p = rope_params.get(t) if isinstance(rope_params, dict) else None
    if not isinstance(p, dict) or "rope_theta" not in p:
        raise ConfigError(f"rope_parameters.{t}: missing or has no rope_theta")
    rtype = p.get("rope_type", "default")
    if rtype == "default":
        pairs = head_dim // 2
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"rope_parameters.{t}.partial_rotary_factor: only 'proportional' RoPE may be partial")
    elif rtype == "proportional":
        prf = _number(p.get("partial_rotary_factor", 1.0), f"rope_parameters.{t}.partial_rotary_factor")
        if not 0.0 <= prf <= 1.0:
            raise ConfigError(f"rope_parameters.{t}.partial_rotary_factor={prf}: must lie in [0, 1]")
        pairs = int(prf * head_dim // 2)
    else:
        raise ConfigError(f"rope_parameters.{t}.rope_type={rtype!r}: only 'default' and 'proportional' are supported")
    if _number(p.get("factor", 1.0), f"rope_parameters.{t}.factor") != 1.0:
        raise ConfigError(f"rope_parameters.{t}.factor: RoPE scaling is not supported")
    theta = _number(p["rope_theta"], f"rope_parameters.{t}.rope_theta")
    if theta <= 0:
        raise ConfigError(f"rope_parameters.{t}.rope_theta={theta}: must be > 0")
    return Rope(theta=theta, rotated_pairs=pairs, dim=head_dim)


def _embedding_sizes(config: dict, text: dict) -> tuple[int, int, int]:
    """(per_layer_dim, vocab_size, vocab_size_per_layer_input): the chunk contract needs PLE over the whole
    vocabulary and a head tied to the embedding table."""
    per_layer_dim = _get(text, "hidden_size_per_layer_input", int, 0)
    if per_layer_dim <= 0:
        raise ConfigError("hidden_size_per_layer_input: the chunk contract needs per-layer embeddings (PLE)")
    vocab = _get(text, "vocab_size")
    vocab_ple = _get(text, "vocab_size_per_layer_input", int, vocab)
    if vocab_ple != vocab:
        raise ConfigError(f"vocab_size_per_layer_input={vocab_ple}: must equal vocab_size={vocab}")
    if not _get(text, "tie_word_embeddings", bool, config.get("tie_word_embeddings", True)):
        raise ConfigError("tie_word_embeddings=false: the bundle's head is tied to the embedding table")
    return per_layer_dim, vocab, vocab_ple


def _eos_ids(config: dict, text: dict) -> tuple[int, ...]:
    eos = text.get("eos_token_id", config.get("eos_token_id", 1))
    eos = tuple(_number(e, "eos_token_id", int) for e in (eos if isinstance(eos, list) else [eos]))
    if not eos:
        raise ConfigError("eos_token_id: empty")
    return eos


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AssistantSpec:
    """Gemma 4's drafter (Gemma4AssistantForCausalLM, transformers 5.24) checked against the target it drafts for.
    It has no K/V of its own: each layer attends to the K/V of the target's last cache-owning layer of its type,
    so head dims, KV heads, window and RoPE must be the target's; its input is [scaled embedding; hidden] of the
    target (2 x backbone_hidden_size wide)."""

    hidden_size: int
    num_heads: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    kv_source: tuple[int, ...]  # per layer: the *target* layer whose K/V it attends to
    backbone_hidden_size: int
    vocab_size: int
    sliding_window: int
    rope: dict  # layer type -> Rope
    rms_norm_eps: float
    num_centroids: int  # 0: a plain tied head; else token clusters of vocab_size / num_centroids
    centroid_top_k: int  # clusters whose tokens get real logits

    @classmethod
    def from_pretrained(cls, src: str | Path, target: ModelSpec) -> AssistantSpec:
        path, config = _read_config(src)
        try:
            return cls.from_config(config, target)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_config(cls, config: dict, target: ModelSpec) -> AssistantSpec:
        if not isinstance(config, dict) or config.get("model_type") != "gemma4_assistant":
            mt = config.get("model_type") if isinstance(config, dict) else None
            raise ConfigError(f"model_type={mt!r}: not a Gemma 4 assistant (gemma4_assistant)")
        if not isinstance(config.get("text_config"), dict):
            raise ConfigError("text_config: missing or not a JSON object")
        text = _text_config(config["text_config"])
        get = partial(_get, text)
        _check_supported(text)
        if get("hidden_size_per_layer_input", int, 0) or get("use_double_wide_mlp", bool, False):
            raise ConfigError("hidden_size_per_layer_input, use_double_wide_mlp: an assistant has neither")
        n_layers, n_heads, head_dim = get("num_hidden_layers"), get("num_attention_heads"), get("head_dim")
        layer_types = _layer_types(text.get("layer_types"), n_layers)
        n_shared = get("num_kv_shared_layers", int, 0) or n_layers  # as Gemma4AssistantConfig.__post_init__
        if n_shared != n_layers:
            raise ConfigError(f"num_kv_shared_layers={n_shared}: every one of the {n_layers} layers must be shared")
        k_eq_v = get("attention_k_eq_v", bool, False)
        head_dims, kv_heads = _head_shapes(text, layer_types, head_dim, get("num_key_value_heads"), k_eq_v)
        _check_head_shapes(layer_types, head_dims, kv_heads, n_heads)
        for name, mine, theirs in (
            ("backbone_hidden_size", _get(config, "backbone_hidden_size", int, 1536), target.hidden_size),
            ("vocab_size", get("vocab_size"), target.vocab_size),
            ("sliding_window", get("sliding_window", int, 512), target.sliding_window),
        ):
            if mine != theirs:
                raise ConfigError(f"{name}={mine}: the target's is {theirs} (an assistant for another model)")
        kv_source = [_producer(target, t, i) for i, t in enumerate(layer_types)]
        for i, src in enumerate(kv_source):
            if (head_dims[i], kv_heads[i]) != (target.head_dims[src], target.kv_heads[src]):
                raise ConfigError(
                    f"layer {i}: head_dim {head_dims[i]} x {kv_heads[i]} KV heads, but the target layer {src} it "
                    f"reads has {target.head_dims[src]} x {target.kv_heads[src]} (an assistant for another model)"
                )
        rope_params = text.get("rope_parameters") or _DEFAULT_ROPE
        rope = {t: _rope(t, rope_params, head_dims[layer_types.index(t)]) for t in sorted(set(layer_types))}
        for t, r in rope.items():
            if r != target.rope[t]:
                raise ConfigError(f"rope_parameters.{t}: differs from the target's, whose keys it attends to")
        centroids, top_k = _centroid_head(config, get("vocab_size"))
        return cls(
            hidden_size=get("hidden_size"),
            num_heads=n_heads,
            intermediate_size=get("intermediate_size"),
            layer_types=tuple(layer_types),
            head_dims=tuple(head_dims),
            kv_heads=tuple(kv_heads),
            kv_source=tuple(kv_source),
            backbone_hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            sliding_window=target.sliding_window,
            rope=rope,
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            num_centroids=centroids,
            centroid_top_k=top_k,
        )

    @property
    def cluster_size(self) -> int:
        return self.vocab_size // self.num_centroids


def _producer(target: ModelSpec, layer_type: str, layer: int) -> int:
    """The target layer an assistant layer reads: the last that owns a cache of its type (transformers 5.24 stores
    its K/V in `shared_kv_states[layer_type]` whether or not the target itself shares it)."""
    owners = [j for j in range(target.num_layers) if target.owns_cache(j) and target.layer_types[j] == layer_type]
    if not owners:
        raise ConfigError(f"layer {layer} ({layer_type}): the target has no such layer to read K/V from")
    return owners[-1]


def _centroid_head(config: dict, vocab: int) -> tuple[int, int]:
    """(num_centroids, top_k) of an ordered-embedding head, or (0, 0) for a plain one."""
    if not _get(config, "use_ordered_embeddings", bool, False):
        return 0, 0
    n, k = _get(config, "num_centroids", int, 2048), _get(config, "centroid_intermediate_top_k", int, 32)
    if n <= 0 or vocab % n:
        raise ConfigError(f"num_centroids={n}: must divide vocab_size={vocab}")
    if not 0 < k <= n:
        raise ConfigError(f"centroid_intermediate_top_k={k}: must lie in [1, num_centroids={n}]")
    return n, k


# ---------------------------------------------------------------------------------------------
# The chunk plan
# ---------------------------------------------------------------------------------------------

F16, I32 = "float16", "int32"


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    dtype: str = F16

    def to_json(self):
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Chunk:
    name: str
    layers: tuple[int, ...]
    stateful: bool
    # cache-owning layers of this chunk by type, in layer order; slot 2j holds K and 2j+1 V of the j-th
    sliding_layers: tuple[int, ...]
    full_layers: tuple[int, ...]
    states: dict  # name -> Tensor
    functions: dict  # function name -> {"T": int, "inputs": {name: Tensor}, "outputs": {name: Tensor}}
    has_head: bool
    computes_ple: bool

    def slot(self, layer: int) -> tuple[str, int]:
        """(state name, K row) of a cache-owning layer of this chunk."""
        if layer in self.sliding_layers:
            return "kv_cache_sliding", 2 * self.sliding_layers.index(layer)
        return "kv_cache_full", 2 * self.full_layers.index(layer)

    def to_json(self):
        return {
            "name": self.name,
            "layers": list(self.layers),
            "states": {k: v.to_json() for k, v in self.states.items()},
            "functions": {
                f: {
                    "inputs": {k: v.to_json() for k, v in io["inputs"].items()},
                    "outputs": {k: v.to_json() for k, v in io["outputs"].items()},
                }
                for f, io in self.functions.items()
            },
        }


def kv_name(layer: int, which: str) -> str:
    return f"kv{layer}_{which}"


VISION_TOKEN_IDS = {"boi_token_id": 255999, "image_token_id": 258880, "eoi_token_id": 258882}  # transformers' defaults


@dataclass(frozen=True)
class VisionSpec:
    """What the graph needs of config.json's `vision_config` (and the text width it projects into)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    clipped: bool  # use_clipped_linears: each encoder projection clamps its input and output
    rope_theta: float
    rms_norm_eps: float
    text_hidden_size: int
    token_ids: tuple[int, int, int]  # begin-of-image, the placeholder, end-of-image (config.json's)

    @classmethod
    def from_config(cls, config: dict) -> VisionSpec | None:
        """From a multimodal config.json (None without a vision tower); refuses, naming the field, what the graph
        cannot express."""
        v = config.get("vision_config")
        if not v:
            return None
        try:
            spec = cls(
                hidden_size=v["hidden_size"],
                intermediate_size=v["intermediate_size"],
                num_layers=v["num_hidden_layers"],
                num_heads=v["num_attention_heads"],
                head_dim=v["head_dim"],
                patch_size=v["patch_size"],
                pooling_kernel_size=v["pooling_kernel_size"],
                position_embedding_size=v["position_embedding_size"],
                clipped=bool(v.get("use_clipped_linears", False)),
                rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 100.0)),
                rms_norm_eps=v["rms_norm_eps"],
                text_hidden_size=config["text_config"]["hidden_size"],
                token_ids=tuple(config.get(k, d) for k, d in VISION_TOKEN_IDS.items()),
            )
        except KeyError as e:
            raise ConfigError(f"config.json: vision_config has no {e.args[0]}") from None
        refuse = {
            "num_key_value_heads": v.get("num_key_value_heads", spec.num_heads) != spec.num_heads,
            "standardize": bool(v.get("standardize")),
            "hidden_activation": v.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
            "head_dim": spec.head_dim % 4 != 0,  # axial RoPE: two halves, each rotated half against half
        }
        for name, bad in refuse.items():
            if bad:
                raise ConfigError(f"config.json: vision_config.{name} = {v.get(name)!r} is not supported")
        return spec

    def max_position(self, image_tokens: int) -> int:
        """Patches per side an image can have at this budget: a side is at most `image_tokens` pooling cells."""
        return image_tokens * self.pooling_kernel_size


@dataclass(frozen=True)
class ChunkPlan:
    spec: ModelSpec
    context: int
    prefill_batch: int
    split: tuple[int, ...]  # N-1 layer boundaries: chunk_{k+1} starts at split[k-1]
    chunks: tuple[Chunk, ...]
    draft_tokens: int = 0  # K: verify_b{K+1} checks K drafts (speculative decoding); 0 = no drafter

    @property
    def window(self) -> int:
        return min(self.spec.sliding_window, self.context)

    @property
    def ring(self) -> int:
        """Slots of the sliding caches (CONTRACT §3): the window, plus room for a verify batch's rows."""
        return ring_slots(self.spec.sliding_window, self.draft_tokens, self.kv_batches)

    @property
    def kv_batches(self) -> tuple[int, ...]:
        return tuple(int(f[len("prefill_kv_b") :]) for f in self.chunks[0].functions if f.startswith("prefill_kv_b"))

    def to_json(self):
        return {
            "context": self.context,
            "prefill_batch": self.prefill_batch,
            "split": list(self.split),
            "draft_tokens": self.draft_tokens,
            "chunks": [c.to_json() for c in self.chunks],
        }

    def hands_on(self, chunk: Chunk) -> list[str]:
        """The producer caches a chunk returns for later chunks (kv{p}_k / kv{p}_v)."""
        return [n for n in chunk.functions["infer"]["outputs"] if n.startswith("kv")]

    def reads(self, chunk: Chunk) -> list[str]:
        """The producer caches a chunk takes from earlier chunks."""
        return [n for n in chunk.functions["infer"]["inputs"] if n.startswith("kv")]

    def describe(self, bits: int) -> list[dict]:
        """Each chunk's role as a runtime wires it: its layers, states, what it takes from and hands on to
        other chunks, whether it computes the PLE or holds the head, and its weights in MB at `bits`."""
        return [
            {
                "name": c.name,
                "layers": list(c.layers),
                "stateful": c.stateful,
                "states": sorted(c.states),
                "computes_ple": c.computes_ple,
                "reads": self.reads(c),
                "hands_on": self.hands_on(c),
                "head": c.has_head,
                "functions": list(c.functions),
                "weight_mb": round(chunk_weight_bytes(self.spec, c.layers, c.computes_ple, c.has_head, bits) / 1e6, 1),
            }
            for c in self.chunks
        ]

    @staticmethod
    def default_split(spec: ModelSpec) -> tuple[int, int]:
        # The published layout's E2B split (0-7 / 8-24 / 25-34): halve the cache owners, halve the sharers.
        first = spec.first_shared_layer
        return math.ceil(first / 2), first + math.ceil(spec.num_kv_shared_layers / 2)

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        context: int = 2048,
        prefill_batch: int = 8,
        split: tuple[int, int] | None = None,
        head: str = "logits",
        kv_batches: tuple[int, ...] = (),
        draft_tokens: int = 0,
    ) -> ChunkPlan:
        """split: the N-1 layer boundaries of N chunks (default: the published layout's three, `default_split`).
        head="logits" (ours) or "token_id" (the published layout's argmax head: greedy only).
        kv_batches: batch sizes of the KV-only prefill functions `prefill_kv_b{T}`.
        draft_tokens: K > 0 adds `verify_b{K+1}` to every chunk (the last token and K drafts in one call, logits for
        every row) and the last chunk's `final_hidden` output (what the drafter reads), and pads the rings
        (`ring_slots`)."""
        _check_options(spec, context, prefill_batch, head, kv_batches, draft_tokens)
        split = tuple(split) if split is not None else cls.default_split(spec)
        _check_split(spec, split)
        R = ring_slots(spec.sliding_window, draft_tokens, kv_batches)
        bounds = [0, *split, spec.num_layers]
        io = _PlanIO(spec, context, R, head, draft_tokens > 0, tuple(zip(bounds, bounds[1:])))
        chunks = []
        for ci, (lo, hi) in enumerate(io.spans):
            layers = tuple(range(lo, hi))
            owners = [i for i in layers if spec.owns_cache(i)]
            sliding = tuple(i for i in owners if spec.is_sliding(i))
            full = tuple(i for i in owners if not spec.is_sliding(i))
            stateful = bool(owners)  # a chunk of KV-shared layers keeps nothing, so it never prefills
            functions = {"infer": io.step(ci, 1)}
            if stateful:
                functions[f"prefill_b{prefill_batch}"] = io.step(ci, prefill_batch)
                for T in sorted(set(kv_batches), reverse=True):
                    functions[f"prefill_kv_b{T}"] = io.kv_only(ci, T)
            if draft_tokens:
                functions[f"verify_b{draft_tokens + 1}"] = io.step(ci, draft_tokens + 1, every_row=True)
            chunks.append(
                Chunk(
                    name=f"chunk_{ci + 1}",
                    layers=layers,
                    stateful=stateful,
                    sliding_layers=sliding,
                    full_layers=full,
                    states=_states(spec, context, R, sliding, full),
                    functions=functions,
                    has_head=ci == len(io.spans) - 1,
                    computes_ple=ci == 0,
                )
            )
        return cls(
            spec=spec,
            context=context,
            prefill_batch=prefill_batch,
            split=split,
            chunks=tuple(chunks),
            draft_tokens=draft_tokens,
        )


MAX_DRAFT_TOKENS = 31  # verify_b32: the rings' 32 extra slots hold one verify batch's rows (ring_slots)


def ring_slots(window: int, draft_tokens: int = 0, kv_batches: tuple[int, ...] = ()) -> int:
    """Slots of a sliding cache. Without drafts: the window, as the published layout.

    A verify call writes its K+1 rows before knowing which drafts survive. In a ring of exactly W slots the rows of
    rejected drafts overwrite the oldest positions, which the next accepted position still attends to; with R >= W
    + K + 1 slots, a write at position q evicts q - R, older than anything a later query (or the drafter's W+1 rows)
    reads, so rejected rows only ever sit in slots the position masks hide until the accepted token overwrites
    them. The pad is a multiple of 32 (Core ML state dimensions, coremltools #2631) and of every KV-only prefill
    batch (an aligned batch must not wrap the ring); it also makes every `prefill_b{T}` with T <= pad + 1 exact
    past the first pass of the ring."""
    if not draft_tokens:
        return window
    step = math.lcm(32, *kv_batches)
    return window + step * math.ceil((draft_tokens + 1) / step)


# -- building a plan: one step of ChunkPlan.build each; ci is the chunk's index (0, 1, 2) ----------


def _check_options(spec: ModelSpec, context, prefill_batch, head, kv_batches, draft_tokens) -> None:
    W = spec.sliding_window
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise ConfigError(f"context={context!r}: must be a positive integer")
    if context < W:
        raise ConfigError(f"context={context}: must be at least the sliding window ({W})")
    if context % 32:
        raise ConfigError(f"context={context}: must be a multiple of 32 (Core ML state dimensions)")
    if context > spec.max_position_embeddings:
        raise ConfigError(
            f"context={context}: exceeds the model's max_position_embeddings={spec.max_position_embeddings}"
        )
    for T in kv_batches:
        if isinstance(T, bool) or not isinstance(T, int) or T < 2 or W % T:
            raise ConfigError(
                f"kv prefill batch {T!r}: must be an integer >= 2 that divides the window "
                f"({W}), so aligned batches never wrap the ring"
            )
    if head not in ("logits", "token_id"):
        raise ConfigError(f"head={head!r}: choose logits or token_id")
    if isinstance(prefill_batch, bool) or not isinstance(prefill_batch, int) or not 1 <= prefill_batch <= W:
        raise ConfigError(f"prefill_batch={prefill_batch!r}: must be an integer in [1, sliding_window={W}]")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"draft_tokens={draft_tokens!r}: must be an integer in [0, {MAX_DRAFT_TOKENS}]")
    if draft_tokens and head != "logits":
        raise ConfigError("draft_tokens: speculative decoding needs logits (head=logits)")
    if draft_tokens and draft_tokens + 1 >= context:
        raise ConfigError(f"draft_tokens={draft_tokens}: a verify batch must fit in the context ({context})")


def _check_split(spec: ModelSpec, split: tuple[int, ...]) -> None:
    """Boundaries in order inside the model, and the last chunk (the head) holding only KV-shared layers: it keeps
    no state, so every cache owner, producers included, must precede it. Every other cut is legal: a chunk hands
    the caches of the producers it owns to the later chunks (`_PlanIO`)."""
    L, first = spec.num_layers, spec.first_shared_layer
    text = ",".join(map(str, split))
    if not split:
        raise ConfigError("split: expected at least one layer boundary")
    for k, b in enumerate(split):
        # the last boundary may be L: a last chunk of the head alone
        if isinstance(b, bool) or not isinstance(b, int) or not 0 < b <= L:
            raise ConfigError(f"split={text}: boundary {b!r} is outside 1..{L} (num_hidden_layers={L})")
        if k and b <= split[k - 1]:
            raise ConfigError(f"split={text}: boundary {b} does not come after {split[k - 1]}; boundaries ascend")
    last = split[-1]
    if last < first:
        owner = max(i for i in range(last, first) if spec.owns_cache(i))
        what = "a KV producer" if owner in spec.producers else "a cache owner"
        raise ConfigError(
            f"split={text}: layer {owner} is {what} and must precede the stateless last chunk, "
            f"which would start at boundary {last}; need the last boundary >= {first}"
        )


def _states(spec: ModelSpec, context: int, ring: int, sliding: tuple[int, ...], full: tuple[int, ...]) -> dict:
    """One state per attention type, K and V rows of each of the chunk's cache owners of that type."""
    D, states = spec.cache_width, {}
    if sliding:
        states["kv_cache_sliding"] = Tensor((2 * len(sliding), spec.kv_heads_of(SLIDING), ring, D))
    if full:
        states["kv_cache_full"] = Tensor((2 * len(full), spec.kv_heads_of(FULL), context, D))
    return states


@dataclass(frozen=True)
class _PlanIO:
    """The inputs and outputs of every function of a plan; ci is the chunk's index (0 .. N-1).

    A chunk that owns producers hands their whole caches on (outputs kv{p}_k / kv{p}_v) unless it is the last; a
    chunk holding KV-shared layers takes the caches of every producer owned by an earlier chunk. With the default
    split that is chunk_2 -> chunk_3, as the published layout wires it."""

    spec: ModelSpec
    context: int
    ring: int
    head: str
    drafter: bool  # the last chunk also returns the final-norm hidden states the drafter reads
    spans: tuple[tuple[int, int], ...]  # each chunk's layers [lo, hi)

    def hands_on(self, ci: int) -> list[int]:
        lo, hi = self.spans[ci]
        return [p for p in self.spec.producers if lo <= p < hi] if ci < len(self.spans) - 1 else []

    def takes(self, ci: int) -> list[int]:
        lo, hi = self.spans[ci]
        shares = any(not self.spec.owns_cache(i) for i in range(lo, hi))
        return [p for p in self.spec.producers if p < lo] if shares else []

    def step(self, ci: int, T: int, every_row: bool = False) -> dict:
        """`infer` (T=1), `prefill_b{T}` and `verify_b{T}` (every_row: the head returns each row's logits)."""
        spec = self.spec
        ins = self.host_inputs(ci, T, spec.per_layer_total, self.ring)
        outs = _hidden_outputs(spec, ci, T, spec.per_layer_total)
        outs.update({kv_name(p, w): self.cache_tensor(p) for p in self.hands_on(ci) for w in ("k", "v")})
        ins.update({kv_name(p, w): self.cache_tensor(p) for p in self.takes(ci) for w in ("k", "v")})
        if ci == len(self.spans) - 1:
            rows = T if every_row else 1
            if self.head == "logits":
                outs = {"logits": Tensor((1, rows, spec.vocab_size))}
                if self.drafter:
                    outs["final_hidden"] = Tensor((1, rows, spec.hidden_size))
            else:
                outs = {"token_id": Tensor((1,), I32), "token_logit": Tensor((1,))}
        return {"T": T, "inputs": ins, "outputs": outs, "every_row": every_row}

    def kv_only(self, ci: int, T: int) -> dict:
        """`prefill_kv_b{T}`: only the cache-owning layers run, so PLE covers only them; sliding layers
        attend over [ring as it was | the batch] before writing (CONTRACT §4 fixed)."""
        own = self.spec.first_shared_layer * self.spec.per_layer_dim
        ins = self.host_inputs(ci, T, own, self.ring + T)
        return {"T": T, "inputs": ins, "outputs": _hidden_outputs(self.spec, ci, T, own), "kv_only": True}

    def host_inputs(self, ci: int, T: int, ple_width: int, sliding_keys: int) -> dict:
        """What the host computes for T tokens: embeddings, masks, the PLE (raw into chunk_1, combined after),
        RoPE tables per attention type, and for the stateful chunks (those owning a cache) the positions."""
        spec = self.spec
        ins = {
            "hidden_states": Tensor((1, T, spec.hidden_size)),
            "causal_mask_full": Tensor((1, 1, T, self.context)),
            "causal_mask_sliding": Tensor((1, 1, T, sliding_keys)),
            "per_layer_raw" if ci == 0 else "per_layer_combined": Tensor((1, T, ple_width)),
        }
        if SLIDING in spec.layer_types:
            ins["cos_s"] = ins["sin_s"] = Tensor((1, 1, T, spec.head_dim_of(SLIDING)))
        ins["cos_f"] = ins["sin_f"] = Tensor((1, 1, T, spec.head_dim_of(FULL)))
        lo, hi = self.spans[ci]
        if any(spec.owns_cache(i) for i in range(lo, hi)):
            ins["current_pos"] = ins["ring_pos"] = Tensor((1,), I32)
        return ins

    def cache_tensor(self, layer: int) -> Tensor:
        """A producer's whole K (or V) cache as it passes to a later chunk: the ring, or the full context."""
        spec = self.spec
        if spec.is_sliding(layer):
            return Tensor((1, spec.kv_heads_of(SLIDING), self.ring, spec.head_dim_of(SLIDING)))
        return Tensor((1, spec.kv_heads_of(FULL), self.context, spec.head_dim_of(FULL)))


def _hidden_outputs(spec: ModelSpec, ci: int, T: int, ple_width: int) -> dict:
    outs = {"hidden_states_out": Tensor((1, T, spec.hidden_size))}
    if ci == 0:  # chunk_1 combines the PLE once for all chunks
        outs["per_layer_combined_out"] = Tensor((1, T, ple_width))
    return outs


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """--split "a,b,...": the N-1 layer boundaries of N chunks."""
    if text is None:
        return None
    try:
        split = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--split {text!r}: expected layer indices 'a,b[,c...]' (chunk_2 starts at a, chunk_3 at b, ...)"
        ) from None
    return split


# -- sizing chunks ---------------------------------------------------------------------------------------------


def _layer_params(spec: ModelSpec, i: int) -> tuple[int, int]:
    """(projection weights, other weights) of layer i: the projections are palettized, norms and scalars not."""
    H, D, nh, kvh, P = spec.hidden_size, spec.head_dims[i], spec.num_heads, spec.kv_heads[i], spec.per_layer_dim
    proj = 2 * H * nh * D + 3 * H * spec.intermediate_sizes[i] + 2 * H * P
    other = 5 * H + D + 1  # 5 layer norms of H, q_norm
    if spec.owns_cache(i):
        proj += H * kvh * D * (1 if spec.k_eq_v[i] else 2)
        other += D
    return proj, other


def chunk_weight_bytes(spec: ModelSpec, layers, computes_ple: bool, has_head: bool, bits: int) -> int:
    """The weights a chunk stores: projections at `bits` (16: fp16), the rest fp16. Palettization's lookup tables
    (16 fp16 entries per group of 32 rows at 4 bits) are counted too, so this is within a few % of the package."""
    proj = other = 0
    for i in layers:
        p, o = _layer_params(spec, i)
        proj, other = proj + p, other + o
    if computes_ple:
        proj += spec.hidden_size * spec.per_layer_total
        other += spec.per_layer_dim
    if has_head:
        proj += spec.vocab_size * spec.hidden_size
        other += spec.hidden_size
    if bits >= 16:
        return 2 * (proj + other)
    lut = proj // spec.hidden_size // 32 * 2**bits * 2  # ~ one LUT of 2^bits fp16 per 32 output channels
    return proj * bits // 8 + lut + 2 * other


def split_for_budget(spec: ModelSpec, max_chunk_mb: float, bits: int) -> tuple[int, ...]:
    """The fewest chunks whose weights each fit `max_chunk_mb` (MB = 10^6 bytes) at `bits`, the largest chunk as
    small as it can then be, with the last chunk holding only KV-shared layers (`_check_split`). ConfigError names
    the layer that cannot fit."""
    if isinstance(max_chunk_mb, bool) or not isinstance(max_chunk_mb, (int, float)) or max_chunk_mb <= 0:
        raise ConfigError(f"--max-chunk-mb {max_chunk_mb!r}: must be a positive number of MB")
    L, first, budget = spec.num_layers, spec.first_shared_layer, max_chunk_mb * 1e6

    def size(lo: int, hi: int) -> int:
        return chunk_weight_bytes(spec, range(lo, hi), lo == 0, hi == L, bits)

    for i in range(L):
        alone = size(i, i + 1)
        if alone > budget:
            extra = " with the PLE projection" if i == 0 else " with the LM head" if i == L - 1 else ""
            raise ConfigError(
                f"--max-chunk-mb {max_chunk_mb:g}: layer {i}{extra} alone needs {alone / 1e6:.1f} MB at {bits} bits"
            )
    # best[hi] = (chunks, largest chunk, boundaries) covering layers [0, hi); the last chunk starts at >= first
    best: dict[int, tuple[int, int, tuple[int, ...]]] = {0: (0, 0, ())}
    for hi in range(1, L + 1):
        options = [
            (best[lo][0] + 1, max(best[lo][1], size(lo, hi)), best[lo][2] + ((lo,) if lo else ()))
            for lo in range(hi)
            if lo in best and size(lo, hi) <= budget and (hi < L or lo >= first)
        ]
        if options:
            best[hi] = min(options)
    if L not in best:  # a model without KV-shared layers: its last chunk would be the head alone
        raise ConfigError(
            f"--max-chunk-mb {max_chunk_mb:g}: no split fits; the last chunk keeps no state, and every layer "
            f"owns a KV cache (num_kv_shared_layers=0)"
        )
    return best[L][2]

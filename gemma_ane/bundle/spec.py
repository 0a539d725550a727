"""What the model is (ModelSpec), its drafter (AssistantSpec) and its vision tower (VisionSpec): plain
data derived from a Hugging Face config.json.

No torch, no transformers, so the runtime can use them too. Every rule here mirrors
`transformers.models.gemma4` (5.24); where a config asks for something the chunk graph cannot express,
`ConfigError` names the field. How the model is cut into Core ML chunks is `plan.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ..errors import ConversionError

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
            rms_norm_eps=_eps(get),
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
        return path, json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({e})") from None
    except RecursionError:  # the parser recurses once per level: a damaged file can nest past Python's stack
        raise ConfigError(f"{path}: not a readable JSON config (nested too deeply)") from None


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


def _eps(get) -> float:
    """rms_norm_eps, refused unless finite and > 0: a NaN or a negative one would otherwise surface as a converter's
    traceback, or as NaN logits."""
    eps = get("rms_norm_eps", float, 1e-6)
    if not 0 < eps < float("inf"):
        raise ConfigError(f"rms_norm_eps={eps!r}: must be a finite number > 0")
    return eps


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
            rms_norm_eps=_eps(get),
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

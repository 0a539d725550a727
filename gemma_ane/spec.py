"""What the model is (ModelSpec) and how it is cut into Core ML chunks (ChunkPlan).

Both are plain data derived from a Hugging Face config.json: no torch, no transformers, so the
runtime can use them too. Every rule here mirrors `transformers.models.gemma4` (5.23); where a
config asks for something the chunk graph cannot express, `ConfigError` names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SLIDING, FULL = "sliding_attention", "full_attention"


class ConfigError(ValueError):
    """A config (or an option) the converter cannot represent. The message names the field."""


def _number(value, field: str, kind=float):
    """value as int/float, or a ConfigError naming the field (JSON can hold anything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
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
    def from_pretrained(cls, src: str | Path) -> "ModelSpec":
        """A config.json path, or a directory holding one (checkpoint dir or bundle's hf_model/)."""
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
            config = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not a readable JSON config ({e})") from None
        try:
            return cls.from_config(config)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_config(cls, config: dict) -> "ModelSpec":
        if not isinstance(config, dict):
            raise ConfigError("config must be a JSON object")
        text = config.get("text_config", config)
        if not isinstance(text, dict):
            raise ConfigError("text_config must be a JSON object")
        mt = text.get("model_type", config.get("model_type"))
        if mt not in ("gemma4_text", "gemma4"):
            raise ConfigError(f"model_type={mt!r}: only Gemma 4 (gemma4 / gemma4_text) is supported")

        def get(name, kind=int, default=...):
            if name not in text or text[name] is None:
                if default is ...:
                    raise ConfigError(f"{name}: missing")
                return default
            value = text[name]
            ok = isinstance(value, bool) if kind is bool else (
                isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
            )
            if not ok:
                raise ConfigError(f"{name}={value!r}: expected {kind.__name__}")
            return kind(value)

        for name in ("enable_moe_block",):
            if get(name, bool, False):
                raise ConfigError(f"{name}=true: mixture-of-experts blocks are not supported by the chunk graph")
        bidir = text.get("use_bidirectional_attention")
        if bidir not in (None, False):
            raise ConfigError(f"use_bidirectional_attention={bidir!r}: only causal text attention is supported")
        if get("attention_bias", bool, False):
            raise ConfigError("attention_bias=true: Gemma 4 projections have no bias; unsupported")
        act = text.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh",):
            raise ConfigError(f"hidden_activation={act!r}: only gelu_pytorch_tanh is supported")

        hidden = get("hidden_size")
        n_layers = get("num_hidden_layers")
        n_heads = get("num_attention_heads")
        n_kv = get("num_key_value_heads")
        head_dim = get("head_dim")
        if min(hidden, n_layers, n_heads, n_kv, head_dim) <= 0:
            raise ConfigError("hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim must be > 0")

        layer_types = text.get("layer_types")
        if layer_types is None:  # transformers' default: 5 sliding, 1 full
            layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise ConfigError(f"layer_types: expected a list of {n_layers} entries")
        bad = [t for t in layer_types if t not in (SLIDING, FULL)]
        if bad:
            raise ConfigError(f"layer_types: unsupported attention type {bad[0]!r}")
        layer_types = list(layer_types)
        layer_types[-1] = FULL  # transformers forces the last layer to full attention

        # Full-layer head dims / kv heads: either explicit per_layer_config or the older
        # global_head_dim / num_global_key_value_heads pair, applied exactly as transformers does.
        k_eq_v_cfg = get("attention_k_eq_v", bool, False)
        head_dims, kv_heads = [head_dim] * n_layers, [n_kv] * n_layers
        plc = text.get("per_layer_config")
        if plc is not None:
            if not isinstance(plc, dict):
                raise ConfigError("per_layer_config: expected an object keyed by layer index")
            for key, overrides in plc.items():
                try:
                    idx = int(key)
                except (TypeError, ValueError):
                    raise ConfigError(f"per_layer_config: key {key!r} is not a layer index") from None
                if not 0 <= idx < n_layers or not isinstance(overrides, dict):
                    raise ConfigError(f"per_layer_config[{key!r}]: invalid layer index or entry")
                for name, value in overrides.items():
                    if name == "head_dim":
                        head_dims[idx] = _number(value, f"per_layer_config[{key!r}].head_dim", int)
                    elif name == "num_key_value_heads":
                        kv_heads[idx] = _number(value, f"per_layer_config[{key!r}].num_key_value_heads", int)
                    else:
                        raise ConfigError(f"per_layer_config[{key!r}].{name}: per-layer override not supported")
        else:
            gdim = get("global_head_dim", int, 512)
            g_kv = text.get("num_global_key_value_heads")
            for i, t in enumerate(layer_types):
                if t == FULL:
                    head_dims[i] = gdim
                    if k_eq_v_cfg and g_kv is not None:
                        kv_heads[i] = _number(g_kv, "num_global_key_value_heads", int)
        for i in range(n_layers):
            if head_dims[i] <= 0 or kv_heads[i] <= 0:
                raise ConfigError(f"layer {i}: head_dim and num_key_value_heads must be > 0")
            if n_heads % kv_heads[i]:
                raise ConfigError(f"layer {i}: num_attention_heads={n_heads} is not a multiple of its {kv_heads[i]} KV heads")
            if head_dims[i] % 2:
                raise ConfigError(f"layer {i}: head_dim={head_dims[i]} must be even for RoPE")
        for t in set(layer_types):
            dims = {head_dims[i] for i in range(n_layers) if layer_types[i] == t}
            if len(dims) > 1:
                raise ConfigError(f"per_layer_config: layers of type {t} have different head dims {sorted(dims)}")

        # KV sharing, derived as Gemma4TextConfig.kv_sharing_modes: the last `num_kv_shared_layers`
        # layers reuse the K/V of the last non-shared layer of their own type.
        n_shared = get("num_kv_shared_layers", int, 0)
        if not 0 <= n_shared < n_layers:
            raise ConfigError(f"num_kv_shared_layers={n_shared}: must be in [0, {n_layers})")
        first_shared = n_layers - n_shared
        kv_source = list(range(n_layers))
        for i in range(first_shared, n_layers):
            owners = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
            if not owners:
                raise ConfigError(
                    f"num_kv_shared_layers={n_shared}: layer {i} ({layer_types[i]}) is KV-shared but no earlier layer of that type owns a cache"
                )
            kv_source[i] = owners[-1]
            if head_dims[i] != head_dims[owners[-1]] or kv_heads[i] != kv_heads[owners[-1]]:
                raise ConfigError(f"layer {i}: KV-shared layer's head shape differs from its producer {owners[-1]}")

        inter = get("intermediate_size")
        double = get("use_double_wide_mlp", bool, False)
        intermediate = [inter * (2 if double and i >= first_shared else 1) for i in range(n_layers)]
        k_eq_v = [k_eq_v_cfg and t == FULL for t in layer_types]

        # RoPE per layer type: default (all pairs) or proportional (partial_rotary_factor of the pairs).
        rope_params = text.get("rope_parameters") or {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
        rope = {}
        for t in sorted(set(layer_types)):
            p = rope_params.get(t) if isinstance(rope_params, dict) else None
            if not isinstance(p, dict) or "rope_theta" not in p:
                raise ConfigError(f"rope_parameters.{t}: missing or has no rope_theta")
            rtype = p.get("rope_type", "default")
            d = head_dims[layer_types.index(t)]
            if rtype == "default":
                pairs = d // 2
                if p.get("partial_rotary_factor", 1.0) != 1.0:
                    raise ConfigError(f"rope_parameters.{t}.partial_rotary_factor: only 'proportional' RoPE may be partial")
            elif rtype == "proportional":
                prf = _number(p.get("partial_rotary_factor", 1.0), f"rope_parameters.{t}.partial_rotary_factor")
                if not 0.0 <= prf <= 1.0:
                    raise ConfigError(f"rope_parameters.{t}.partial_rotary_factor={prf}: must lie in [0, 1]")
                pairs = int(prf * d // 2)
            else:
                raise ConfigError(f"rope_parameters.{t}.rope_type={rtype!r}: only 'default' and 'proportional' are supported")
            if _number(p.get("factor", 1.0), f"rope_parameters.{t}.factor") != 1.0:
                raise ConfigError(f"rope_parameters.{t}.factor: RoPE scaling is not supported")
            theta = _number(p["rope_theta"], f"rope_parameters.{t}.rope_theta")
            if theta <= 0:
                raise ConfigError(f"rope_parameters.{t}.rope_theta={theta}: must be > 0")
            rope[t] = Rope(theta=theta, rotated_pairs=pairs, dim=d)

        per_layer_dim = get("hidden_size_per_layer_input", int, 0)
        if per_layer_dim <= 0:
            raise ConfigError("hidden_size_per_layer_input: the chunk contract needs per-layer embeddings (PLE)")
        vocab = get("vocab_size")
        vocab_ple = get("vocab_size_per_layer_input", int, vocab)
        if vocab_ple != vocab:
            raise ConfigError(f"vocab_size_per_layer_input={vocab_ple}: must equal vocab_size={vocab}")
        if not get("tie_word_embeddings", bool, config.get("tie_word_embeddings", True)):
            raise ConfigError("tie_word_embeddings=false: the bundle's head is tied to the embedding table")

        eos = text.get("eos_token_id", config.get("eos_token_id", 1))
        eos = tuple(_number(e, "eos_token_id", int) for e in (eos if isinstance(eos, list) else [eos]))
        if not eos:
            raise ConfigError("eos_token_id: empty")
        softcap = text.get("final_logit_softcapping")
        window = get("sliding_window", int, 512)
        if window <= 0:
            raise ConfigError(f"sliding_window={window}: must be > 0")
        return cls(
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=n_heads,
            layer_types=tuple(layer_types),
            head_dims=tuple(head_dims),
            kv_heads=tuple(kv_heads),
            intermediate_sizes=tuple(intermediate),
            kv_source=tuple(kv_source),
            k_eq_v=tuple(k_eq_v),
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
            source=config,
        )

    def head_dim_of(self, layer_type: str) -> int:
        return self.head_dims[self.layer_types.index(layer_type)]

    def kv_heads_of(self, layer_type: str) -> int:
        return self.kv_heads[self.layer_types.index(layer_type)]


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
                f: {"inputs": {k: v.to_json() for k, v in io["inputs"].items()},
                    "outputs": {k: v.to_json() for k, v in io["outputs"].items()}}
                for f, io in self.functions.items()
            },
        }


def kv_name(layer: int, which: str) -> str:
    return f"kv{layer}_{which}"


@dataclass(frozen=True)
class ChunkPlan:
    spec: ModelSpec
    context: int
    prefill_batch: int
    split: tuple[int, int]
    chunks: tuple[Chunk, ...]

    @property
    def window(self) -> int:
        return min(self.spec.sliding_window, self.context)

    def to_json(self):
        return {
            "context": self.context,
            "prefill_batch": self.prefill_batch,
            "split": list(self.split),
            "chunks": [c.to_json() for c in self.chunks],
        }

    @staticmethod
    def default_split(spec: ModelSpec) -> tuple[int, int]:
        # The seeds' E2B split (0-7 / 8-24 / 25-34): halve the cache owners, halve the sharers.
        first = spec.first_shared_layer
        return math.ceil(first / 2), first + math.ceil(spec.num_kv_shared_layers / 2)

    @classmethod
    def build(cls, spec: ModelSpec, context: int = 2048, prefill_batch: int = 8,
              split: tuple[int, int] | None = None, head: str = "logits",
              kv_batches: tuple[int, ...] = ()) -> "ChunkPlan":
        """head="logits" (ours) or "token_id" (the upstream build's argmax head: greedy only).
        kv_batches: batch sizes of the KV-only prefill functions `prefill_kv_b{T}`."""
        if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
            raise ConfigError(f"context={context!r}: must be a positive integer")
        if context < spec.sliding_window:
            raise ConfigError(f"context={context}: must be at least the sliding window ({spec.sliding_window})")
        if context % 32:
            raise ConfigError(f"context={context}: must be a multiple of 32 (Core ML state dimensions)")
        for T in kv_batches:
            if isinstance(T, bool) or not isinstance(T, int) or T < 2 or spec.sliding_window % T:
                raise ConfigError(f"kv prefill batch {T!r}: must be an integer >= 2 that divides the window "
                                  f"({spec.sliding_window}), so aligned batches never wrap the ring")
        if head not in ("logits", "token_id"):
            raise ConfigError(f"head={head!r}: choose logits or token_id")
        if isinstance(prefill_batch, bool) or not isinstance(prefill_batch, int) or not 1 <= prefill_batch <= spec.sliding_window:
            raise ConfigError(f"prefill_batch={prefill_batch!r}: must be an integer in [1, sliding_window={spec.sliding_window}]")
        L, first = spec.num_layers, spec.first_shared_layer
        a, b = split if split is not None else cls.default_split(spec)
        if not 0 < a < b <= L:
            raise ConfigError(f"split={a},{b}: need 0 < a < b <= num_hidden_layers={L}")
        if b < first:
            raise ConfigError(
                f"split={a},{b}: layers {b}-{first - 1} own KV caches but would sit in the stateless last chunk; need b >= {first}"
            )
        if a >= first:
            raise ConfigError(f"split={a},{b}: chunk_2 would own no KV cache; need a < {first}")
        # chunk_2 hands its producers' caches to the later layers; a producer in chunk_1 would
        # leave KV-shared layers reading a state that lives in another model.
        for i in range(first, L):
            if spec.kv_source[i] < a:
                raise ConfigError(
                    f"split={a},{b}: KV-shared layer {i} reads layer {spec.kv_source[i]}, which would sit in chunk_1; need a <= {spec.kv_source[i]}"
                )

        W, C, D, H = spec.sliding_window, context, spec.cache_width, spec.hidden_size
        hd_s = spec.head_dim_of(SLIDING) if SLIDING in spec.layer_types else None
        hd_f = spec.head_dim_of(FULL)
        kvh_s = spec.kv_heads_of(SLIDING) if hd_s else None
        kvh_f = spec.kv_heads_of(FULL)
        PL = spec.per_layer_total
        producers = spec.producers

        def host_inputs(T, ple_name):
            ins = {
                "hidden_states": Tensor((1, T, H)),
                "causal_mask_full": Tensor((1, 1, T, C)),
                "causal_mask_sliding": Tensor((1, 1, T, W)),
                ple_name: Tensor((1, T, PL)),
            }
            if hd_s:
                ins["cos_s"] = Tensor((1, 1, T, hd_s))
                ins["sin_s"] = Tensor((1, 1, T, hd_s))
            ins["cos_f"] = Tensor((1, 1, T, hd_f))
            ins["sin_f"] = Tensor((1, 1, T, hd_f))
            return ins

        def kv_tensor(layer):
            if spec.is_sliding(layer):
                return Tensor((1, kvh_s, W, hd_s))
            return Tensor((1, kvh_f, C, hd_f))

        chunks = []
        bounds = [(0, a), (a, b), (b, L)]
        for ci, (lo, hi) in enumerate(bounds):
            layers = tuple(range(lo, hi))
            owners = [i for i in layers if spec.owns_cache(i)]
            sl = tuple(i for i in owners if spec.is_sliding(i))
            fl = tuple(i for i in owners if not spec.is_sliding(i))
            stateful = ci < 2
            states = {}
            if sl:
                states["kv_cache_sliding"] = Tensor((2 * len(sl), kvh_s, W, D))
            if fl:
                states["kv_cache_full"] = Tensor((2 * len(fl), kvh_f, C, D))
            functions = {}
            fnames = [("infer", 1), (f"prefill_b{prefill_batch}", prefill_batch)] if stateful else [("infer", 1)]
            for fname, T in fnames:
                ins = host_inputs(T, "per_layer_raw" if ci == 0 else "per_layer_combined")
                outs = {"hidden_states_out": Tensor((1, T, H))}
                if ci == 0:
                    outs["per_layer_combined_out"] = Tensor((1, T, PL))
                if stateful:
                    ins["current_pos"] = Tensor((1,), I32)
                    ins["ring_pos"] = Tensor((1,), I32)
                if ci == 1:  # the producers' whole caches go on to the stateless chunk
                    for p in producers:
                        outs[kv_name(p, "k")] = kv_tensor(p)
                        outs[kv_name(p, "v")] = kv_tensor(p)
                if ci == 2:
                    for p in producers:
                        ins[kv_name(p, "k")] = kv_tensor(p)
                        ins[kv_name(p, "v")] = kv_tensor(p)
                    outs = ({"logits": Tensor((1, 1, spec.vocab_size))} if head == "logits" else
                            {"token_id": Tensor((1,), I32), "token_logit": Tensor((1,))})
                functions[fname] = {"T": T, "inputs": ins, "outputs": outs}
            if stateful:
                # KV-only prefill: only the cache-owning layers, PLE only for them, sliding layers
                # attending over [ring as it was | the batch] before writing (SPEC §4 fixed).
                own = spec.first_shared_layer * spec.per_layer_dim
                for T in sorted(set(kv_batches), reverse=True):
                    ins = host_inputs(T, "per_layer_raw" if ci == 0 else "per_layer_combined")
                    ins[("per_layer_raw" if ci == 0 else "per_layer_combined")] = Tensor((1, T, own))
                    ins["causal_mask_sliding"] = Tensor((1, 1, T, W + T))
                    ins["current_pos"] = Tensor((1,), I32)
                    ins["ring_pos"] = Tensor((1,), I32)
                    outs = {"hidden_states_out": Tensor((1, T, H))}
                    if ci == 0:
                        outs["per_layer_combined_out"] = Tensor((1, T, own))
                    functions[f"prefill_kv_b{T}"] = {"T": T, "inputs": ins, "outputs": outs, "kv_only": True}
            chunks.append(Chunk(
                name=f"chunk_{ci + 1}", layers=layers, stateful=stateful, sliding_layers=sl, full_layers=fl,
                states=states, functions=functions, has_head=ci == 2, computes_ple=ci == 0,
            ))
        return cls(spec=spec, context=C, prefill_batch=prefill_batch, split=(a, b), chunks=tuple(chunks))


def parse_split(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--split {text!r}: expected two layer indices 'a,b' (chunk_2 starts at a, chunk_3 at b)") from None
    return a, b

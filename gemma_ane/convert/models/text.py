"""The Gemma 4 text decoder as the plan's Core ML-ready chunks (PyTorch).

Module and parameter names follow the checkpoint (`layers.8.self_attn.q_proj.weight`), so loading
is a plain state_dict copy. Everything is shaped for conversion to a static-shape ML Program that
runs on the ANE:
- batch 1, static T; positions, masks and RoPE rows arrive as inputs, so no position is baked in;
- KV caches are registered buffers (Core ML states), written by slice assignment at an int32
  input position and then read back whole: the program does one `slice_update` per cache write;
- every projection is an nn.Linear (palettizable, and the ANE's best op);
- RMSNorm divides by max|x| before squaring, because Gemma's residual stream is large enough for
  mean(x^2) to overflow fp16 (ops.py, shared with the drafter and the vision tower).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...bundle.plan import Chunk, ChunkPlan, kv_name
from ...bundle.spec import ModelSpec
from .load import load_module
from .ops import RMSNorm, rope


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        H, D, nh, kvh = spec.hidden_size, spec.head_dims[layer], spec.num_heads, spec.kv_heads[layer]
        self.head_dim, self.num_heads, self.kv_heads = D, nh, kvh
        self.q_proj = nn.Linear(H, nh * D, bias=False)
        self.q_norm = RMSNorm(D, spec.rms_norm_eps)
        self.owns_cache = spec.owns_cache(layer)
        self.k_eq_v = spec.k_eq_v[layer]
        if self.owns_cache:  # KV-shared layers have no K/V weights at all
            self.k_proj = nn.Linear(H, kvh * D, bias=False)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(H, kvh * D, bias=False)
            self.k_norm = RMSNorm(D, spec.rms_norm_eps)
            self.v_norm = RMSNorm(D, spec.rms_norm_eps, with_scale=False)
        self.o_proj = nn.Linear(nh * D, H, bias=False)

    def new_kv(self, x, cos, sin):
        """K, V for the rows of x, (1, kv_heads, T, D); K is rotated before it is cached."""
        T = x.shape[1]
        k_raw = self.k_proj(x).view(1, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v_raw = k_raw if self.k_eq_v else self.v_proj(x).view(1, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(self.k_norm(k_raw), cos, sin), self.v_norm(v_raw)

    def forward(self, x, cos, sin, k, v, mask):
        """x (1,T,H); k, v (1,kv_heads,S,D) already hold this step's rows; mask (1,1,T,S) additive."""
        T, D, g = x.shape[1], self.head_dim, self.num_heads // self.kv_heads
        q = self.q_proj(x).view(1, T, self.num_heads, D).transpose(1, 2)
        q = rope(self.q_norm(q), cos, sin)
        # Grouped heads become extra query rows of their KV head: one batched matmul per KV head
        # instead of materialising repeated K/V (the cache is the largest tensor the ANE reads).
        q = q.reshape(1, self.kv_heads, g * T, D)
        scores = torch.matmul(q, k.transpose(2, 3))  # Gemma 4 attention scale is 1.0
        scores = scores + (mask.repeat(1, 1, g, 1) if g > 1 else mask)
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)
        attn = attn.reshape(1, self.num_heads, T, D).transpose(1, 2).reshape(1, T, self.num_heads * D)
        return self.o_proj(attn)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        H, P, eps = spec.hidden_size, spec.per_layer_dim, spec.rms_norm_eps
        self.self_attn = Attention(spec, layer)
        self.mlp = MLP(H, spec.intermediate_sizes[layer])
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.per_layer_input_gate = nn.Linear(H, P, bias=False)
        self.per_layer_projection = nn.Linear(P, H, bias=False)
        self.post_per_layer_input_norm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, h, per_layer_input, cos, sin, k, v, mask):
        """x is the residual stream, h = input_layernorm(x) (the chunk derives K/V from it)."""
        x = x + self.post_attention_layernorm(self.self_attn(h, cos, sin, k, v, mask))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
        x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar


class ChunkModel(nn.Module):
    """One chunk of the plan. `forward(*inputs)` takes the plan's inputs in order and returns its
    outputs in order; the same module serves every T (the function is fixed by the traced shapes)."""

    def __init__(self, plan: ChunkPlan, chunk: Chunk):
        super().__init__()
        spec = plan.spec
        self.spec, self.chunk = spec, chunk
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec, i) for i in chunk.layers})
        if chunk.computes_ple:
            self.per_layer_model_projection = nn.Linear(spec.hidden_size, spec.per_layer_total, bias=False)
            self.per_layer_projection_norm = RMSNorm(spec.per_layer_dim, spec.rms_norm_eps)
        if chunk.has_head:
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        for name, t in chunk.states.items():
            self.register_buffer(name, torch.zeros(t.shape))
        self.use_function(next(iter(chunk.functions)))

    def use_function(self, function: str) -> None:
        """Select which of the chunk's functions forward() computes (and traces as)."""
        fn = self.chunk.functions[function]
        self.kv_only = fn.get("kv_only", False)
        self.every_row = fn.get("every_row", False)
        self.input_names = list(fn["inputs"])
        self.output_names = list(fn["outputs"])
        # a ladder's smaller rung (bundle.ladder) has its own, shorter full caches: buffers of its shapes to trace
        for name, t in fn.get("states", self.chunk.states).items():
            if tuple(getattr(self, name).shape) != t.shape:
                self.register_buffer(name, torch.zeros(t.shape, dtype=getattr(self, name).dtype))

    def reset_state(self):
        for name in self.chunk.states:
            getattr(self, name).zero_()

    def _write(self, layer: int, k, v, pos):
        """Cache this step's K/V rows of `layer` at slot `pos`, then return the whole cache of it.
        Sliding heads are zero-padded to the state width: one state holds both head sizes."""
        name, row = self.chunk.slot(layer)
        cache = getattr(self, name)
        # D and width from the plan, not from tensor shapes: the tracer records shapes as tensors,
        # and a branch on one would be baked in with a warning
        T, D, width = k.shape[2], self.spec.head_dims[layer], self.chunk.states[name].shape[-1]
        if D < width:
            pad = torch.zeros(1, k.shape[1], T, width - D, dtype=k.dtype)
            k, v = torch.cat([k, pad], dim=-1), torch.cat([v, pad], dim=-1)
        cache[row : row + 1, :, pos : pos + T, :] = k.to(cache.dtype)
        cache[row + 1 : row + 2, :, pos : pos + T, :] = v.to(cache.dtype)
        return self._read(layer, D)

    def _read(self, layer: int, D: int):
        name, row = self.chunk.slot(layer)
        cache = getattr(self, name)
        return cache[row : row + 1, :, :, :D], cache[row + 1 : row + 2, :, :, :D]

    def forward(self, *inputs):
        spec, chunk = self.spec, self.chunk
        x = dict(zip(self.input_names, inputs))
        h = x["hidden_states"]
        T = h.shape[1]
        P = spec.per_layer_dim
        # KV-only prefill keeps only what later tokens read: the caches of the owning layers.
        n_layers = spec.first_shared_layer if self.kv_only else spec.num_layers
        if chunk.computes_ple:
            # The context half of PLE: project the scaled embedding, normalise each layer's slice,
            # add the token's own PLE row and average the two (2^-1/2).
            weight = self.per_layer_model_projection.weight[: n_layers * P]
            proj = F.linear(h, weight) * spec.hidden_size**-0.5
            proj = self.per_layer_projection_norm(proj.view(1, T, n_layers, P))
            raw = x["per_layer_raw"].view(1, T, n_layers, P)
            per_layer = ((proj + raw) * 2**-0.5).view(1, T, n_layers * P)
        else:
            per_layer = x["per_layer_combined"]

        for key, layer in self.layers.items():
            i = int(key)
            if i >= n_layers:
                break
            sliding = spec.is_sliding(i)
            cos, sin = (x["cos_s"], x["sin_s"]) if sliding else (x["cos_f"], x["sin_f"])
            mask = x["causal_mask_sliding"] if sliding else x["causal_mask_full"]
            hn = layer.input_layernorm(h)
            src, attn = spec.kv_source[i], layer.self_attn
            if src == i:
                pos = x["ring_pos"] if sliding else x["current_pos"]
                k_new, v_new = attn.new_kv(hn, cos, sin)
                if self.kv_only and sliding:
                    # Attend over the ring as it was plus the batch itself, and only then write:
                    # writing first would evict slots earlier rows of the batch still need.
                    ring_k, ring_v = self._read(i, attn.head_dim)
                    k, v = torch.cat([ring_k, k_new], dim=2), torch.cat([ring_v, v_new], dim=2)
                    h_next = layer(h, hn, per_layer[:, :, i * P : (i + 1) * P], cos, sin, k, v, mask)
                    self._write(i, k_new, v_new, pos)
                    h = h_next
                    continue
                k, v = self._write(i, k_new, v_new, pos)
            elif src in chunk.layers:  # KV-shared layer whose producer ran earlier in this chunk
                k, v = self._read(src, attn.head_dim)
            else:  # producer lives in an earlier chunk: its caches arrive as inputs
                k, v = x[kv_name(src, "k")], x[kv_name(src, "v")]
            h = layer(h, hn, per_layer[:, :, i * P : (i + 1) * P], cos, sin, k, v, mask)

        if chunk.has_head:
            # verify_b{T} scores every row (each checks the draft after it); otherwise the last row alone
            normed = self.norm(h if self.every_row else h[:, -1:, :])
            logits = self.lm_head(normed)
            if spec.final_logit_softcapping is not None:
                cap = spec.final_logit_softcapping
                logits = torch.tanh(logits / cap) * cap
            if self.output_names[0] == "token_id":  # the published head: the argmax chosen in-graph
                value, index = logits.reshape(-1).max(dim=0, keepdim=True)
                return index.to(torch.int32), value
            # final_hidden: what the drafter continues from (bundles with an assistant)
            return (logits, normed) if "final_hidden" in self.output_names else (logits,)
        outs = [h]
        if chunk.computes_ple:
            outs.append(per_layer)
        if self.kv_only:
            return tuple(outs)
        for name in self.output_names[len(outs) :]:  # kv{p}_k / kv{p}_v: the producers' whole caches
            p, which = int(name[2:].split("_")[0]), name.rsplit("_", 1)[1]
            k, v = self._read(p, spec.head_dims[p])
            outs.append(k if which == "k" else v)
        return tuple(outs)


def load_chunk(
    plan: ChunkPlan, chunk: Chunk, ckpt, dtype=torch.float32, fp16_range: bool = False, scratch: Path | None = None
) -> ChunkModel:
    """Build a chunk straight in `dtype` and fill it from a Checkpoint by `load_module` (the LM head is the tied
    embedding). With fp16_range (conversion: the program stores fp16) a weight beyond fp16 is refused by name; with
    `scratch` the weights live in a mapped file there (load_module)."""
    model = load_module(
        lambda: ChunkModel(plan, chunk),
        ckpt,
        dtype=dtype,
        fp16_range=fp16_range,
        source=lambda name: "embed_tokens.weight" if name == "lm_head.weight" else name,
        skip=chunk.states,
        scratch=scratch,
    )
    with torch.no_grad():
        model.reset_state()
    return model.eval()


def build_chunks(plan: ChunkPlan, ckpt, dtype=torch.float32) -> list[ChunkModel]:
    with torch.no_grad():
        return [load_chunk(plan, c, ckpt, dtype) for c in plan.chunks]


class TorchChunk:
    """A ChunkModel as a `backend.ChunkBackend`: numpy in, numpy out. Its state is a dict of cache
    tensors that `predict` lends the module as its buffers, so the engine owns them as with Core ML."""

    def __init__(self, model: ChunkModel):
        self.model, self.name = model, model.chunk.name
        self.dtype = next(model.parameters()).dtype
        self.interfaces = {
            f: {
                "inputs": {k: v.to_json() for k, v in io["inputs"].items()},
                "outputs": {k: v.to_json() for k, v in io["outputs"].items()},
                "states": {k: v.to_json() for k, v in io.get("states", model.chunk.states).items()},
            }
            for f, io in model.chunk.functions.items()
        }

    def load(self, function: str) -> None:
        if function not in self.interfaces:
            # internal: the engine asks only for functions of the plan these interfaces were built from
            raise KeyError(f"{self.name} has no function {function!r}")

    def make_state(self, function: str = "infer") -> dict | None:
        states = self.interfaces[function]["states"]
        return {k: torch.zeros(t["shape"], dtype=self.dtype) for k, t in states.items()} if states else None

    def predict(self, function: str, inputs: dict, state) -> dict:
        if function not in self.interfaces:
            # internal: as in load; the engine runs only the functions it loaded
            raise KeyError(f"{self.name} has no function {function!r}")
        self.model.use_function(function)
        for name, cache in (state or {}).items():
            setattr(self.model, name, cache)  # a registered buffer: the in-place writes land in the state
        args = []
        for name in self.model.input_names:
            a = torch.from_numpy(np.ascontiguousarray(inputs[name]))
            args.append(a.to(torch.int32) if name in ("current_pos", "ring_pos") else a.to(self.dtype))
        with torch.no_grad():
            outs = self.model(*args)
        return {n: o.float().numpy() for n, o in zip(self.model.output_names, outs)}

    def read_state(self, state: dict, name: str) -> np.ndarray:
        return state[name].float().numpy()  # lossless from fp16/bf16; written back in the cache's dtype

    def write_state(self, state: dict, name: str, array: np.ndarray) -> None:
        state[name].copy_(torch.from_numpy(np.asarray(array, np.float32)))

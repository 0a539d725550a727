"""Gemma 4's drafter (Gemma4AssistantForCausalLM) as one stateless Core ML function, `draft` (PyTorch).

One draft step at position P (the last token's, whose own K/V the target has not computed yet):
x = pre_projection([target embedding of the token * sqrt(Hb); carry]), where carry is the target's final-norm
hidden state at P-1 for the first draft of a burst and the previous step's `carry_out` after that; four decoder
layers that own no K/V (each reads the target's producer cache of its type: chunk_2's `kv{p}_k/v` outputs); the
final norm; then `carry_out` = post_projection(h) and the head. Module and parameter names follow the checkpoint
(`model.layers.0.self_attn.q_proj.weight`), so loading is a state_dict copy.

Shaped for the ANE as the chunks are (models/text.py): static shapes, batch 1, T = 1; positions arrive as RoPE rows and
additive masks, so nothing position-dependent is baked in; the producers' whole caches come in as inputs and the
masks pick the rows (the sliding ring's W+1 newest positions, the full cache's 0..P-1), so there is no gather;
every projection is an nn.Linear (palettizable). The centroid head (use_ordered_embeddings) is split: the centroid
scores are a small matmul and stay in the graph, but the 4,096 embedding rows of the best clusters are a gather
from a 262,144-row table, which the ANE does badly, so the host does them (drafter.py) from int8 sidecars.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ...bundle.plan import Chunk, kv_name
from ...bundle.spec import FULL, SLIDING, AssistantSpec
from ..checkpoint import Checkpoint
from .load import load_module
from .ops import RMSNorm
from .text import MLP, Attention

FUNCTION = "draft"
SHORT = {SLIDING: "s", FULL: "f"}  # the RoPE inputs' suffixes, as the chunks name them (cos_s, cos_f)
MASKS = {SLIDING: "causal_mask_sliding", FULL: "causal_mask_full"}


def _attention(spec: AssistantSpec, layer: int) -> Attention:
    """graph.Attention of a KV-shared layer (q_proj, q_norm, o_proj; no K/V weights): every drafter layer is one,
    so the attention math is the target's, line for line."""

    shape = SimpleNamespace(  # the fields of ModelSpec that Attention reads
        hidden_size=spec.hidden_size,
        head_dims=spec.head_dims,
        num_heads=spec.num_heads,
        kv_heads=spec.kv_heads,
        rms_norm_eps=spec.rms_norm_eps,
        k_eq_v=(False,) * len(spec.layer_types),
        owns_cache=lambda i: False,
    )
    return Attention(shape, layer)


class DraftLayer(nn.Module):
    """graph.DecoderLayer without PLE (a drafter has none)."""

    def __init__(self, spec: AssistantSpec, layer: int):
        super().__init__()
        H, eps = spec.hidden_size, spec.rms_norm_eps
        self.self_attn = _attention(spec, layer)
        self.mlp = MLP(H, spec.intermediate_size)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, cos, sin, k, v, mask):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, k, v, mask))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class AssistantModel(nn.Module):
    """`forward(*inputs)` takes the package's inputs in order (draft_io) and returns its outputs in order."""

    def __init__(self, spec: AssistantSpec, package: Chunk):
        super().__init__()
        Ha, Hb = spec.hidden_size, spec.backbone_hidden_size
        self.spec, self.chunk = spec, package
        self.model = nn.Module()  # the checkpoint's `model.`: layers and final norm (its embedding is a sidecar)
        self.model.layers = nn.ModuleList(DraftLayer(spec, i) for i in range(len(spec.layer_types)))
        self.model.norm = RMSNorm(Ha, spec.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * Hb, Ha, bias=False)
        self.post_projection = nn.Linear(Ha, Hb, bias=False)
        if spec.num_centroids:
            self.masked_embedding = nn.Module()
            self.masked_embedding.centroids = nn.Linear(Ha, spec.num_centroids, bias=False)
        else:
            self.lm_head = nn.Linear(Ha, spec.vocab_size, bias=False)  # tied: model.embed_tokens.weight
        self.use_function(FUNCTION)

    def use_function(self, function: str) -> None:  # one function; coreml.trace_function asks for it by name
        io = self.chunk.functions[function]
        self.input_names, self.output_names = list(io["inputs"]), list(io["outputs"])

    def forward(self, *inputs):
        spec, x = self.spec, dict(zip(self.input_names, inputs))
        h = self.pre_projection(torch.cat([x["embedding"], x["carry"]], dim=-1))  # (1, 1, 2 Hb) -> (1, 1, Ha)
        for i, layer in enumerate(self.model.layers):
            t, src = spec.layer_types[i], spec.kv_source[i]
            s = SHORT[t]
            k, v = x[kv_name(src, "k")], x[kv_name(src, "v")]  # (1, kv_heads, R or C, D): the whole cache
            h = layer(h, x[f"cos_{s}"], x[f"sin_{s}"], k, v, x[MASKS[t]])
        h = self.model.norm(h)  # (1, 1, Ha): the head reads this, and so does post_projection
        carry = self.post_projection(h)  # (1, 1, Hb): the next draft step's carry
        if spec.num_centroids:
            return carry, self.masked_embedding.centroids(h), h
        return carry, self.lm_head(h)


def skeleton(spec: AssistantSpec, package: Chunk | None = None) -> AssistantModel:
    """The model laid out on the meta device: names and shapes, no memory, no random initialisation."""
    io = {FUNCTION: {"inputs": {}, "outputs": {}}}
    package = package or Chunk("assistant", (), False, (), (), {}, io, True, False)
    with torch.device("meta"):
        return AssistantModel(spec, package)


def load_assistant(
    ckpt: Checkpoint, spec: AssistantSpec, package: Chunk, dtype=torch.float32, fp16_range: bool = False
) -> AssistantModel:
    """Fill the model from the checkpoint (open_assistant's); with fp16_range a weight beyond fp16 is refused."""
    model = load_module(
        lambda: skeleton(spec, package),
        ckpt,
        dtype=dtype,
        fp16_range=fp16_range,
        source=lambda name: "model.embed_tokens.weight" if name == "lm_head.weight" else name,
    )
    return model.eval()

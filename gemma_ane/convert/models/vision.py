"""Gemma 4's vision tower as one stateless Core ML function, `encode` (PyTorch): the patch embedder, the encoder,
k x k pooling and the projection into the text model's embedding space, i.e. transformers'
`Gemma4Model.get_image_features` for one image at a fixed soft-token budget. Module and parameter names follow the
checkpoint (`model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight`), so loading is a state_dict copy.

Shaped for the ANE as the chunks are (models/text.py): batch 1, static shapes (budget * k^2 patches, padded, so one
compiled model serves every aspect ratio), every projection an nn.Linear, RMSNorm safe in fp16. Everything that
depends on where a patch lies arrives as an input computed by the host (`encoder.encoder_inputs`), as the chunks
get their RoPE rows and masks:
- the learned position embeddings are a lookup in a table of 2 x 10,240 rows: a gather, which the ANE does badly
  (int32 indices, a 15.7M-value table), or a one-hot matmul (3 GMAC and a (patches, rows) one-hot per axis). The
  host reads the rows instead, from a sidecar holding only the rows a budget can reach (budget * k per axis);
- the axial RoPE rows and the padding mask, from the positions;
- pooling: the host orders the patches cell by cell (each k x k cell's patches consecutive, cells row by row), so
  pooling is a reshape and a mean, with no position arithmetic in the graph. Attention does not care about the
  order of its tokens, and the cells come out in transformers' order; padding fills the cells after the image's.
The output holds the soft tokens first, then one row per padding cell, which the host drops.

Image soft tokens replace the image placeholders' embeddings as they are: NOT multiplied by sqrt(hidden_size) as
token embeddings are (Gemma4Model.forward's masked_scatter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...bundle.plan import Chunk, Tensor
from ...bundle.spec import VisionSpec
from ..checkpoint import Checkpoint
from .load import load_module
from .ops import RMSNorm

FUNCTION = "encode"
BOUNDS = ("input_min", "input_max", "output_min", "output_max")  # Gemma4ClippableLinear's buffers


def _clip(x, lo, hi):
    """Clamp by the finite bounds only (an infinite one would be an inf constant in the fp16 program); one MIL
    `clip` when both are finite."""
    if lo is not None and hi is not None:
        return x.clamp(lo, hi)
    x = x if lo is None else x.clamp_min(lo)
    return x if hi is None else x.clamp_max(hi)


class ClippableLinear(nn.Module):
    """transformers' Gemma4ClippableLinear: clamp the input, project, clamp the output. The bounds are checkpoint
    scalars, turned into Python numbers at load (`bounds`) so that tracing bakes them in as constants."""

    def __init__(self, fan_in: int, fan_out: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        for name in BOUNDS if clipped else ():
            self.register_buffer(name, torch.zeros(()))
        self.bounds = (None,) * 4

    def freeze_bounds(self) -> None:
        """A bound beyond fp16's range (transformers initialises them to +-inf) clamps nothing an fp16 program
        holds: it is left out."""
        if hasattr(self, BOUNDS[0]):
            self.bounds = tuple(None if abs(v) >= 65504 else v for v in (float(getattr(self, n)) for n in BOUNDS))

    def forward(self, x):
        lo, hi, out_lo, out_hi = self.bounds
        return _clip(self.linear(_clip(x, lo, hi)), out_lo, out_hi)


def quarter_rotation(D: int) -> torch.Tensor:
    """P with P @ x = [-b; a; -d; c] for a head x = [a; b; c; d] (quarters, along axis -2): rotate_half within each
    half. A matmul rather than slices and a concat: at E2B's head dim 64 a quarter is 16 values; P @ x is exact
    (one signed term per output)."""
    q, eye = D // 4, torch.eye(D // 4)
    P = torch.zeros(D, D)
    P[:q, q : 2 * q], P[q : 2 * q, :q], P[2 * q : 3 * q, 3 * q :], P[3 * q :, 2 * q : 3 * q] = -eye, eye, -eye, eye
    return P


def axial_rope(x, cos, sin, rotation):
    """Gemma 4's 2-D RoPE on heads laid out (1, heads, D, N): the first half of the head dim rotates by the x
    position, the second by y (the host's cos/sin columns hold both), each as rotate_half."""
    return x * cos + torch.matmul(rotation, x) * sin


class HeadNorm(RMSNorm):
    """graph.RMSNorm (same math, same names) over axis -2, the head dim of a (1, heads, D, N) layout: its
    statistics are then (1, heads, 1, N) rather than (1, heads, N, 1), whose singleton last axis the ANE pads 32x
    (audit.py's last-axis rule; 12 x 2520 values per norm at E2B's budget)."""

    def forward(self, x):
        m = x.abs().amax(-2, keepdim=True).clamp_min(1e-4)
        y = x / m
        r = self.sqrt_eps / m
        y = y * torch.rsqrt((y * y).mean(-2, keepdim=True) + r * r)
        return y * self.weight[:, None] if self.weight is not None else y


class VisionAttention(nn.Module):
    def __init__(self, s: VisionSpec):
        super().__init__()
        H, nh, D = s.hidden_size, s.num_heads, s.head_dim
        self.num_heads, self.head_dim = nh, D
        self.q_proj = ClippableLinear(H, nh * D, s.clipped)
        self.k_proj = ClippableLinear(H, nh * D, s.clipped)
        self.v_proj = ClippableLinear(H, nh * D, s.clipped)
        self.o_proj = ClippableLinear(nh * D, H, s.clipped)
        self.q_norm = HeadNorm(D, s.rms_norm_eps)
        self.k_norm = HeadNorm(D, s.rms_norm_eps)
        self.v_norm = HeadNorm(D, s.rms_norm_eps, with_scale=False)
        self.register_buffer("rotation", quarter_rotation(D), persistent=False)

    def forward(self, x, cos, sin, mask):
        """x (1, N, H); cos, sin (1, 1, D, N); mask (1, 1, 1, N) additive, blocking the padding patches."""
        N, nh, D = x.shape[1], self.num_heads, self.head_dim

        def heads(proj):  # (1, heads, D, N): see HeadNorm
            return proj(x).view(1, N, nh, D).permute(0, 2, 3, 1)

        q = axial_rope(self.q_norm(heads(self.q_proj)), cos, sin, self.rotation)
        k = axial_rope(self.k_norm(heads(self.k_proj)), cos, sin, self.rotation)
        v = self.v_norm(heads(self.v_proj))
        scores = torch.matmul(q.transpose(2, 3), k) + mask  # bidirectional; attention scale 1.0 (q, k normed)
        attn = torch.matmul(torch.softmax(scores, dim=-1), v.transpose(2, 3))  # (1, heads, N, D)
        return self.o_proj(attn.transpose(1, 2).reshape(1, N, nh * D))


class VisionMLP(nn.Module):
    def __init__(self, s: VisionSpec):
        super().__init__()
        self.gate_proj = ClippableLinear(s.hidden_size, s.intermediate_size, s.clipped)
        self.up_proj = ClippableLinear(s.hidden_size, s.intermediate_size, s.clipped)
        self.down_proj = ClippableLinear(s.intermediate_size, s.hidden_size, s.clipped)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, s: VisionSpec):
        super().__init__()
        H, eps = s.hidden_size, s.rms_norm_eps
        self.self_attn = VisionAttention(s)
        self.mlp = VisionMLP(s)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def encode_io(spec: VisionSpec, image_tokens: int) -> Chunk:
    """The package described as a chunk (what coreml.trace_function reads): one stateless function `encode`."""
    N, D = image_tokens * spec.pooling_kernel_size**2, spec.head_dim
    ins = {
        "pixel_values": Tensor((1, N, 3 * spec.patch_size**2)),
        "position_embeddings": Tensor((1, N, spec.hidden_size)),
        "cos": Tensor((1, 1, D, N)),
        "sin": Tensor((1, 1, D, N)),
        "attention_mask": Tensor((1, 1, 1, N)),
    }
    outs = {"image_embeds": Tensor((1, image_tokens, spec.text_hidden_size))}
    return Chunk("vision", (), False, (), (), {}, {FUNCTION: {"T": N, "inputs": ins, "outputs": outs}}, False, False)


class VisionModel(nn.Module):
    """`forward(*inputs)` takes encode_io's inputs in order and returns (image_embeds,) for `image_tokens` cells."""

    def __init__(self, spec: VisionSpec, image_tokens: int = 280):
        super().__init__()
        self.spec, self.image_tokens = spec, image_tokens
        self.chunk = encode_io(spec, image_tokens)
        self.vision_tower = nn.Module()
        self.vision_tower.patch_embedder = nn.Module()  # its position table is the host's (module doc)
        self.vision_tower.patch_embedder.input_proj = nn.Linear(3 * spec.patch_size**2, spec.hidden_size, bias=False)
        self.vision_tower.encoder = nn.Module()
        self.vision_tower.encoder.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(spec.num_layers))
        self.embed_vision = nn.Module()
        # transformers' pooler scales by sqrt(hidden) before this weightless norm: folded into its epsilon,
        # norm(s y) = norm_{eps/s^2}(y), because s y can pass fp16's range where y does not
        self.embed_vision.embedding_pre_projection_norm = RMSNorm(
            spec.hidden_size, spec.rms_norm_eps / spec.hidden_size, with_scale=False
        )
        self.embed_vision.embedding_projection = nn.Linear(spec.hidden_size, spec.text_hidden_size, bias=False)
        self.use_function(FUNCTION)

    def use_function(self, function: str) -> None:  # one function; coreml.trace_function asks for it by name
        self.input_names = list(self.chunk.functions[function]["inputs"])

    def forward(self, *inputs):
        x = dict(zip(self.input_names, inputs))
        k2, tower = self.spec.pooling_kernel_size**2, self.vision_tower
        h = tower.patch_embedder.input_proj(2 * (x["pixel_values"] - 0.5)) + x["position_embeddings"]
        for layer in tower.encoder.layers:
            h = layer(h, x["cos"], x["sin"], x["attention_mask"])
        pooled = h.view(1, self.image_tokens, k2, self.spec.hidden_size).mean(2)  # a cell's patches are consecutive
        embed = self.embed_vision
        return (embed.embedding_projection(embed.embedding_pre_projection_norm(pooled)),)


# -- the checkpoint ---------------------------------------------------------------------------------------------


def load_vision(ckpt: Checkpoint, spec: VisionSpec, image_tokens: int = 280, dtype=torch.float32, fp16_range=False):
    """A VisionModel filled from the checkpoint by `load_module`."""
    model = load_module(
        lambda: VisionModel(spec, image_tokens),
        ckpt,
        dtype=dtype,
        fp16_range=fp16_range,
        source=lambda name: "model." + name,
        any_value=BOUNDS,  # ClippableLinear.freeze_bounds leaves out those beyond fp16
    )
    with torch.no_grad():
        for m in model.modules():  # non-persistent buffers are not in the checkpoint
            if isinstance(m, VisionAttention):
                m.rotation.copy_(quarter_rotation(m.head_dim))
            elif isinstance(m, ClippableLinear):
                m.freeze_bounds()
    return model.eval()

"""Gemma 4's audio tower as one stateless, static-shape module (PyTorch): the subsampling convolutions, the
conformer layers (feed-forward, chunked local self-attention with relative positions, light convolution,
feed-forward), the output projection and the projection into the text model's embedding space, i.e.
transformers' `Gemma4Model.get_audio_features` for one clip of a fixed number of mel frames (a bucket). Module and
parameter names follow the checkpoint (`model.audio_tower.layers.0.self_attn.q_proj.linear.weight`), so loading
is a state_dict copy; what derives from weights alone (relative-position keys, query scales) is computed once at
load (`freeze`), in fp32.

Shaped for the ANE as vision.py is: batch 1, static shapes, every projection an nn.Linear, RMSNorm safe in fp16
(graph.RMSNorm). Choices, each where it is made below:
- one bucket of F mel frames (F a multiple of 4 x chunk): the clip's frames first, zero frames after, and a mask
  saying which are the clip's. The subsampling keeps F / 4 rows, whole attention blocks, so the sequence is
  never padded to blocks and cut back (transformers' pad and [:seq_length]); the host keeps the first
  `audio.soft_tokens(samples)` output rows.
- chunked attention without unfold or gather: with no right context and a left context of whole blocks (E2B:
  12-frame blocks, 12 frames back), a block's keys are the previous block(s) and itself, a concatenation of
  shifted copies of the blocked keys.
- relative positions without transformers' pad-reshape-slice shift: the relative keys depend only on weights, so
  `freeze` lays them out per (query row in block, key column), zeros where the shift puts zeros, and the position
  logits are one batched matmul.
- the mask is a constant of the geometry: no right context means a clip's frame never attends to a later one
  (nor does the causal light convolution look ahead), so the padding after the clip cannot reach its rows;
  only the subsampling convolutions (which look one frame ahead) need the clip's mask, and they take it as
  transformers does, zeroing masked frames before each convolution. The rows past the clip differ from
  transformers' (which masks their padded keys), and both drop them.
- blocked logits get -1e4 added rather than transformers' -1e9 fill: after the 50 softcap a logit is within
  +-50, so exp underflows to 0 either way, and -1e4 stays finite in fp16 (-1e9 is -inf there, and a row of -inf
  is NaN).
- `gradient_clipping` (E2B: 1e10) clamps nothing a model at fp16 range holds: left out at or above 65504.

Audio soft tokens replace the audio placeholders' embeddings as they are, like image soft tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...bundle.plan import Chunk, Tensor
from ...bundle.schema import audio_function
from ...errors import ConversionError
from ...runtime.audio import MEL_BINS
from .ops import RMSNorm
from .vision import BOUNDS, ClippableLinear

MASK_VALUE = -1e4
FP16_MAX = 65504.0


class AudioTowerError(ConversionError):
    """A config or checkpoint the audio tower cannot be built from; one line naming the field or tensor."""


@dataclass(frozen=True)
class AudioSpec:
    """What the graph needs of config.json's `audio_config` (and the text width it projects into)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    conv_channels: tuple[int, int]
    conv_kernel_size: int
    residual_weight: float
    chunk: int
    context_left: int
    logit_cap: float
    clipped: bool
    gradient_clipping: float
    rms_norm_eps: float
    output_proj_dims: int
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def past(self) -> int:  # transformers' max_past_horizon: keys a block's context reaches back
        return self.context_left - 1

    @property
    def context(self) -> int:  # keys per block: the past, then the block itself (no right context)
        return self.past + self.chunk

    @classmethod
    def from_config(cls, config: dict) -> AudioSpec | None:
        """From a multimodal config.json (None without an audio tower); refuses, naming the field, what the graph
        cannot express."""
        a = config.get("audio_config")
        if not a:
            return None
        try:
            spec = cls(
                hidden_size=a["hidden_size"],
                num_layers=a["num_hidden_layers"],
                num_heads=a["num_attention_heads"],
                conv_channels=tuple(a.get("subsampling_conv_channels", (128, 32))),
                conv_kernel_size=a.get("conv_kernel_size", 5),
                residual_weight=float(a.get("residual_weight", 0.5)),
                chunk=a.get("attention_chunk_size", 12),
                context_left=a.get("attention_context_left", 13),
                logit_cap=float(a.get("attention_logit_cap", 50.0)),
                clipped=bool(a.get("use_clipped_linears", True)),
                gradient_clipping=float(a.get("gradient_clipping", 1e10)),
                rms_norm_eps=a.get("rms_norm_eps", 1e-6),
                output_proj_dims=a.get("output_proj_dims", 1536),
                text_hidden_size=config["text_config"]["hidden_size"],
            )
        except KeyError as e:
            raise AudioTowerError(f"config.json: audio_config has no {e.args[0]}") from None
        refuse = {
            "attention_context_right": a.get("attention_context_right", 0) != 0,  # the constant mask (module doc)
            "attention_context_left": spec.past < spec.chunk or spec.past % spec.chunk != 0,  # whole past blocks
            "hidden_act": a.get("hidden_act", "silu") != "silu",
            "num_attention_heads": spec.hidden_size % spec.num_heads != 0,
            # the projection after the convolutions is (channels[0] // 4) * channels[1] wide in transformers, the
            # convolutions' output (mel bins // 4) * channels[1]: they agree only at 128 mel bins' width
            "subsampling_conv_channels": len(spec.conv_channels) != 2 or spec.conv_channels[0] != MEL_BINS,
        }
        for field, bad in refuse.items():
            if bad:
                raise AudioTowerError(f"config.json: audio_config.{field} = {a.get(field)!r} is not supported")
        return spec

    def check_frames(self, frames: int) -> None:
        if frames <= 0 or frames % (4 * self.chunk):
            raise AudioTowerError(f"frames {frames}: must be a positive multiple of {4 * self.chunk} (4 x chunk)")


def bucket_frames(valid_frames: int, chunk: int = 12) -> int:
    """The smallest bucket (mel frames, a multiple of 4 x chunk) holding `valid_frames`; 30 s (2999 frames) at
    E2B's chunk of 12 is 3024."""
    step = 4 * chunk
    return max(-(-valid_frames // step), 1) * step


def encode_io(spec: AudioSpec, buckets) -> Chunk:
    """The audio package described as a chunk (what coreml.trace_function reads): one stateless function per
    bucket of F mel frames (schema.audio_function names it), features and mask in, F / 4 rows out."""
    functions = {
        audio_function(F_, buckets): {
            "T": F_,
            "inputs": {"input_features": Tensor((1, F_, MEL_BINS)), "input_features_mask": Tensor((1, F_))},
            "outputs": {"audio_embeds": Tensor((1, F_ // 4, spec.text_hidden_size))},
        }
        for F_ in sorted(buckets)
    }
    return Chunk("audio", (), False, (), (), {}, functions, False, False)


# -- the model --------------------------------------------------------------------------------------------------


def _clamp(x, limit):
    return x if limit is None else x.clamp(-limit, limit)


class ChannelNorm(nn.Module):
    """transformers' LayerNorm over the channels (no bias) of a (1, C, T, W) convolution output, on axis 1 where
    the convolution leaves them, so no permute: the statistics are (1, 1, T, W), whose last axis is not a
    singleton (audit.py's last-axis rule). coremltools fuses it into one MIL layer_norm over axis 1."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x):
        d = x - x.mean(1, keepdim=True)
        return d * torch.rsqrt((d * d).mean(1, keepdim=True) + self.eps) * self.weight[:, None, None]


class SubSampleLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = ChannelNorm(c_out, eps)

    def forward(self, x, mask):
        """x (1, C, T, W), mask (1, 1, T, 1): masked frames zeroed before the convolution, which looks one frame
        ahead; -> (1, C', T/2, W/2)."""
        return torch.relu(self.norm(self.conv(x * mask)))


class SubSampleConvProjection(nn.Module):
    def __init__(self, s: AudioSpec):
        super().__init__()
        c0, c1 = s.conv_channels
        self.layer0 = SubSampleLayer(1, c0, s.rms_norm_eps)
        self.layer1 = SubSampleLayer(c0, c1, s.rms_norm_eps)
        self.input_proj_linear = nn.Linear((MEL_BINS // 4) * c1, s.hidden_size, bias=False)

    def forward(self, features, mask):
        """features (1, F, 128), mask (1, F) -> (1, F/4, hidden). Time is the convolutions' height, mel bins their
        width; each layer's output frame t is valid when its input frame 2t is (transformers' mask[:, ::2])."""
        h = self.layer0(features[:, None], mask[:, None, :, None])
        h = self.layer1(h, mask[:, None, ::2, None])
        # (width, channel) order. No shape is read from a tensor anywhere (a traced size is a dynamic op)
        return self.input_proj_linear(h.permute(0, 2, 3, 1).reshape(1, -1, self.input_proj_linear.in_features))


class FeedForward(nn.Module):
    def __init__(self, s: AudioSpec, clip):
        super().__init__()
        H = s.hidden_size
        self.ffw_layer_1 = ClippableLinear(H, 4 * H, s.clipped)
        self.ffw_layer_2 = ClippableLinear(4 * H, H, s.clipped)
        self.pre_layer_norm = RMSNorm(H, s.rms_norm_eps)
        self.post_layer_norm = RMSNorm(H, s.rms_norm_eps)
        self.scale, self.clip = s.residual_weight, clip

    def forward(self, x):
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(self.pre_layer_norm(_clamp(x, self.clip)))))
        return x + self.post_layer_norm(_clamp(h, self.clip)) * self.scale


def rel_shift(x: torch.Tensor, context: int) -> torch.Tensor:
    """transformers' Gemma4AudioAttention._rel_shift on (..., chunk, positions): pad to context + 1 columns,
    flatten the rows, keep chunk * context values, fold back. Used once, on weights, by `relative_keys`."""
    *lead, chunk, positions = x.shape
    x = F.pad(x, (0, context + 1 - positions)).reshape(*lead, chunk * (context + 1))
    return x[..., : chunk * context].reshape(*lead, chunk, context)


def sinusoids(positions: int, hidden: int) -> torch.Tensor:
    """transformers' Gemma4AudioRelPositionalEncoding: (positions, hidden) [sin | cos] of the distances
    positions - 1 .. 0, in that order."""
    n = hidden // 2
    inv = torch.exp(torch.arange(n) * -(math.log(10000.0) / max(n - 1, 1)))
    t = torch.arange(positions - 1, -1, -1)[:, None] * inv[None]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=-1)


class AudioAttention(nn.Module):
    def __init__(self, s: AudioSpec):
        super().__init__()
        H, nh, D, C = s.hidden_size, s.num_heads, s.head_dim, s.chunk
        self.spec = s
        self.q_proj = ClippableLinear(H, H, s.clipped)
        self.k_proj = ClippableLinear(H, H, s.clipped)
        self.v_proj = ClippableLinear(H, H, s.clipped)
        self.post = ClippableLinear(H, H, s.clipped)
        self.relative_k_proj = nn.Linear(H, H, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(D))
        # filled by freeze(): (heads, chunk, D, context) position keys; (D,) query scale
        self.register_buffer("relative_keys", torch.zeros(nh, C, D, s.context), persistent=False)
        self.register_buffer("q_scale", torch.zeros(D), persistent=False)
        self.k_scale = math.log(1 + math.e) / math.log(2)

    @torch.no_grad()
    def freeze(self) -> None:
        """What depends on weights alone, in fp32 as transformers computes it: the query scale
        head_dim^-0.5 / ln 2 * softplus(per_dim_scale) / logit_cap, and the relative keys of the
        `context // 2 + 1` distances, shifted as transformers shifts the position logits. Shifting the keys
        instead of the logits is exact: the shift moves each (row, distance) logit to one (row, key column), or
        drops it, and so does it to the keys it is the dot product with; the columns it fills with zeros get zero
        keys."""
        s = self.spec
        nh, D, C, ctx = s.num_heads, s.head_dim, s.chunk, s.context
        w = self.relative_k_proj.weight.float()
        positions = (s.chunk + s.context_left - 1) // 2 + 1  # transformers' rel_pos_enc.context_size // 2 + 1
        keys = (sinusoids(positions, s.hidden_size) @ w.T).view(positions, nh, D)
        one_hot = torch.eye(positions).expand(C, positions, positions).permute(1, 0, 2)  # [p, row, p'] = p == p'
        where = rel_shift(one_hot, ctx)  # [p, row, column]: 1 where distance p lands
        self.relative_keys.copy_(torch.einsum("prc,phd->hrdc", where, keys))
        # 1 / logit_cap folded in too: the softcap's tanh(logits / cap) then reads the matmuls as they are, and
        # their fp16 sums are 50x further from overflowing
        self.q_scale.copy_(D**-0.5 / math.log(2) * F.softplus(self.per_dim_scale.float()) / s.logit_cap)

    def forward(self, x, mask):
        """x (1, T, H) with T a multiple of chunk; mask (1, blocks, chunk, context) additive."""
        s = self.spec
        nh, D, C = s.num_heads, s.head_dim, s.chunk

        def blocks(proj):  # (heads, blocks, chunk, D)
            return proj(x).view(-1, C, nh, D).permute(2, 0, 1, 3)

        q = blocks(self.q_proj) * self.q_scale
        k, v = blocks(self.k_proj) * self.k_scale, blocks(self.v_proj)

        def context(t):  # (heads, blocks, context, D): the past blocks' rows, then the block's own
            past = [F.pad(t, (0, 0, 0, 0, n, 0))[:, :-n] for n in range(s.past // C, 0, -1)]
            return torch.cat([*past, t], dim=2)

        content = torch.matmul(q, context(k).transpose(2, 3))  # (heads, blocks, chunk, context)
        position = torch.matmul(q.permute(0, 2, 1, 3), self.relative_keys).permute(0, 2, 1, 3)  # batched over rows
        logits = torch.tanh(content + position) * s.logit_cap + mask  # q carries 1 / logit_cap (freeze)
        attn = torch.matmul(torch.softmax(logits, dim=-1), context(v))  # (heads, blocks, chunk, D)
        return self.post(attn.permute(1, 2, 0, 3).reshape(1, -1, nh * D))


class CausalDepthwiseConv(nn.Module):
    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))  # depthwise_conv1d.weight
        self.pad, self.channels = kernel - 1, channels

    def forward(self, x):
        """x (1, C, T): each output frame from its own and the kernel - 1 earlier frames (zeros before t = 0)."""
        return F.conv1d(F.pad(x, (self.pad, 0)), self.weight, groups=self.channels)


class LightConv(nn.Module):
    def __init__(self, s: AudioSpec, clip):
        super().__init__()
        H = s.hidden_size
        self.linear_start = ClippableLinear(H, 2 * H, s.clipped)
        self.linear_end = ClippableLinear(H, H, s.clipped)
        self.depthwise_conv1d = CausalDepthwiseConv(H, s.conv_kernel_size)
        self.pre_layer_norm = RMSNorm(H, s.rms_norm_eps)
        self.conv_norm = RMSNorm(H, s.rms_norm_eps)
        self.clip = clip

    def forward(self, x):
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        h = self.depthwise_conv1d(h.transpose(1, 2)).transpose(1, 2)
        return x + self.linear_end(F.silu(self.conv_norm(_clamp(h, self.clip))))


class ConformerLayer(nn.Module):
    def __init__(self, s: AudioSpec):
        super().__init__()
        H, eps = s.hidden_size, s.rms_norm_eps
        self.clip = clip = None if s.gradient_clipping >= FP16_MAX else s.gradient_clipping
        self.feed_forward1 = FeedForward(s, clip)
        self.feed_forward2 = FeedForward(s, clip)
        self.self_attn = AudioAttention(s)
        self.lconv1d = LightConv(s, clip)
        self.norm_pre_attn = RMSNorm(H, eps)
        self.norm_post_attn = RMSNorm(H, eps)
        self.norm_out = RMSNorm(H, eps)

    def forward(self, x, mask):
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(_clamp(x, self.clip)), mask)
        x = x + self.norm_post_attn(_clamp(h, self.clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clamp(x, self.clip))


def block_mask(spec: AudioSpec, rows: int) -> torch.Tensor:
    """(1, blocks, chunk, context) additive: 0 where transformers' sliding window lets query row q see key j
    (0 <= q - j < context_left - 1, and j >= 0: keys before the clip are the blocked keys' zero padding), -1e4
    elsewhere."""
    C, nb = spec.chunk, rows // spec.chunk
    q = torch.arange(nb)[:, None, None] * C + torch.arange(C)[None, :, None]
    j = torch.arange(nb)[:, None, None] * C + torch.arange(spec.context)[None, None, :] - spec.past
    allowed = (j >= 0) & (q - j >= 0) & (q - j < spec.past)
    return torch.where(allowed, 0.0, MASK_VALUE)[None]


class AudioModel(nn.Module):
    """`forward(input_features (1, F, 128), input_features_mask (1, F) 1.0/0.0)` -> (audio_embeds
    (1, F/4, text hidden),): every row, the clip's first (the host keeps `audio.soft_tokens(samples)`)."""

    input_names = ("input_features", "input_features_mask")

    def __init__(self, spec: AudioSpec, frames: int):
        super().__init__()
        spec.check_frames(frames)
        self.spec, self.frames = spec, frames
        self.chunk = encode_io(spec, [frames])
        self.audio_tower = nn.Module()
        self.audio_tower.subsample_conv_projection = SubSampleConvProjection(spec)
        self.audio_tower.layers = nn.ModuleList(ConformerLayer(spec) for _ in range(spec.num_layers))
        self.audio_tower.output_proj = nn.Linear(spec.hidden_size, spec.output_proj_dims, bias=True)
        self.embed_audio = nn.Module()
        self.embed_audio.embedding_pre_projection_norm = RMSNorm(
            spec.output_proj_dims, spec.rms_norm_eps, with_scale=False
        )
        self.embed_audio.embedding_projection = nn.Linear(spec.output_proj_dims, spec.text_hidden_size, bias=False)
        self.register_buffer("mask", block_mask(spec, frames // 4), persistent=False)

    def use_function(self, function: str) -> None:
        """coreml.trace_function asks for the function it traces by name: this model's chunk has one, its bucket's
        (the package names it after the other buckets are known: convert/audio.py)."""
        if function not in self.chunk.functions:
            raise AudioTowerError(f"function {function!r}: this model's is {next(iter(self.chunk.functions))!r}")

    def forward(self, input_features, input_features_mask):
        tower, embed = self.audio_tower, self.embed_audio
        h = tower.subsample_conv_projection(input_features, input_features_mask)
        for layer in tower.layers:
            h = layer(h, self.mask)
        h = tower.output_proj(h)
        return (embed.embedding_projection(embed.embedding_pre_projection_norm(h)),)


# -- weights ----------------------------------------------------------------------------------------------------


def load_audio_tower(tensors: Mapping[str, np.ndarray], spec: AudioSpec, frames: int, dtype=torch.float32):
    """An AudioModel filled from `tensors` (checkpoint names from the top, `model.audio_tower.*` and
    `model.embed_audio.*`; a Checkpoint or a dict): laid out on the meta device, then each tensor copied in, its
    shape checked; then `freeze`."""
    with torch.device("meta"):
        model = AudioModel(spec, frames)
    model = model.to(dtype).to_empty(device="cpu")
    with torch.no_grad():
        for name, value in model.state_dict().items():  # these share the parameters' storage
            full = "model." + name
            if full not in tensors:
                raise AudioTowerError(f"tensor {full} missing")
            w = np.asarray(tensors[full], np.float32)
            if w.shape != tuple(value.shape):
                raise AudioTowerError(f"tensor {full} has shape {w.shape}, expected {tuple(value.shape)}")
            if not name.endswith(BOUNDS) and not np.isfinite(w).all():
                raise AudioTowerError(f"tensor {full}: NaN or infinite values")
            value.copy_(torch.from_numpy(w))
        for m in model.modules():  # non-persistent buffers are not in the checkpoint
            if isinstance(m, RMSNorm):
                m.sqrt_eps.fill_(m.eps**0.5)
            elif isinstance(m, ClippableLinear):
                m.freeze_bounds()
            elif isinstance(m, AudioAttention):
                m.freeze()
        model.mask.copy_(block_mask(spec, frames // 4))
    return model.eval()

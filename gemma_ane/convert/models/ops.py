"""The ANE-friendly ops every model here is built from: the scaled RMSNorm (safe in fp16 where Gemma's residual
stream would overflow a plain one) and the split-half RoPE rotation."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w, with the weight used as stored (no Gemma-3 `1 + w`).

    Written as y = x/m, y / sqrt(mean(y^2) + (sqrt(eps)/m)^2) with m = max|x|: identical in exact
    math, and in fp16 y^2 <= 1 cannot overflow where x^2 would (|x| > 256). The eps term is squared
    from sqrt(eps)/m because m^2 itself underflows fp16 for small m; both divisions are tensor by
    tensor, since a scalar-over-tensor traces to MIL `inverse`, which adds its own epsilon.
    """

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.register_buffer("sqrt_eps", torch.tensor([eps**0.5]), persistent=False)

    def forward(self, x):
        m = x.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        y = x / m
        r = self.sqrt_eps / m
        y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + r * r)
        return y * self.weight if self.weight is not None else y


def rope(x, cos, sin):
    """Split-half rotation (pairs i <-> i + d/2), as transformers' rotate_half."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin

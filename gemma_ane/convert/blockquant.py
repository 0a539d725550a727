"""Block-wise linear weight quantization (int4/int8, no zero point), as Core ML's iOS 18
`constexpr_blockwise_shift_scale` stores it: integers, and one fp16 scale per block of `group_size` weights along
the input axis of a [out, in] linear weight.

Why not the k-means LUT (`palettize.py`): a QAT checkpoint such as `gemma-4-E2B-it-qat-q4_0-unquantized` holds
weights trained to sit on llama.cpp's q4_0 grid (blocks of 32 inputs, integers -8..7 times one scale each). A LUT
shared by a group of output rows cannot hold every block's grid; one scale per block can, exactly, if the scale is
chosen as q4_0 chooses it: the block's largest-magnitude weight m maps to the most negative integer,
scale = m / -2^(bits-1) (negative when m is positive). A q4_0 block always holds that element at -8, so the division
by a power of two gives back its scale bit for bit, and every other weight rounds back to its integer (the bf16
rounding of a checkpoint's k * scale is at most |scale| / 64 away).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConversionError

BITS = (4, 8)


def quantize_blockwise(weight: np.ndarray, nbits: int = 4, group_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a [out, in] weight per block of `group_size` inputs.

    Returns (q int8 [out, in] with values in [-2^(nbits-1), 2^(nbits-1) - 1], scale fp16 [out, in // group_size]):
    weight ~= q * scale repeated along the input axis. The integers are rounded against the fp16 scale actually
    stored. An all-zero block gets scale 0 and integers 0."""
    if nbits not in BITS:
        raise ConversionError(f"nbits={nbits}: choose 4 or 8")
    w = np.asarray(weight, np.float32)
    if w.ndim != 2:
        raise ConversionError(f"weight has shape {w.shape}: expected [out, in]")
    out, cols = w.shape
    if group_size < 1 or cols % group_size:
        raise ConversionError(f"{cols} input channels are not divisible by group_size {group_size}")
    if not np.isfinite(w).all():
        raise ConversionError("weight has non-finite values")
    low, high = -(1 << (nbits - 1)), (1 << (nbits - 1)) - 1
    blocks = w.reshape(out, cols // group_size, group_size)
    at = np.abs(blocks).argmax(-1)[..., None]
    peak = np.take_along_axis(blocks, at, -1)[..., 0]  # signed: the most negative integer is spent on it
    scale = (peak / low).astype(np.float16)
    s = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s != 0, np.rint(blocks / np.where(s != 0, s, 1)), 0)
    return np.clip(q, low, high).astype(np.int8).reshape(out, cols), scale


def dequantize_blockwise(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q * scale in fp32, each scale repeated over its block of inputs (what constexpr_blockwise_shift_scale
    computes with no offset)."""
    q, scale = np.asarray(q), np.asarray(scale, np.float32)
    return q.astype(np.float32) * np.repeat(scale, q.shape[1] // scale.shape[1], axis=1)


def blockwise_weight(q: np.ndarray, scale: np.ndarray, nbits: int = 4, **op_args):
    """The MIL var that decompresses (q, scale) into the fp16 weight at load: `constexpr_blockwise_shift_scale`
    (iOS 18 opset) with int4 or int8 data and no offset. Called inside a program being built (a graph pass or
    `mb.program`); `op_args` go to the builder (name, before_op)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    if nbits not in BITS:
        raise ConversionError(f"nbits={nbits}: choose 4 or 8")
    data = np.asarray(q).astype(types.np_int4_dtype if nbits == 4 else np.int8)
    return mb.constexpr_blockwise_shift_scale(data=data, scale=np.asarray(scale, np.float16), **op_args)

"""The MIL executor's ops: each MIL op a saved ML Program may hold, as numpy computes it (`OPS`, by op type),
with MIL's own argument names. `mil.py` runs programs with them; this module knows nothing of programs."""

from __future__ import annotations

import numpy as np

from ..errors import DeviceError
from .program import NP_DTYPES


class ExecutionError(DeviceError, ValueError):
    """A program or an input the executor refuses; the message names the op, input or function."""


def var_dtype(var):
    """The numpy dtype of a program's var (of the tensor a state wraps)."""
    return NP_DTYPES[var.dtype]


def f32(a):
    return np.asarray(a, dtype=np.float32)


def _norm_axes(axes, rank):
    return tuple(int(a) % rank for a in np.atleast_1d(axes))


def _slices(shape, begin, end, stride, begin_mask, end_mask, squeeze_mask):
    rank = len(shape)
    stride = np.ones(rank, int) if stride is None else np.asarray(stride)
    out, squeeze = [], []
    for i in range(rank):
        b = None if (begin_mask is not None and begin_mask[i]) else int(begin[i])
        e = None if (end_mask is not None and end_mask[i]) else int(end[i])
        if squeeze_mask is not None and squeeze_mask[i]:
            idx = b if b is not None else 0
            out.append(slice(idx, idx + 1 if idx != -1 else None, 1))
            squeeze.append(i)
        else:
            out.append(slice(b, e, int(stride[i])))
    return tuple(out), tuple(squeeze)


def _lut_to_dense(indices, lut, vector_axis=None):
    if lut.shape[-1] != 1:
        raise ExecutionError("constexpr_lut_to_dense: vector palettization (VECTOR_SIZE > 1) is not supported")
    table = lut[..., 0]  # [groups per axis ..., palette]
    groups = []
    for axis, (n, g) in enumerate(zip(indices.shape, lut.shape[:-2])):
        shape = [1] * indices.ndim
        shape[axis] = n
        groups.append((np.arange(n) // (n // g)).reshape(shape))
    return table[tuple(groups) + (indices.astype(np.intp),)]


def _blockwise_shift_scale(data, scale, offset=None):
    def expand(t):
        for axis, (n, m) in enumerate(zip(data.shape, t.shape)):
            if n != m:
                t = np.repeat(t, n // m, axis=axis)
        return t

    x = data.astype(np.float32)
    if offset is not None:
        x = x - expand(np.asarray(offset, np.float32))
    return x * expand(np.asarray(scale, np.float32))


def _gelu(x, mode="EXACT"):
    x = f32(x)
    if mode == "TANH_APPROXIMATION":
        return 0.5 * x * (1 + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (x + np.float32(0.044715) * x**3)))
    if mode == "SIGMOID_APPROXIMATION":
        return x / (1 + np.exp(-1.702 * x))
    import math

    return 0.5 * x * (1 + np.vectorize(math.erf, otypes=[np.float32])(x / np.float32(np.sqrt(2))))


def _softmax(x, axis=-1):
    x = f32(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _reduce(fn):
    def op(x, axes=None, keep_dims=False):
        axes = None if axes is None else _norm_axes(axes, x.ndim)
        return fn(x, axes, keep_dims)

    return op


def _gather(x, indices, axis=0, batch_dims=0, validate_indices=False):
    if batch_dims:
        raise ExecutionError("gather: batch_dims > 0 is not supported")
    axis = int(axis) % x.ndim
    idx = np.asarray(indices).astype(np.int64)
    n = x.shape[axis]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise ExecutionError(f"gather: index out of range [{-n}, {n}) on axis {axis}")
    return np.take(x, np.where(idx < 0, idx + n, idx), axis=axis)


def _binary(f):
    return lambda x, y: f(x, y)  # ops take their inputs by name; numpy's ufuncs take them by position


def _slice_by_index(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    sl, squeeze = _slices(x.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)
    return np.squeeze(x[sl], axis=squeeze) if squeeze else x[sl]


def _slice_update(x, update, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None, inplace=False):
    sl, squeeze = _slices(x.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)
    out = x if inplace else x.copy()
    target = out[sl]
    upd = np.asarray(update, dtype=x.dtype)
    if squeeze:
        upd = np.expand_dims(upd, squeeze)
    if upd.shape != target.shape:
        raise ExecutionError(f"slice_update: update of shape {upd.shape} does not fit the slice {target.shape}")
    out[sl] = upd
    return out


def _split(x, num_splits=None, split_sizes=None, axis=0):
    axis = int(axis) % x.ndim
    if split_sizes is not None:
        return tuple(np.split(x, np.cumsum(split_sizes)[:-1], axis=axis))
    return tuple(np.split(x, int(num_splits), axis=axis))


def _pad(x, pad, mode="constant", constant_val=0.0):
    """MIL pad: `pad` holds (before, after) for each of the last len(pad) / 2 axes."""
    pad = np.asarray(pad, dtype=np.int64).reshape(-1, 2)
    widths = [(0, 0)] * (x.ndim - len(pad)) + [tuple(p) for p in pad]
    if mode == "constant":
        return np.pad(x, widths, mode="constant", constant_values=np.asarray(constant_val, x.dtype))
    modes = {"reflect": "reflect", "replicate": "edge"}
    if mode not in modes:
        raise ExecutionError(f"pad: mode {mode!r} is not supported")
    return np.pad(x, widths, mode=modes[mode])


def _conv(x, weight, bias=None, strides=None, pad_type="valid", pad=None, dilations=None, groups=1):
    """MIL conv over 1 or 2 spatial axes, (N, C_in, *spatial) x (C_out, C_in / groups, *kernel), in fp32: each
    output a dot product of a strided, dilated window with its group's kernels (an einsum over windows)."""
    x, w = f32(x), f32(weight)
    n_sp, groups = x.ndim - 2, int(groups)
    if n_sp not in (1, 2):
        raise ExecutionError(f"conv: {n_sp} spatial axes are not supported")
    strides = [1] * n_sp if strides is None else [int(v) for v in strides]
    dilations = [1] * n_sp if dilations is None else [int(v) for v in dilations]
    kernel = w.shape[2:]
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if pad_type == "custom":
        widths = [tuple(int(v) for v in p) for p in np.asarray(pad).reshape(n_sp, 2)]
    elif pad_type == "valid":
        widths = [(0, 0)] * n_sp
    elif pad_type in ("same", "same_lower"):
        widths = []
        for size, st, sp in zip(x.shape[2:], strides, span):
            total = max((-(-size // st) - 1) * st + sp - size, 0)
            small, big = total // 2, total - total // 2
            widths.append((small, big) if pad_type == "same" else (big, small))
    else:
        raise ExecutionError(f"conv: pad_type {pad_type!r} is not supported")
    x = np.pad(x, [(0, 0), (0, 0), *widths])
    axes = tuple(range(2, 2 + n_sp))
    win = np.lib.stride_tricks.sliding_window_view(x, span, axis=axes)  # (N, C, *positions, *span)
    win = win[
        (
            slice(None),
            slice(None),
            *(slice(None, None, st) for st in strides),
            *(slice(None, None, d) for d in dilations),
        )
    ]
    N, C = x.shape[:2]
    out_sp = win.shape[2 : 2 + n_sp]
    win = win.reshape(N, groups, C // groups, *out_sp, *kernel)
    w = w.reshape(groups, w.shape[0] // groups, C // groups, *kernel)
    sp, ks = "hw"[:n_sp], "ij"[:n_sp]
    y = np.einsum(f"ngc{sp}{ks},goc{ks}->ngo{sp}", win, w, optimize=True).reshape(N, -1, *out_sp)
    return y if bias is None else y + f32(bias).reshape(-1, *([1] * n_sp))


def _layer_norm(x, axes, gamma=None, beta=None, epsilon=1e-5):
    """MIL layer_norm over `axes`, in fp32; gamma and beta have the shape of those axes."""
    x = f32(x)
    axes = tuple(sorted(_norm_axes(axes, x.ndim)))
    d = x - x.mean(axis=axes, keepdims=True)
    y = d / np.sqrt((d * d).mean(axis=axes, keepdims=True) + np.float32(epsilon))
    shape = [x.shape[i] if i in axes else 1 for i in range(x.ndim)]
    if gamma is not None:
        y = y * f32(gamma).reshape(shape)
    return y if beta is None else y + f32(beta).reshape(shape)


_CAST = {
    "fp16": np.float16,
    "fp32": np.float32,
    "int32": np.int32,
    "bool": bool,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "uint16": np.uint16,
    "fp64": np.float64,
    "int64": np.int64,
}

# op type -> numpy implementation taking the op's inputs by name. Float math of the "compute"
# ops runs in fp32 and is rounded to the program's dtype after the op, which is what an fp16
# program means: fp16 storage between ops, wider accumulation inside them.
OPS = {
    **{
        name: _binary(f)
        for name, f in {
            "add": np.add,
            "sub": np.subtract,
            "mul": np.multiply,
            "real_div": np.divide,
            "maximum": np.maximum,
            "minimum": np.minimum,
            "pow": np.power,
            "floor_div": np.floor_divide,
            "mod": np.mod,
            "equal": np.equal,
            "not_equal": np.not_equal,
            "less": np.less,
            "less_equal": np.less_equal,
            "greater": np.greater,
            "greater_equal": np.greater_equal,
            "logical_and": np.logical_and,
            "logical_or": np.logical_or,
            "logical_xor": np.logical_xor,
        }.items()
    },
    "logical_not": lambda x: np.logical_not(x),
    "abs": lambda x: np.abs(x),
    "sign": lambda x: np.sign(x),
    "floor": lambda x: np.floor(x),
    "ceil": lambda x: np.ceil(x),
    "round": lambda x: np.round(x),
    "square": lambda x: np.square(x),
    "sqrt": lambda x: np.sqrt(f32(x)),
    "exp": lambda x: np.exp(f32(x)),
    "exp2": lambda x: np.exp2(f32(x)),
    "rsqrt": lambda x, epsilon=1e-12: 1 / np.sqrt(f32(x) + np.float32(epsilon)),
    "inverse": lambda x, epsilon=1e-4: 1 / (f32(x) + np.float32(epsilon)),
    "log": lambda x, epsilon=1e-45: np.log(f32(x) + np.float32(epsilon)),
    "tanh": lambda x: np.tanh(f32(x)),
    "sigmoid": lambda x: 1 / (1 + np.exp(-f32(x))),
    "relu": lambda x: np.maximum(x, 0),
    "sin": lambda x: np.sin(f32(x)),
    "cos": lambda x: np.cos(f32(x)),
    "clip": lambda x, alpha, beta: np.clip(x, alpha, beta),
    "gelu": _gelu,
    "softmax": _softmax,
    "silu": lambda x: f32(x) / (1 + np.exp(-f32(x))),
    "reduce_mean": _reduce(lambda x, a, k: np.mean(x, axis=a, keepdims=k, dtype=np.float32)),
    "reduce_sum": _reduce(lambda x, a, k: np.sum(x, axis=a, keepdims=k, dtype=np.float32)),
    "reduce_max": _reduce(lambda x, a, k: np.max(x, axis=a, keepdims=k)),
    "reduce_min": _reduce(lambda x, a, k: np.min(x, axis=a, keepdims=k)),
    "reduce_prod": _reduce(lambda x, a, k: np.prod(f32(x), axis=a, keepdims=k)),
    "reduce_sum_square": _reduce(lambda x, a, k: np.sum(f32(x) ** 2, axis=a, keepdims=k)),
    "reduce_l2_norm": _reduce(lambda x, a, k: np.sqrt(np.sum(f32(x) ** 2, axis=a, keepdims=k))),
    "reduce_l1_norm": _reduce(lambda x, a, k: np.sum(np.abs(f32(x)), axis=a, keepdims=k)),
    "reduce_log_sum_exp": _reduce(lambda x, a, k: np.log(np.sum(np.exp(f32(x)), axis=a, keepdims=k))),
    "reduce_argmax": lambda x, axis=-1, keep_dims=False, output_dtype="int32": np.argmax(
        x, axis=int(axis), keepdims=keep_dims
    ).astype(_CAST[output_dtype]),
    "reduce_argmin": lambda x, axis=-1, keep_dims=False, output_dtype="int32": np.argmin(
        x, axis=int(axis), keepdims=keep_dims
    ).astype(_CAST[output_dtype]),
    "matmul": lambda x, y, transpose_x=False, transpose_y=False: np.matmul(
        f32(x).swapaxes(-1, -2) if transpose_x else f32(x), f32(y).swapaxes(-1, -2) if transpose_y else f32(y)
    ),
    "concat": lambda values, axis, interleave=False: (
        np.concatenate(values, axis=int(axis))
        if not interleave
        else np.stack(values, axis=int(axis) % values[0].ndim + 1).reshape(
            *values[0].shape[: int(axis) % values[0].ndim], -1, *values[0].shape[int(axis) % values[0].ndim + 1 :]
        )
    ),
    "split": _split,
    "slice_by_index": _slice_by_index,
    "slice_by_size": lambda x, begin, size: x[
        tuple(slice(int(b), None if int(s) == -1 else int(b) + int(s)) for b, s in zip(begin, size))
    ],
    "slice_update": _slice_update,
    "gather": _gather,
    "gather_along_axis": lambda x, indices, axis=0, validate_indices=False: np.take_along_axis(
        x, np.asarray(indices).astype(np.int64), axis=int(axis)
    ),
    "reshape": lambda x, shape: np.reshape(x, tuple(int(s) for s in shape)),
    "transpose": lambda x, perm: np.transpose(x, tuple(int(p) for p in perm)),
    "expand_dims": lambda x, axes: np.expand_dims(x, tuple(int(a) for a in np.atleast_1d(axes))),
    "squeeze": lambda x, axes=None: np.squeeze(x, axis=None if axes is None else _norm_axes(axes, x.ndim)),
    "select": lambda cond, a, b: np.where(cond, a, b),
    "tile": lambda x, reps: np.tile(x, tuple(int(r) for r in reps)),
    "cast": lambda x, dtype: np.asarray(x).astype(_CAST[str(dtype)]),
    "identity": lambda x: x,
    "fill": lambda shape, value=0.0: np.full(tuple(int(s) for s in shape), value),
    "fill_like": lambda ref_tensor, value=0.0: np.full(np.shape(ref_tensor), value),
    "shape": lambda x: np.array(np.shape(x), np.int32),
    "range_1d": lambda start, end, step: np.arange(start, end, step),
    "cumsum": lambda x, axis=0, exclusive=False, reverse=False: _cumsum(x, int(axis), exclusive, reverse),
    "band_part": lambda x, lower=-1, upper=-1: _band_part(x, int(lower), int(upper)),
    "constexpr_lut_to_dense": _lut_to_dense,
    "constexpr_blockwise_shift_scale": _blockwise_shift_scale,
    "pad": _pad,
    "conv": _conv,
    "layer_norm": _layer_norm,
}


def _cumsum(x, axis, exclusive, reverse):
    y = np.flip(x, axis) if reverse else x
    out = np.cumsum(y, axis=axis)
    if exclusive:
        out = out - y
    return np.flip(out, axis) if reverse else out


def _band_part(x, lower, upper):
    rows, cols = x.shape[-2:]
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    keep = ((lower < 0) | (i - j <= lower)) & ((upper < 0) | (j - i <= upper))
    return np.where(keep, x, 0)

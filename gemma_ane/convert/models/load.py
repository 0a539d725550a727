"""The one way a model of ours is filled from a checkpoint: laid out on the meta device (names and shapes, no
memory, no random initialisation), given uninitialised CPU memory in the dtype asked for, then every tensor of
its state dict copied from the checkpoint tensor of its name, that tensor's shape checked against it and its
values finite (and within fp16 when the program will store fp16). At full size a model is gigabytes: no second
copy of its weights exists at any point, and a matrix is read in blocks of rows. With `scratch` the weights live
in a mapped scratch file instead of anonymous memory (scratch.py: the converter gives their pages back while
coremltools still holds views of them)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..checkpoint import Checkpoint, CheckpointError
from ..options import ConvertError
from ..scratch import MappedWeights
from .ops import RMSNorm

ROWS = 16384  # rows read at once: the LM head is 1.6 GB in fp32
FP16_MAX = 65504.0


def _same(name: str) -> str:
    return name


def checked_tensor(ckpt: Checkpoint, name: str, shape: tuple, fp16_range: bool, *, any_value: bool = False):
    """The whole tensor `name` as float32, after the loader's checks: a ConvertError naming the checkpoint and
    the tensor if it is missing, has another shape, or holds a value that is not finite (beyond fp16 with
    fp16_range), unless `any_value`."""
    _check_shape(ckpt, name, tuple(shape))
    w = _read(ckpt, name, 0, None)
    if not any_value:
        _check_values(ckpt, name, w, fp16_range)
    return w


def load_module(
    build: Callable[[], nn.Module],
    ckpt: Checkpoint,
    *,
    dtype=torch.float32,
    fp16_range: bool = False,
    source: Callable[[str], str] = _same,
    skip: Collection[str] = (),
    any_value: tuple[str, ...] = (),
    scratch: Path | None = None,
) -> nn.Module:
    """`build()` on the meta device, filled from `ckpt`: each state-dict entry but `skip`'s (states: not
    weights) from the checkpoint tensor `source(entry)` (checked as `checked_tensor` does; a name ending in one of
    `any_value` may hold any value), then each RMSNorm's non-persistent `sqrt_eps`. The caller sets up its
    other non-persistent buffers. With `scratch`, every tensor is placed in a MappedWeights file created there,
    kept as `model.scratch`, and each is dropped from memory once filled."""
    with torch.device("meta"):
        model = build().to(dtype)
    mapped = None
    if scratch is None:
        model = model.to_empty(device="cpu")
    else:
        tensors = [t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        mapped = MappedWeights(scratch, MappedWeights.size_of(tensors))
        model = model._apply(mapped.take)  # as to_empty does, with the file's tensors for empty ones
        model.scratch = mapped
    with torch.no_grad():
        for name, value in model.state_dict().items():  # these share the parameters' storage
            if name in skip:
                continue
            src = source(name)
            _check_shape(ckpt, src, tuple(value.shape))
            n = value.shape[0] if value.dim() >= 2 else 1
            rows = value.reshape(n, -1)
            for start in range(0, n, ROWS):
                block = _read(ckpt, src, start, start + ROWS) if n > 1 else _read(ckpt, src, 0, None)
                if not src.endswith(any_value):
                    _check_values(ckpt, src, block, fp16_range)
                block = torch.from_numpy(block.reshape(-1, rows.shape[1]))
                rows[start : start + len(block)] = block
            if mapped is not None:
                mapped.drop(value.numpy())
        for m in model.modules():  # non-persistent buffers are not in the checkpoint
            if isinstance(m, RMSNorm):
                m.sqrt_eps.fill_(m.eps**0.5)
    return model


def _check_shape(ckpt: Checkpoint, name: str, shape: tuple) -> None:
    found = ckpt.shape_of(name) if name in ckpt else None
    if found != shape:
        raise ConvertError(
            f"{ckpt.root}: tensor {name} " + ("missing" if found is None else f"has shape {found}, expected {shape}")
        )


def _read(ckpt: Checkpoint, name: str, start: int, stop: int | None) -> np.ndarray:
    try:
        return np.asarray(ckpt.rows(name, start, stop), np.float32)  # a bf16 scalar comes back as a numpy scalar
    except CheckpointError as e:
        raise ConvertError(str(e)) from None


def _check_values(ckpt: Checkpoint, name: str, w: np.ndarray, fp16_range: bool) -> None:
    # from the min and the max alone (a NaN anywhere makes both NaN): two reads, no temporaries
    lo, hi = (w.min(), w.max()) if w.size else (0.0, 0.0)
    if not (np.isfinite(lo) and np.isfinite(hi)) or (fp16_range and (lo < -FP16_MAX or hi > FP16_MAX)):
        raise ConvertError(f"{ckpt.root}: {name}: values beyond the float16 range")

"""The host's tables (CONTRACT §2): the int8 embedding sidecars read by row, their scales, the RoPE rows; the
small sidecars and .npy tables every one-function model adds. Written by the converter, read by the runtime."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import layout
from .errors import BundleError
from .host import dequantize_rows, rope_tables, rotated_pairs
from .spec import ModelSpec


@dataclass
class HostTables:
    """Everything the host contributes to a step: int8 tables (arrays or row readers) and RoPE rows."""

    embed_q: np.ndarray  # int8 [V, H]
    embed_scales: np.ndarray  # fp16 [V]
    ple_q: np.ndarray  # int8 [V, L*P]
    ple_scales: np.ndarray  # fp16 [V]
    embed_scale: float
    per_layer_embed_scale: float
    rope: dict  # layer type -> (cos [rows, D], sin [rows, D])

    def embed(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hidden_states (1,T,H), per_layer_raw (1,T,L*P)) in float32; only these rows are read."""
        ids = np.asarray(ids, dtype=np.int64)
        h = dequantize_rows(self.embed_q[ids], self.embed_scales[ids], self.embed_scale)
        ple = dequantize_rows(self.ple_q[ids], self.ple_scales[ids], self.per_layer_embed_scale)
        return h[None], ple[None]

    def rope_rows(self, layer_type: str, p0: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = self.rope[layer_type]
        return (
            np.asarray(cos[p0 : p0 + T], np.float32)[None, None],
            np.asarray(sin[p0 : p0 + T], np.float32)[None, None],
        )


def _check_size(path: Path, dtype, shape) -> None:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not path.is_file():
        raise BundleError(f"{path}: missing")
    if path.stat().st_size != expected:
        raise BundleError(
            f"{path}: {path.stat().st_size} bytes, expected {expected} for {tuple(shape)} {np.dtype(dtype).name}"
        )


class RowTable:
    """A [rows, cols] int8 sidecar read a row at a time with pread.

    Not mmap: on Linux a fault on a file mapping brings in a whole large folio (~2 MB here) per
    touched row, so resident memory would climb toward the 2.3 GB table as tokens vary. pread
    copies exactly the bytes of the rows a token uses, and nothing else stays resident."""

    def __init__(self, path: Path, dtype, shape):
        _check_size(path, dtype, shape)
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.row_bytes = self.shape[1] * self.dtype.itemsize
        self.fd = os.open(path, os.O_RDONLY)

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.atleast_1d(np.asarray(ids, np.int64))
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise BundleError(f"{self.path}: token id out of range [0, {self.shape[0]})")
        data = b"".join(os.pread(self.fd, self.row_bytes, int(i) * self.row_bytes) for i in ids)
        return np.frombuffer(data, self.dtype).reshape(len(ids), self.shape[1])

    def __array__(self, dtype=None, copy=None):  # the whole table (verification only)
        a = np.fromfile(self.path, self.dtype).reshape(self.shape)
        return a if dtype is None else a.astype(dtype)

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


def read_small(path: Path, dtype, shape) -> np.ndarray:
    _check_size(path, dtype, shape)
    return np.fromfile(path, dtype).reshape(shape)


def load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise BundleError(f"{path}: missing")
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise BundleError(f"{path}: not a valid .npy file ({e})") from None


def load_host(root: Path, config: dict) -> HostTables:
    """int8 tables read row by row (only the rows a token uses), their scales, RoPE tables."""
    root = Path(root)
    V, H = config["vocab_size"], config["hidden_size"]
    PL = config["num_hidden_layers"] * config["per_layer_dim"]
    rope = {}
    for layer_type in layout.ROPE_SHORT:
        cos, sin = (root / layout.rope_table(kind, layer_type) for kind in ("cos", "sin"))
        if cos.exists() or layer_type in config.get("layer_types", []):
            rope[layer_type] = (load_npy(cos), load_npy(sin))
    return HostTables(
        embed_q=RowTable(root / layout.EMBED_Q8, np.int8, (V, H)),
        embed_scales=read_small(root / layout.EMBED_SCALES, "<f2", (V,)),
        ple_q=RowTable(root / layout.PLE_Q8, np.int8, (V, PL)),
        ple_scales=read_small(root / layout.PLE_SCALES, "<f2", (V,)),
        embed_scale=float(config["embed_scale"]),
        per_layer_embed_scale=float(config["per_layer_embed_scale"]),
        rope=rope,
    )


def check_rope(root: Path, host: HostTables, context: int, exact: bool) -> None:
    """The published full-layer tables rotate all pairs, transformers only partial_rotary_factor
    of them (CONTRACT §4): detect it, warn once, and use tables computed from the config."""
    cfg_path = root / layout.HF_CONFIG
    if not cfg_path.is_file():
        return
    spec = ModelSpec.from_pretrained(cfg_path)
    for layer_type, (cos, sin) in list(host.rope.items()):
        allowed = spec.rope[layer_type].rotated_pairs
        if cos.shape[0] < context:
            raise BundleError(
                f"{root}: RoPE table for {layer_type} has {cos.shape[0]} rows, fewer than the context {context}"
            )
        probe = [1, min(1000, cos.shape[0] - 1)]  # row 0 is position 0: nothing rotates there
        found = rotated_pairs(np.asarray(cos[probe]), np.asarray(sin[probe]))
        if found > allowed:
            warnings.warn(
                f"{root}: {layer_type} RoPE tables rotate {found} pairs but the config allows {allowed} "
                f"(partial_rotary_factor); "
                + ("using exact tables computed from the config" if exact else "using them as they are"),
                stacklevel=4,
            )
            if exact:
                host.rope[layer_type] = rope_tables(spec, context)[layer_type]


def check_norm_sidecar(root: Path, config: dict) -> None:
    norm, P = Path(root) / layout.PLE_NORM, config["per_layer_dim"]
    if norm.is_file() and norm.stat().st_size not in (2 * P, 4 * P):
        # published builds store it as fp16 or fp32: tell the two apart by size, refuse anything else
        raise BundleError(f"{norm}: {norm.stat().st_size} bytes, expected {P} fp16 or fp32 values")


def save_npy(path: Path, array: np.ndarray) -> None:
    """A .npy table as load_npy reads it (format 1.0, no pickle)."""
    with open(path, "wb") as f:
        np.lib.format.write_array(f, np.ascontiguousarray(array), version=(1, 0), allow_pickle=False)

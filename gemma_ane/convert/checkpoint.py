"""Lazy, text-only reading of a Hugging Face Gemma 4 safetensors checkpoint.

The safetensors format is a JSON header plus raw little-endian arrays, so we read exactly the rows
asked for with pread instead of materialising shards: a tensor costs memory only while the caller
holds it, and the vision/audio towers of the multimodal checkpoint are never touched. Not mmap:
mapped pages that were read count in the process's resident memory until unmapped, so streaming
the 4.7 GB PLE table through a map would look like (and on a tight machine, act like) 4.7 GB held.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from ..bundle.spec import ModelSpec
from ..errors import ConversionError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I32": np.int32, "I64": np.int64}
# Text weights live under one of these prefixes; everything else (towers, embedders) is skipped.
_PREFIXES = ("model.language_model.", "model.")


class CheckpointError(ConversionError):
    """A checkpoint that cannot be read; the message names the file or tensor."""


def _read_header(path: Path) -> dict:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise CheckpointError(f"{path}: implausible safetensors header size {n}")
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, header alone needs {8 + n})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_end = 0
    for name, entry in header.items():
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            ok = isinstance(entry["dtype"], str) and all(int(d) >= 0 for d in entry["shape"]) and 0 <= begin <= end
        except (TypeError, ValueError, KeyError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: malformed safetensors header entry for tensor {name!r}")
        entry["offset"], entry["file_size"] = 8 + n, size
        data_end = max(data_end, end)
    # Checked against the header only (a stat, no data read), so a cut-off download is reported
    # up front, as safetensors itself does, instead of at the first tensor that happens to be missing.
    if 8 + n + data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes, its header describes {8 + n + data_end})"
        )
    return header


class Checkpoint:
    """`ckpt[name]` returns one text tensor as float32 (bf16/fp16 widened), read on demand.

    Names are relative to the language model: `layers.3.self_attn.q_proj.weight`.
    """

    def __init__(self, src: str | Path, spec: ModelSpec | None = None):
        self.root = Path(src)
        if not self.root.is_dir():
            raise CheckpointError(f"{src}: not a checkpoint directory")
        self.spec = spec or ModelSpec.from_pretrained(self.root)
        index = self.root / "model.safetensors.index.json"
        self.weight_map: dict | None = None
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
                self.weight_map = dict(weight_map)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: broken shard index ({type(e).__name__}: {e})") from None
            for f in files:
                if not isinstance(f, str) or "/" in f or f.startswith(".") or not (self.root / f).is_file():
                    raise CheckpointError(f"{index}: lists shard {f!r}, which is not in {self.root}")
        else:
            files = sorted(p.name for p in self.root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.root}: no *.safetensors weights (and no model.safetensors.index.json)")
        self.entries: dict[str, tuple[Path, dict]] = {}
        for f in files:
            path = self.root / f
            for name, entry in _read_header(path).items():
                if name in self.entries:
                    # Last-one-wins would silently pick between two different tensors.
                    raise CheckpointError(f"{self.root}: tensor {name} is in both {self.entries[name][0].name} and {f}")
                self.entries[name] = (path, entry)
        self.prefix = next((p for p in _PREFIXES if f"{p}embed_tokens.weight" in self.entries), None)
        if self.prefix is None:
            raise CheckpointError(
                f"{self.root}: no embed_tokens.weight under model.language_model. or model.: not a Gemma 4 checkpoint"
            )
        self._fds: dict[Path, int] = {}

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Every text tensor the graph needs, with its shape."""
        s = self.spec
        H, P = s.hidden_size, s.per_layer_dim
        out = {
            "embed_tokens.weight": (s.vocab_size, H),
            "embed_tokens_per_layer.weight": (s.vocab_size_per_layer_input, s.per_layer_total),
            "per_layer_model_projection.weight": (s.per_layer_total, H),
            "per_layer_projection_norm.weight": (P,),
            "norm.weight": (H,),
        }
        for i in range(s.num_layers):
            D, I, kvh = s.head_dims[i], s.intermediate_sizes[i], s.kv_heads[i]
            p = f"layers.{i}."
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
                "post_per_layer_input_norm",
            ):
                out[p + n + ".weight"] = (H,)
            out[p + "layer_scalar"] = (1,)
            out[p + "self_attn.q_proj.weight"] = (s.num_heads * D, H)
            out[p + "self_attn.q_norm.weight"] = (D,)
            out[p + "self_attn.o_proj.weight"] = (H, s.num_heads * D)
            if s.owns_cache(i):
                out[p + "self_attn.k_proj.weight"] = (kvh * D, H)
                out[p + "self_attn.k_norm.weight"] = (D,)
                if not s.k_eq_v[i]:
                    out[p + "self_attn.v_proj.weight"] = (kvh * D, H)
            out[p + "mlp.gate_proj.weight"] = (I, H)
            out[p + "mlp.up_proj.weight"] = (I, H)
            out[p + "mlp.down_proj.weight"] = (H, I)
            out[p + "per_layer_input_gate.weight"] = (P, H)
            out[p + "per_layer_projection.weight"] = (H, P)
        return out

    def _missing(self, full: str) -> CheckpointError:
        where = ""
        if self.weight_map is not None:
            shard = self.weight_map.get(full)
            where = (
                f" (model.safetensors.index.json puts it in {shard}, which does not hold it)"
                if shard
                else " (no shard of model.safetensors.index.json holds it)"
            )
        return CheckpointError(f"{self.root}: missing tensor {full}{where}")

    def validate(self) -> None:
        """Names, shapes, dtypes and byte extents of every text tensor; reads headers only."""
        for name, shape in self.expected().items():
            full = self.prefix + name
            if full not in self.entries:
                raise self._missing(full)
            path, entry = self.entries[full]
            if tuple(entry["shape"]) != shape:
                raise CheckpointError(f"{path.name}: tensor {full} has shape {tuple(entry['shape'])}, expected {shape}")
            if entry["dtype"] not in _DTYPES:
                raise CheckpointError(f"{path.name}: tensor {full} has unsupported dtype {entry['dtype']}")
            begin, end = entry["data_offsets"]
            if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[entry["dtype"]]).itemsize:
                raise CheckpointError(
                    f"{path.name}: tensor {full} has data_offsets inconsistent with its shape and dtype"
                )

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[self.prefix + name][1]["shape"])

    def dtype_of(self, name: str) -> str:
        return self.entries[self.prefix + name][1]["dtype"]

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.entries

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor as stored (bf16 as uint16 bits), read from the shard."""
        full = self.prefix + name
        if full not in self.entries:
            raise self._missing(full)
        path, entry = self.entries[full]
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path.name}: tensor {full} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        dtype = np.dtype(_DTYPES[entry["dtype"]]).newbyteorder("<")
        shape = entry["shape"]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or entry["offset"] + end > entry["file_size"]:
            raise CheckpointError(f"{path.name}: tensor {full} is truncated or its offsets are inconsistent")
        rows = shape[0] if shape else 1
        start, stop, _ = slice(start, stop).indices(rows)
        stop = max(start, stop)
        row_bytes = (count // rows if rows else 0) * dtype.itemsize
        data = self._read(path, entry["offset"] + begin + start * row_bytes, (stop - start) * row_bytes)
        return np.frombuffer(data, dtype=dtype).reshape([stop - start, *shape[1:]] if shape else [])

    def _read(self, path: Path, offset: int, nbytes: int) -> bytearray:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            n = os.preadv(self._fds[path], [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{path.name}: unexpected end of file at byte {offset + done}")
            done += n
        return buf

    def __getitem__(self, name: str) -> np.ndarray:
        return self.rows(name)

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor as float32; only those bytes of the shard are read."""
        arr = self.raw(name, start, stop)
        if self.dtype_of(name) == "BF16":
            # bf16 is the top half of a float32: widen by shifting the bits into place.
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(np.float32)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

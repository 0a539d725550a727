"""Reading saved ML Programs: a package's interface, its MIL program, and the static costs of a
function, through our own reader (`program.py`: protobuf and numpy, no coremltools package).

This stands on the saved artifact alone and never imports our graph code: what it reports is what
Core ML will load, not what we meant to write. Executing a program is `executor.py`'s job.
"""

from __future__ import annotations

import math
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BundleError
from ..files import tree_size
from .program import BITS, BlobError, ProgramError, inside, pb2, read_program, read_spec


class PackageError(BundleError):
    """A model package that cannot be read; the message names the file."""


_DTYPES = {"FLOAT16": "float16", "FLOAT32": "float32", "INT32": "int32", "DOUBLE": "float64"}
# The most a package's states may declare together: they are allocated whole at load (zeros), so the declared
# size is refused before any allocation. Ours: six times the largest Gemma 4 chunk's caches at its full 131072-token
# context (E4B's five full-attention owners in one chunk, ~2.7 GB).
MAX_STATE_BYTES = 2**34


def tensor_type(feature_type) -> dict:
    """{"shape": [ints], "dtype": numpy dtype name} of a model description's FeatureType: a
    multi-array, or the array a StateType wraps."""
    FeatureTypes_pb2 = pb2("FeatureTypes_pb2")
    t = feature_type
    arr = t.stateType.arrayType if t.WhichOneof("Type") == "stateType" else t.multiArrayType
    names = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.DESCRIPTOR.values_by_number
    if arr.dataType not in names:
        raise ProgramError(f"data type number {arr.dataType} (no Core ML array type)")
    shape = [int(d) for d in arr.shape]
    if any(d < 0 for d in shape):
        raise ProgramError(f"negative dimension in shape {shape}")
    dtype = names[arr.dataType].name
    return {"shape": shape, "dtype": _DTYPES.get(dtype, dtype.lower())}


def _state_bytes(states: dict) -> int:
    """What the declared states take once allocated (an element of a type numpy has no name for counted as 8 bytes,
    the widest, so nothing is undercounted)."""
    size = {"float16": 2, "float32": 4, "int32": 4, "float64": 8}
    return sum(math.prod(t["shape"]) * size.get(t["dtype"], 8) for t in states.values())


@dataclass
class Package:
    """A saved .mlpackage: its protobuf spec, and the MIL program with weights loaded lazily."""

    path: Path
    spec: object
    weights_dir: Path

    @classmethod
    def open(cls, path: str | Path) -> Package:
        path = Path(path)
        if path.suffix == ".mlmodelc":
            raise PackageError(
                f"{path}: compiled .mlmodelc programs cannot be read back here; "
                "keep the .mlpackage (convert --no-compile) to inspect or execute it"
            )
        if not (path / "Manifest.json").is_file():
            raise PackageError(f"{path}: not an .mlpackage (no Manifest.json)")
        try:
            spec = read_spec(path)
        except ProgramError as e:
            raise PackageError(f"{path}: {e}") from None
        except Exception as e:  # protobuf's, json's and the file system's errors are not one-line friendly
            raise PackageError(f"{path}: unreadable model spec ({type(e).__name__})") from None
        if spec.WhichOneof("Type") != "mlProgram":
            raise PackageError(f"{path}: not an ML Program")
        return cls(path, spec, path / "Data" / "com.apple.CoreML" / "weights")

    @property
    def function_names(self) -> list[str]:
        names = [f.name for f in self.spec.description.functions]
        return names or ["main"]

    @property
    def default_function(self) -> str:
        return self.spec.description.defaultFunctionName or self.function_names[0]

    def interface(self, function: str | None = None) -> dict:
        """{"inputs", "outputs", "states"}: name -> tensor_type, from the model description (a
        multifunction package describes each function under `description.functions`)."""
        function = function or self.default_function
        desc = self.spec.description
        if desc.functions:
            matches = [f for f in desc.functions if f.name == function]
            if not matches:
                raise PackageError(f"{self.path}: no function {function!r} (has {', '.join(self.function_names)})")
            desc = matches[0]
        io = {
            kind: {f.name: self._tensor_type(function, kind, f) for f in features}
            for kind, features in (("inputs", desc.input), ("outputs", desc.output), ("states", desc.state))
        }
        declared = _state_bytes(io["states"])
        if declared > MAX_STATE_BYTES:
            shapes = ", ".join(f"{n} {t['shape']} {t['dtype']}" for n, t in io["states"].items())
            raise PackageError(
                f"{self.path}: model.mlmodel, function {function!r}: states of {declared / 2**30:.4g} GiB ({shapes}), "
                f"more than a package's states may take ({MAX_STATE_BYTES / 2**30:g} GiB)"
            )
        return io

    def _tensor_type(self, function: str, kind: str, feature) -> dict:
        try:
            return tensor_type(feature.type)
        except ProgramError as e:
            where = f"function {function!r}, {kind[:-1]} {feature.name!r}"
            raise PackageError(f"{self.path}: model.mlmodel, {where}: {e}") from None

    def program(self):
        """The MIL program (all functions, `program.Program`), its constants read from the weight file."""
        try:
            return read_program(self.spec, self.weights_dir)
        except BlobError as e:  # a damaged weight file, which the spec (read at open) does not cover
            raise PackageError(f"{self.path}: weight file damaged ({e}); re-convert or run gemma-ane check") from None
        except ProgramError as e:
            raise PackageError(f"{self.path}: unreadable program in model.mlmodel ({e})") from None

    def check_files(self) -> None:
        """The weights folder and each file in it inside the package and regular, as program() would map them (the
        spec's own file was checked as open read it): what `check` asks without reading the weights."""
        folder = self.weights_dir
        if not folder.exists():
            return
        try:
            inside(folder, self.path, ProgramError, "Data/com.apple.CoreML/weights")
            for f in sorted(folder.iterdir()):
                inside(f, self.path, ProgramError, f"weights/{f.name}")
                if not stat.S_ISREG(f.stat().st_mode):
                    raise ProgramError(f"weights/{f.name}: not a regular file")
        except ProgramError as e:
            raise PackageError(f"{self.path}: {e}") from None
        except OSError as e:
            raise PackageError(f"{self.path}: weights: {e.strerror or type(e).__name__}") from None

    def size_bytes(self) -> int:
        return tree_size(self.path)


# -- static costs of a function, read off its ops -----------------------------------------------


def _bits(var) -> int:
    return BITS.get(var.dtype, 32)  # bool (no bit width in MIL's types) counted as 32, as before


def weight_bytes(function) -> int:
    """Bytes of every constant tensor the function holds, at its stored bit width (uint4 = 1/2)."""
    total = 0
    for op in function.operations:
        if op.op_type == "const":
            val = op.outputs[0].val
            if isinstance(val, np.ndarray) and val.size > 1:
                total += (val.size * _bits(op.outputs[0]) + 7) // 8
    return total


def macs(function) -> int:
    """Multiply-accumulates of one call: linear and matmul ops (everything else is O(activations))."""
    total = 0
    for op in function.operations:
        if op.op_type in ("linear", "matmul"):
            unknown = [p for p in ("x", "weight", "y") if p in op.inputs and None in op.inputs[p].shape]
            if unknown:
                p = unknown[0]
                raise ProgramError(f"op {op.name!r} ({op.op_type}): {p} of unknown dimension {op.inputs[p].shape}")
        if op.op_type == "linear":
            x, w = op.x.shape, op.weight.shape
            total += int(np.prod(x[:-1])) * w[0] * w[1]
        elif op.op_type == "matmul":
            x, y = list(op.x.shape), list(op.y.shape)
            if op.transpose_x.val:
                x[-1], x[-2] = x[-2], x[-1]
            if op.transpose_y.val:
                y[-1], y[-2] = y[-2], y[-1]
            batch = np.broadcast_shapes(tuple(x[:-2]), tuple(y[:-2]))
            total += int(np.prod(batch)) * x[-2] * x[-1] * y[-1]
    return total


def weight_formats(function) -> dict:
    """How the function stores its linear weights, read off the op producing each: {"formats": {format: count},
    "fp16": [names of weights of >= 2048 values left at fp16]} with formats "lut N-bit / G rows" (a k-means LUT per
    G output rows), "block intN / G inputs" (one scale per G inputs) and "fp16". Smaller weights are fp16 by design
    (the converter compresses only weights of >= 2048 values) and are counted, not named."""
    formats, fp16 = {}, []
    seen = set()
    for op in function.operations:
        if op.op_type != "linear" or op.weight.op is None or op.weight.op.name in seen:
            continue
        w = op.weight.op
        seen.add(w.name)
        if w.op_type == "constexpr_lut_to_dense":
            rows = w.outputs[0].shape[0] // w.lut.shape[0]
            kind = f"lut {_bits(w.indices)}-bit / {rows} rows"
        elif w.op_type == "constexpr_blockwise_shift_scale":
            inputs = w.outputs[0].shape[1] // w.scale.shape[1]
            kind = f"block int{_bits(w.data)} / {inputs} inputs"
        else:
            kind = "fp16" if _bits(w.outputs[0]) == 16 else f"{_bits(w.outputs[0])}-bit {w.op_type}"
            if np.prod(w.outputs[0].shape) >= 2048:
                fp16.append(w.name)
        formats[kind] = formats.get(kind, 0) + 1
    return {"formats": formats, "fp16": fp16}

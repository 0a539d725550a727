"""Reading saved ML Programs: the package's interface and its MIL program, through coremltools'
own protobuf and milproto loaders (which work on any OS).

This stands on the saved artifact alone and never imports our graph code: what it reports (and,
later, what it executes) is what Core ML will load, not what we meant to write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class PackageError(ValueError):
    """A model package that cannot be read; the message names the file."""


_DTYPES = {"FLOAT16": "float16", "FLOAT32": "float32", "INT32": "int32", "DOUBLE": "float64"}


def _array_type(t) -> dict:
    arr = t.stateType.arrayType if t.WhichOneof("Type") == "stateType" else t.multiArrayType
    from coremltools.proto import FeatureTypes_pb2

    dtype = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(arr.dataType)
    return {"shape": [int(d) for d in arr.shape], "dtype": _DTYPES.get(dtype, dtype.lower())}


@dataclass
class Package:
    """A saved .mlpackage: its protobuf spec, and the MIL program with weights loaded lazily."""

    path: Path
    spec: object
    weights_dir: Path

    @classmethod
    def open(cls, path: str | Path) -> "Package":
        import coremltools as ct

        path = Path(path)
        if path.suffix == ".mlmodelc":
            raise PackageError(f"{path}: compiled .mlmodelc programs cannot be read back here; "
                               "keep the .mlpackage (convert --no-compile) to inspect or execute it")
        manifest = path / "Manifest.json"
        if not manifest.is_file():
            raise PackageError(f"{path}: not an .mlpackage (no Manifest.json)")
        try:
            spec = ct.utils.load_spec(str(path))
        except Exception as e:  # protobuf's errors are not one-line friendly
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
        """{"inputs", "outputs", "states"}: name -> {"shape", "dtype"}, from the model description."""
        function = function or self.default_function
        desc = self.spec.description
        if desc.functions:
            matches = [f for f in desc.functions if f.name == function]
            if not matches:
                raise PackageError(f"{self.path}: no function {function!r} (has {', '.join(self.function_names)})")
            desc = matches[0]
        return {
            "inputs": {f.name: _array_type(f.type) for f in desc.input},
            "outputs": {f.name: _array_type(f.type) for f in desc.output},
            "states": {f.name: _array_type(f.type) for f in getattr(desc, "state", [])},
        }

    def program(self):
        """The pymil Program (all functions); weight files are read as ops are loaded."""
        from coremltools.converters.mil.frontend.milproto.load import load

        return load(self.spec, self.spec.specificationVersion, str(self.weights_dir))

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


# -- static costs of a function, read off its ops -----------------------------------------------

def _bits(var) -> int:
    from coremltools.converters.mil.mil import types

    dtype = var.dtype
    if types.is_tensor(var.sym_type):
        dtype = var.sym_type.get_primitive()
    return dtype.get_bitwidth() if hasattr(dtype, "get_bitwidth") else 32


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


def op_counts(function) -> dict:
    counts: dict[str, int] = {}
    for op in function.operations:
        counts[op.op_type] = counts.get(op.op_type, 0) + 1
    return counts


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{path}: unreadable JSON ({e})") from None


# ---------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------

class ExecutionError(ValueError):
    """A program or an input the executor refuses; the message names the op, input or function."""


def _np_dtype(builtin):
    from coremltools.converters.mil.mil import types

    if builtin is types.fp16:
        return np.dtype(np.float16)
    if builtin is types.fp32:
        return np.dtype(np.float32)
    if builtin is types.fp64:
        return np.dtype(np.float64)
    if builtin is types.bool:
        return np.dtype(bool)
    return np.dtype(types.nptype_from_builtin(builtin))


def _var_dtype(var):
    from coremltools.converters.mil.mil import types

    t = var.sym_type
    if types.is_state(t):
        t = t.wrapped_type()
    return _np_dtype(t.get_primitive() if types.is_tensor(t) else t)


def _f32(a):
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


def _linear_weight_only(var) -> bool:
    """Whether a var is used only as the weight of linear ops."""
    return bool(var.child_ops) and all(c.op_type == "linear" and c.inputs.get("weight") is var for c in var.child_ops)


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
    x = _f32(x)
    if mode == "TANH_APPROXIMATION":
        return 0.5 * x * (1 + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (x + np.float32(0.044715) * x**3)))
    if mode == "SIGMOID_APPROXIMATION":
        return x / (1 + np.exp(-1.702 * x))
    import math

    return 0.5 * x * (1 + np.vectorize(math.erf, otypes=[np.float32])(x / np.float32(np.sqrt(2))))


def _softmax(x, axis=-1):
    x = _f32(x)
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


_CAST = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "bool": bool, "int8": np.int8,
         "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16, "fp64": np.float64, "int64": np.int64}

# op type -> numpy implementation taking the op's inputs by name. Float math of the "compute"
# ops runs in fp32 and is rounded to the program's dtype after the op, which is what an fp16
# program means: fp16 storage between ops, wider accumulation inside them.
OPS = {
    **{name: (lambda f: lambda x, y: f(x, y))(f) for name, f in {
        "add": np.add, "sub": np.subtract, "mul": np.multiply, "real_div": np.divide,
        "maximum": np.maximum, "minimum": np.minimum, "pow": np.power, "floor_div": np.floor_divide,
        "mod": np.mod, "equal": np.equal, "not_equal": np.not_equal, "less": np.less,
        "less_equal": np.less_equal, "greater": np.greater, "greater_equal": np.greater_equal,
        "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor}.items()},
    "logical_not": lambda x: np.logical_not(x),
    "abs": lambda x: np.abs(x), "sign": lambda x: np.sign(x), "floor": lambda x: np.floor(x),
    "ceil": lambda x: np.ceil(x), "round": lambda x: np.round(x), "square": lambda x: np.square(x),
    "sqrt": lambda x: np.sqrt(_f32(x)), "exp": lambda x: np.exp(_f32(x)), "exp2": lambda x: np.exp2(_f32(x)),
    "rsqrt": lambda x, epsilon=1e-12: 1 / np.sqrt(_f32(x) + np.float32(epsilon)),
    "inverse": lambda x, epsilon=1e-4: 1 / (_f32(x) + np.float32(epsilon)),
    "log": lambda x, epsilon=1e-45: np.log(_f32(x) + np.float32(epsilon)),
    "tanh": lambda x: np.tanh(_f32(x)), "sigmoid": lambda x: 1 / (1 + np.exp(-_f32(x))),
    "relu": lambda x: np.maximum(x, 0), "sin": lambda x: np.sin(_f32(x)), "cos": lambda x: np.cos(_f32(x)),
    "clip": lambda x, alpha, beta: np.clip(x, alpha, beta),
    "gelu": _gelu, "softmax": _softmax, "silu": lambda x: _f32(x) / (1 + np.exp(-_f32(x))),
    "reduce_mean": _reduce(lambda x, a, k: np.mean(x, axis=a, keepdims=k, dtype=np.float32)),
    "reduce_sum": _reduce(lambda x, a, k: np.sum(x, axis=a, keepdims=k, dtype=np.float32)),
    "reduce_max": _reduce(lambda x, a, k: np.max(x, axis=a, keepdims=k)),
    "reduce_min": _reduce(lambda x, a, k: np.min(x, axis=a, keepdims=k)),
    "reduce_prod": _reduce(lambda x, a, k: np.prod(_f32(x), axis=a, keepdims=k)),
    "reduce_sum_square": _reduce(lambda x, a, k: np.sum(_f32(x) ** 2, axis=a, keepdims=k)),
    "reduce_l2_norm": _reduce(lambda x, a, k: np.sqrt(np.sum(_f32(x) ** 2, axis=a, keepdims=k))),
    "reduce_l1_norm": _reduce(lambda x, a, k: np.sum(np.abs(_f32(x)), axis=a, keepdims=k)),
    "reduce_log_sum_exp": _reduce(lambda x, a, k: np.log(np.sum(np.exp(_f32(x)), axis=a, keepdims=k))),
    "reduce_argmax": lambda x, axis=-1, keep_dims=False, output_dtype="int32": np.argmax(
        x, axis=int(axis), keepdims=keep_dims).astype(_CAST[output_dtype]),
    "reduce_argmin": lambda x, axis=-1, keep_dims=False, output_dtype="int32": np.argmin(
        x, axis=int(axis), keepdims=keep_dims).astype(_CAST[output_dtype]),
    "matmul": lambda x, y, transpose_x=False, transpose_y=False: np.matmul(
        _f32(x).swapaxes(-1, -2) if transpose_x else _f32(x), _f32(y).swapaxes(-1, -2) if transpose_y else _f32(y)),
    "concat": lambda values, axis, interleave=False: np.concatenate(values, axis=int(axis)) if not interleave
    else np.stack(values, axis=int(axis) % values[0].ndim + 1).reshape(
        *values[0].shape[:int(axis) % values[0].ndim], -1, *values[0].shape[int(axis) % values[0].ndim + 1:]),
    "split": _split,
    "slice_by_index": lambda x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None: (
        lambda sl_sq: np.squeeze(x[sl_sq[0]], axis=sl_sq[1]) if sl_sq[1] else x[sl_sq[0]])(
        _slices(x.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)),
    "slice_by_size": lambda x, begin, size: x[tuple(slice(int(b), None if int(s) == -1 else int(b) + int(s))
                                                    for b, s in zip(begin, size))],
    "slice_update": _slice_update,
    "gather": _gather,
    "gather_along_axis": lambda x, indices, axis=0, validate_indices=False: np.take_along_axis(
        x, np.asarray(indices).astype(np.int64), axis=int(axis)),
    "reshape": lambda x, shape: np.reshape(x, tuple(int(s) for s in shape)),
    "transpose": lambda x, perm: np.transpose(x, tuple(int(p) for p in perm)),
    "expand_dims": lambda x, axes: np.expand_dims(x, tuple(int(a) for a in np.atleast_1d(axes))),
    "squeeze": lambda x, axes=None: np.squeeze(x, axis=None if axes is None else tuple(int(a) for a in np.atleast_1d(axes))),
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


# ops whose numpy result may be a view of their input `x`
_VIEW_OPS = {"slice_by_index", "reshape", "transpose", "expand_dims", "squeeze", "identity", "split", "slice_by_size"}


class MILState:
    """The states of one package, zero-initialised from its declared StateTypes. Like a Core ML
    state it can be passed to every function of the package that created it."""

    def __init__(self, package_path: Path, arrays: dict):
        self.package_path, self.arrays = package_path, arrays

    def reset(self) -> None:
        for a in self.arrays.values():
            a[...] = 0


class MILModel:
    """Run one function of a saved ML Program, mirroring coremltools' MLModel:
    `MILModel(path, function_name=None)`, `make_state()`, `predict(inputs, state=state)`.

    precision="fp16" (default) keeps every tensor in the dtype the program declares and runs
    linear/matmul with fp32 accumulation; "fp32" computes every float in fp32, for diagnosis.
    Weights (including palettized ones) are decompressed once, at load.
    """

    def __init__(self, path, function_name: str | None = None, precision: str = "fp16", _package=None, _program=None,
                 _weights: dict | None = None):
        if precision not in ("fp16", "fp32"):
            raise ExecutionError(f"precision={precision!r}: choose fp16 or fp32")
        self.package = _package or Package.open(path)
        self.path = self.package.path
        self.function_name = function_name or self.package.default_function
        if self.function_name not in self.package.function_names:
            raise ExecutionError(f"{self.path}: no function {self.function_name!r} "
                                 f"(has {', '.join(self.package.function_names)})")
        self.precision = precision
        self.interface = self.package.interface(self.function_name)
        # functions of one package share their weights: keep one decompressed copy of each
        self._weights = _weights if _weights is not None else {}
        program = _program or self.package.program()
        self._compile(program.functions[self.function_name])

    # -- load time: resolve every var to a slot and every op to a closure --------------------------
    def _float(self, dtype):
        return np.dtype(np.float32) if (self.precision == "fp32" and dtype.kind == "f") else dtype

    def _compile(self, fn) -> None:
        slots: dict[str, int] = {}
        consts: list = []

        def slot(var) -> int:
            if var.name not in slots:
                slots[var.name] = len(slots)
                consts.append(None)
            return slots[var.name]

        self._inputs = {}
        self._state_inputs = {}
        from coremltools.converters.mil.mil import types

        for name, var in fn.inputs.items():
            if types.is_state(var.sym_type):
                self._state_inputs[name] = slot(var)
            else:
                self._inputs[name] = slot(var)
        ops = list(fn.operations)
        last_use: dict[str, int] = {}
        for i, op in enumerate(ops):
            for v in op.inputs.values():
                for var in (v if isinstance(v, (list, tuple)) else [v]):
                    last_use[var.name] = i
        for v in fn.outputs:
            last_use[v.name] = len(ops)

        # Alias analysis. numpy views (slices, reshapes, ...) share memory with their source, and
        # the executor writes KV caches in place; every var gets the "root" buffer it may share,
        # so a write in place is allowed only when nothing else rooted there is read afterwards.
        root = {name: ("state:" if name in self._state_inputs else "in:") + name for name in fn.inputs}
        members: dict[str, list[str]] = {}
        state_root = {name: "state:" + name for name in self._state_inputs}

        def set_root(var, r):
            root[var.name] = r
            members.setdefault(r, []).append(var.name)

        steps, kinds = [], []
        widened = []  # slots of weights that load consumes (decompressed, widened to fp32): dropped after it
        self.linear_ops = 0
        for i, op in enumerate(ops):
            kind = op.op_type
            own = "own:" + (op.outputs[0].name if op.outputs else op.name)
            if kind == "read_state":
                set_root(op.outputs[0], state_root[op.inputs["input"].name])
            elif kind in _VIEW_OPS and "x" in op.inputs and not isinstance(op.inputs["x"], (list, tuple)):
                for o in op.outputs:
                    set_root(o, root.get(op.inputs["x"].name, own))
            elif kind == "coreml_update_state":
                r = root.get(op.inputs["value"].name, own)
                if r.startswith(("in:", "const:")):  # never let a state become a caller's or a constant's buffer
                    r = own
                state_root[op.inputs["state"].name] = r
                set_root(op.outputs[0], r)
            elif kind == "slice_update":
                x = op.inputs["x"]
                r = root.get(x.name, "const:")
                inplace = (not r.startswith(("in:", "const:")) and last_use.get(x.name) == i
                           and all(last_use.get(v, -1) <= i for v in members.get(r, []) if v != x.name))
                set_root(op.outputs[0], r if inplace else own)
            else:
                for o in op.outputs:
                    set_root(o, "own:" + o.name)
            if kind == "const":
                val = op.outputs[0].val
                arr = np.asarray(val)
                consts[slot(op.outputs[0])] = arr.astype(self._float(arr.dtype)) if arr.dtype.kind == "f" else arr
                var = op.outputs[0]
                if var.child_ops and all(c.op_type.startswith("constexpr_") for c in var.child_ops) \
                        or _linear_weight_only(var):
                    # compressed weights and LUTs, or a dense weight: decompressed or widened at
                    # load (below), never read as such by a step
                    widened.append(slots[var.name])
                continue
            if kind not in OPS and kind not in ("read_state", "coreml_update_state", "linear"):
                raise ExecutionError(f"function {self.function_name!r}: op type {kind!r} is not implemented "
                                     f"by the MIL executor (op {op.name})")
            static, dynamic = {}, {}
            for name, v in op.inputs.items():
                if isinstance(v, (list, tuple)):
                    dynamic[name] = [slot(x) for x in v]
                elif v.op is not None and v.op.op_type == "const" or (v.val is not None and v.name not in slots):
                    val = v.val
                    # 0-d values (axes flags, epsilons, scalars) as Python scalars: numpy wants
                    # real bools for keepdims, and a Python scalar keeps the tensor's dtype.
                    static[name] = val.item() if isinstance(val, (np.ndarray, np.generic)) and np.ndim(val) == 0 else val
                else:
                    dynamic[name] = slot(v)
            outs = [slot(o) for o in op.outputs]
            out_dtypes = [self._float(_var_dtype(o)) for o in op.outputs]
            if kind.startswith("constexpr_") and not dynamic:
                # Decompress once: the result is a constant of the program's dtype. A weight that
                # only feeds linear ops is needed just long enough to be widened to fp32 (below),
                # and not at all when another function of the package already widened it.
                var = op.outputs[0]
                if not (_linear_weight_only(var) and (var.name, tuple(var.shape)) in self._weights):
                    consts[outs[0]] = np.asarray(OPS[kind](**static)).astype(out_dtypes[0])
                    if _linear_weight_only(var):
                        widened.append(outs[0])
                continue
            if kind == "slice_update":
                static["inplace"] = root[op.outputs[0].name] == root.get(op.inputs["x"].name)
            if kind == "coreml_update_state":
                static["adopt"] = root[op.outputs[0].name] == root.get(op.inputs["value"].name)
            steps.append(self._step(op, kind, static, dynamic, outs, out_dtypes, consts, slots, last_use, i))
            kinds.append(kind)
        for i in widened:
            consts[i] = None
        self._steps = steps
        self.step_kinds = kinds  # op type of each step, for profiling
        self._consts = consts
        self._outputs = {v.name: slots[v.name] for v in fn.outputs}
        # Core ML returns fresh arrays: copy outputs that share a state's buffer (or an input's).
        live = set(state_root.values())
        self._copy_outputs = {v.name for v in fn.outputs if root.get(v.name) in live or root.get(v.name, "").startswith("in:")}
        self._nslots = len(slots)
        missing = [n for n in self.interface["outputs"] if n not in self._outputs]
        if missing:
            raise ExecutionError(f"{self.path}: function {self.function_name!r} declares outputs {missing} its program lacks")

    def _step(self, op, kind, static, dynamic, outs, out_dtypes, consts, slots, last_use, index):
        out, dtype = outs[0], out_dtypes[0]
        if kind == "linear":
            weight = static.get("weight")
            if weight is None and dynamic.get("weight") is not None and consts[dynamic["weight"]] is not None:
                weight = consts[dynamic["weight"]]
            x = dynamic["x"]
            key = (op.inputs["weight"].name, tuple(op.inputs["weight"].shape))
            if weight is not None or key in self._weights:
                # Weights are constants: transposed and widened to fp32 once per package (functions
                # share them), so each call is one BLAS gemm.
                if key not in self._weights:
                    self._weights[key] = np.ascontiguousarray(_f32(weight).T)
                wt = self._weights[key]
                bias = static.get("bias")
                if bias is None and "bias" in dynamic:
                    bias = consts[dynamic["bias"]]
                b = None if bias is None or not np.any(bias) else _f32(bias)
                self.linear_ops += 1

                def run(env, x=x, wt=wt, b=b, out=out, dtype=dtype):
                    y = _f32(env[x]) @ wt
                    env[out] = (y if b is None else y + b).astype(dtype, copy=False)
                return run
            static.setdefault("bias", None)

            def run(env, out=out, dtype=dtype):
                w = _f32(env[dynamic["weight"]])
                y = _f32(env[x]) @ w.T
                b = static.get("bias") if "bias" not in dynamic else env[dynamic["bias"]]
                env[out] = (y if b is None else y + _f32(b)).astype(dtype, copy=False)
            return run
        if kind == "read_state":
            name = op.inputs["input"].name

            def run(env, state, name=name, out=out):
                env[out] = state.arrays[name]
            run.needs_state = True
            return run
        if kind == "coreml_update_state":
            name, value, adopt = op.inputs["state"].name, dynamic["value"], static.get("adopt", False)

            def run(env, state, name=name, value=value, out=out, adopt=adopt):
                # The state takes the value's buffer when nothing else owns it (the in-place KV
                # writes), a copy otherwise; earlier views of the old buffer stay as they were.
                arr = env[value]
                if not adopt:
                    arr = np.array(arr, dtype=state.arrays[name].dtype)
                state.arrays[name] = arr
                env[out] = arr
            run.needs_state = True
            return run
        fn = OPS[kind]
        items = list(dynamic.items())
        multi = len(outs) > 1

        def run(env, fn=fn, items=items, static=static, outs=outs, dtypes=out_dtypes, multi=multi):
            kwargs = dict(static)
            for k, s in items:
                kwargs[k] = [env[i] for i in s] if isinstance(s, list) else env[s]
            result = fn(**kwargs)
            if multi:
                for o, d, r in zip(outs, dtypes, result):
                    env[o] = np.asarray(r).astype(d, copy=False)
            else:
                env[outs[0]] = np.asarray(result).astype(dtypes[0], copy=False)
        return run

    # -- run time ------------------------------------------------------------------------------------
    def make_state(self) -> MILState:
        arrays = {name: np.zeros(t["shape"], dtype=self._float(np.dtype(t["dtype"])))
                  for name, t in self.interface["states"].items()}
        return MILState(self.path, arrays)

    def _check_inputs(self, inputs: dict) -> None:
        declared = self.interface["inputs"]
        for name in inputs:
            if name not in declared:
                raise ExecutionError(f"{self.function_name}: unexpected input {name!r} (expects {', '.join(declared)})")
        for name, t in declared.items():
            if name not in inputs:
                raise ExecutionError(f"{self.function_name}: missing input {name!r} {tuple(t['shape'])} {t['dtype']}")
            a = inputs[name]
            shape = tuple(np.shape(a))
            dtype = getattr(a, "dtype", type(a).__name__)
            if shape != tuple(t["shape"]) or str(dtype) != t["dtype"]:
                raise ExecutionError(f"{self.function_name}: input {name!r} expects {tuple(t['shape'])} {t['dtype']}, "
                                     f"got {shape} {dtype}")

    def predict(self, inputs: dict, state: MILState | None = None) -> dict:
        self._check_inputs(inputs)
        if self._state_inputs:
            if state is None:
                raise ExecutionError(f"{self.function_name}: this function is stateful; pass state=model.make_state()")
            if not isinstance(state, MILState) or state.package_path != self.path:
                raise ExecutionError(f"{self.function_name}: the state belongs to another model package")
        env = list(self._consts)
        for name, s in self._inputs.items():
            a = np.asarray(inputs[name])
            env[s] = a.astype(self._float(a.dtype), copy=False)
        for step in self._steps:
            if getattr(step, "needs_state", False):
                step(env, state)
            else:
                step(env)
        return {name: (env[s].copy() if name in self._copy_outputs else env[s])
                for name, s in self._outputs.items() if name in self.interface["outputs"]}

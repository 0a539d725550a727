"""The MIL executor: runs a saved ML Program's functions with numpy, as Core ML would run them.

It stands on the saved artifact alone (read by `package.py`, through our reader `program.py`) and
never imports our graph code: what it executes is what Core ML will load, not what we meant to
write. `MILModel` mirrors coremltools' MLModel for one function; `MILPackage` loads every function
of a package together, as Core ML loads a multifunction package.
"""

from __future__ import annotations

import os
from collections import defaultdict
from enum import Enum
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import GemmaAneError
from .ops import OPS, ExecutionError, f32, var_dtype
from .package import Package

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


# -- load time: which buffers a var may share --------------------------------------------------------


class Root(Enum):
    """Whose buffer a var may share (numpy views share memory with their source). A buffer is a
    (Root, var name) pair: the var that made it, or the state or input it came in as."""

    STATE = "state"  # a state's array, as read_state hands it out
    INPUT = "input"  # the caller's array
    CONST = "const"  # a constant of the program, reused by every call
    OWN = "own"  # an array a step made in this call


def _last_uses(fn, ops) -> dict[str, int]:
    """Var name -> index of the last op that reads it (len(ops) for the function's outputs)."""
    last = {}
    for i, op in enumerate(ops):
        for v in op.inputs.values():
            for var in v if isinstance(v, (list, tuple)) else [v]:
                last[var.name] = i
    last.update({v.name: len(ops) for v in fn.outputs})
    return last


class _Aliases:
    """Alias analysis of one function, at load: the slice_updates that write in place (the KV
    writes), the state updates that adopt their value's buffer, and the outputs to copy.

    - the caller's inputs and the program's constants are never written or adopted;
    - a slice_update writes in place only when nothing else reads its buffer afterwards and, if a
      state holds that buffer, the state is overwritten before it is next read;
    - a state adopts a buffer only when no other state holds it (else it takes a copy);
    - an output sharing a state's, an input's or a constant's buffer is copied: Core ML returns
      fresh arrays, and a caller that keeps or changes one must not see or change the model.
    """

    def __init__(self, fn, ops: list):
        self.ops, self.last_use = ops, _last_uses(fn, ops)
        self.root = {n: (Root.STATE if v.state else Root.INPUT, n) for n, v in fn.inputs.items()}
        self.held = {n: r for n, r in self.root.items() if r[0] is Root.STATE}  # state -> the buffer it holds
        self.members = defaultdict(list)  # buffer -> the vars ops rooted there
        self.inplace, self.adopt = set(), set()  # op indices
        for i, op in enumerate(ops):
            self._visit(i, op)
        self.copy_outputs = {
            v.name
            for v in fn.outputs
            if self.root[v.name] in self.held.values() or self.root[v.name][0] in (Root.INPUT, Root.CONST)
        }

    def _set(self, var, buffer) -> None:
        self.root[var.name] = buffer
        self.members[buffer].append(var.name)

    def _visit(self, i, op) -> None:
        kind, x = op.op_type, op.inputs.get("x")
        own = (Root.OWN, op.outputs[0].name if op.outputs else op.name)
        if kind == "read_state":
            self._set(op.outputs[0], self.held[op.inputs["input"].name])
        elif kind in _VIEW_OPS and x is not None and not isinstance(x, (list, tuple)):
            for o in op.outputs:
                self._set(o, self.root[x.name])
        elif kind == "slice_update":
            if self._may_write(i, x):
                self.inplace.add(i)
            self._set(op.outputs[0], self.root[x.name] if i in self.inplace else own)
        elif kind == "coreml_update_state":
            state, buffer = op.inputs["state"].name, self.root[op.inputs["value"].name]
            if self._may_adopt(state, buffer):
                self.adopt.add(i)
            self.held[state] = buffer if i in self.adopt else own
            self._set(op.outputs[0], self.held[state])
        else:
            constant = kind == "const" or kind.startswith("constexpr_")
            for o in op.outputs:
                self._set(o, (Root.CONST if constant else Root.OWN, o.name))

    def _holder(self, buffer) -> str | None:
        return next((s for s, b in self.held.items() if b == buffer), None)

    def _may_write(self, i: int, x) -> bool:
        buffer = self.root[x.name]
        if buffer[0] in (Root.INPUT, Root.CONST) or self.last_use.get(x.name) != i:
            return False
        if any(self.last_use.get(v, -1) > i for v in self.members[buffer] if v != x.name):
            return False
        holder = self._holder(buffer)
        return holder is None or self._overwritten_before_read(holder, i)

    def _overwritten_before_read(self, state: str, i: int) -> bool:
        for op in self.ops[i + 1 :]:
            if op.op_type == "read_state" and op.inputs["input"].name == state:
                return False
            if op.op_type == "coreml_update_state" and op.inputs["state"].name == state:
                return True
        return False

    def _may_adopt(self, state: str, buffer) -> bool:
        return buffer[0] in (Root.STATE, Root.OWN) and self._holder(buffer) in (None, state)


# -- load time: constants, and one closure per op -----------------------------------------------------


def _static(v) -> bool:
    """A const op's output: handed to steps as a value, not through the env."""
    return not isinstance(v, (list, tuple)) and v.op is not None and v.op.op_type == "const"


def _folded(op) -> bool:
    """Evaluated once at load: consts, and the decompression (constexpr_) of constants."""
    return op.op_type == "const" or (op.op_type.startswith("constexpr_") and all(map(_folded_var, op.inputs.values())))


def _folded_var(v) -> bool:
    return not isinstance(v, (list, tuple)) and v.op is not None and _folded(v.op)


def _value(var):
    # 0-d values (axes flags, epsilons, scalars) as Python scalars: numpy wants real bools for
    # keepdims, and a Python scalar keeps the tensor's dtype.
    val = var.val
    return val.item() if isinstance(val, (np.ndarray, np.generic)) and np.ndim(val) == 0 else val


def _linear_weight_only(var) -> bool:
    """Whether a var is used only as the weight of linear ops."""
    return bool(var.child_ops) and all(c.op_type == "linear" and c.inputs.get("weight") is var for c in var.child_ops)


def _weight_key(var) -> tuple:
    """A linear weight in the package's shared cache: functions of one package name a weight alike."""
    return var.name, tuple(var.shape)


def _slots(fn, ops) -> dict[str, int]:
    """Var name -> its index in the env, the list of arrays one call works on."""
    names = list(fn.inputs) + [o.name for op in ops for o in op.outputs]
    return {name: i for i, name in enumerate(names)}


def _read_state_step(name: str, out: int):
    def run(env, state):
        env[out] = state.arrays[name]

    run.needs_state = True
    return run


def _update_state_step(name: str, value: int, out: int, adopt: bool):
    def run(env, state):
        # The state takes the value's buffer when the alias analysis allows (the in-place KV
        # writes), a copy otherwise; earlier views of the old buffer stay as they were.
        arr = env[value]
        if not adopt:
            arr = np.array(arr, dtype=state.arrays[name].dtype)
        state.arrays[name] = arr
        env[out] = arr

    run.needs_state = True
    return run


def _op_step(fn, static: dict, dynamic: dict, outs: list, dtypes: list):
    items = list(dynamic.items())

    def run(env):
        kwargs = dict(static)
        for k, s in items:
            kwargs[k] = [env[i] for i in s] if isinstance(s, list) else env[s]
        result = fn(**kwargs)
        if len(outs) > 1:
            for o, d, r in zip(outs, dtypes, result):
                env[o] = np.asarray(r).astype(d, copy=False)
        else:
            env[outs[0]] = np.asarray(result).astype(dtypes[0], copy=False)

    return run


def _gemm_step(x: int, wt, b, out: int, dtype):
    def run(env):
        y = f32(env[x]) @ wt
        env[out] = (y if b is None else y + b).astype(dtype, copy=False)

    return run


class _Loader:
    """What the functions of one package share while they load: the program (read on first use),
    the precision, and the linear weights, each transposed and widened to fp32 once per package."""

    def __init__(self, path, precision: str, strict: bool | None = None):
        if precision not in ("fp16", "fp32"):
            raise ExecutionError(f"precision={precision!r}: choose fp16 or fp32")
        self.package, self.precision = Package.open(path), precision
        self.strict = os.environ.get("GEMMA_ANE_STRICT") == "1" if strict is None else strict
        self.weights: dict = {}

    @cached_property
    def program(self):
        return self.package.program()


class MILModel:
    """Run one function of a saved ML Program, mirroring coremltools' MLModel:
    `MILModel(path, function_name=None)`, `make_state()`, `predict(inputs, state=state)`.

    precision="fp16" (default) keeps every tensor in the dtype the program declares and runs
    linear/matmul with fp32 accumulation; "fp32" computes every float in fp32, for diagnosis.
    Weights (including palettized ones) are decompressed once, at load.

    strict=True (default: the environment variable GEMMA_ANE_STRICT=1, which the tests set) fails
    the call at the first op whose result holds inf or NaN: on the Neural Engine a non-finite fp16
    value (an overflowing add, -inf through a softmax) silently corrupts everything after it.
    """

    def __init__(self, path, function_name: str | None = None, precision: str = "fp16", strict: bool | None = None):
        self._load(_Loader(path, precision, strict), function_name)

    @classmethod
    def _from_loader(cls, loader: _Loader, function_name: str) -> MILModel:
        """One function of a package whose functions load together (see MILPackage)."""
        model = cls.__new__(cls)
        model._load(loader, function_name)
        return model

    # -- load time: resolve every var to a slot and every op to a closure --------------------------
    def _load(self, loader: _Loader, function_name: str | None) -> None:
        self.package, self.path, self.precision = loader.package, loader.package.path, loader.precision
        self.strict = loader.strict
        self.function_name = function_name or self.package.default_function
        if self.function_name not in self.package.function_names:
            raise ExecutionError(
                f"{self.path}: no function {self.function_name!r} (has {', '.join(self.package.function_names)})"
            )
        self.interface = self.package.interface(self.function_name)
        self._weights = loader.weights  # the package's: its functions share one fp32 copy of each weight
        self._compile(loader.program.functions[self.function_name])

    def _float(self, dtype):
        return np.dtype(np.float32) if (self.precision == "fp32" and dtype.kind == "f") else dtype

    def _compile(self, fn) -> None:
        ops = list(fn.operations)
        for op in ops:
            if op.op_type not in OPS and op.op_type not in ("const", "read_state", "coreml_update_state", "linear"):
                raise ExecutionError(
                    f"{self.path}: model.mlmodel, function {self.function_name!r}, op {op.name!r}: op type "
                    f"{op.op_type!r} is not implemented by the MIL executor"
                )
        slots, aliases = _slots(fn, ops), _Aliases(fn, ops)
        consts, consumed = self._constants(ops, slots)
        run = [(i, op) for i, op in enumerate(ops) if not _folded(op)]
        self._steps = [self._step(i, op, slots, consts, aliases) for i, op in run]
        for s in consumed:
            consts[s] = None
        self.step_kinds = [op.op_type for _, op in run]  # op type of each step, for profiling
        # what strict mode checks after each step: the op and the float slots it wrote
        # (names, not the ops: a step must not keep the loaded program alive)
        self._written = [
            ((op.name, op.op_type), [slots[o.name] for o in op.outputs if var_dtype(o).kind == "f"]) for _, op in run
        ]
        self._consts = consts
        self._inputs = {n: slots[n] for n in fn.inputs if aliases.root[n][0] is Root.INPUT}
        self._stateful = any(r[0] is Root.STATE for n, r in aliases.root.items() if n in fn.inputs)
        self._outputs = {v.name: slots[v.name] for v in fn.outputs}
        self._copy_outputs = aliases.copy_outputs
        missing = [n for n in self.interface["outputs"] if n not in self._outputs]
        if missing:
            raise ExecutionError(
                f"{self.path}: function {self.function_name!r} declares outputs {missing} its program lacks"
            )

    def _constants(self, ops, slots) -> tuple[list, list]:
        """The env every call starts from: each constant loaded (floats in the working dtype), and
        decompressed if compressed. Also the slots that load consumes, freed once the steps are
        built: compressed weights and LUTs, and the weights that linear ops widen to fp32."""
        consts, consumed = [None] * len(slots), []
        for op in filter(_folded, ops):
            try:
                self._constant(op, slots, consts, consumed)
            except Exception as e:  # numpy's errors on a constant that does not fit its op: the package's fault
                raise self._failed(op.name, op.op_type, e) from None
        return consts, consumed

    def _constant(self, op, slots: dict, consts: list, consumed: list) -> None:
        """One folded op's value into `consts`, its slot in `consumed` if load uses it up."""
        var = op.outputs[0]
        s = slots[var.name]
        if op.op_type == "const":
            arr = np.asarray(var.val)
            consts[s] = arr.astype(self._float(arr.dtype)) if arr.dtype.kind == "f" else arr
            if (
                _linear_weight_only(var)
                or var.child_ops
                and all(c.op_type.startswith("constexpr_") for c in var.child_ops)
            ):
                consumed.append(s)
        elif not (_linear_weight_only(var) and _weight_key(var) in self._weights):
            # a weight another function of the package already widened is not decompressed again
            args = {n: _value(v) if _static(v) else consts[slots[v.name]] for n, v in op.inputs.items()}
            dense = OPS[op.op_type](**args)
            consts[s] = np.asarray(dense).astype(self._float(var_dtype(var)))
            if _linear_weight_only(var):
                consumed.append(s)

    def _failed(self, name: str, op_type: str, e: Exception) -> ExecutionError:
        """An op that fails on what the program gave it (a reshape to a shape that does not fit, numpy's error), in
        one line naming the package, function and op: the bundle's fault, never the caller's."""
        why = (str(e).splitlines() or [""])[0]
        kind = "" if isinstance(e, GemmaAneError) else type(e).__name__ + (": " if why else "")
        return ExecutionError(
            f"{self.path}: model.mlmodel, function {self.function_name!r}, op {name!r} ({op_type}): {kind}{why}"
        )

    def _step(self, i: int, op, slots: dict, consts: list, aliases: _Aliases):
        kind = op.op_type
        static = {n: _value(v) for n, v in op.inputs.items() if _static(v)}
        dynamic = {
            n: [slots[x.name] for x in v] if isinstance(v, (list, tuple)) else slots[v.name]
            for n, v in op.inputs.items()
            if not _static(v)
        }
        outs = [slots[o.name] for o in op.outputs]
        dtypes = [self._float(var_dtype(o)) for o in op.outputs]
        if kind == "linear":
            return self._linear_step(op, static, dynamic, consts, outs[0], dtypes[0])
        if kind == "read_state":
            return _read_state_step(op.inputs["input"].name, outs[0])
        if kind == "coreml_update_state":
            value = slots[op.inputs["value"].name]  # through the env even when a const: a state owns its array
            return _update_state_step(op.inputs["state"].name, value, outs[0], i in aliases.adopt)
        if kind == "slice_update":
            static["inplace"] = i in aliases.inplace
        return _op_step(OPS[kind], static, dynamic, outs, dtypes)

    def _linear_step(self, op, static: dict, dynamic: dict, consts: list, out: int, dtype):
        if not all(_folded_var(op.inputs[n]) for n in ("weight", "bias") if n in op.inputs):
            raise ExecutionError(
                f"function {self.function_name!r}: linear op {op.name} has a weight or bias "
                "computed at run time (MIL requires constants)"
            )
        weight = static["weight"] if "weight" in static else consts[dynamic["weight"]]
        key = _weight_key(op.inputs["weight"])
        # Weights are constants: transposed and widened to fp32 once per package (functions share
        # them), so each call is one BLAS gemm.
        if key not in self._weights:
            self._weights[key] = np.ascontiguousarray(f32(weight).T)
        bias = static["bias"] if "bias" in static else consts[dynamic["bias"]] if "bias" in dynamic else None
        return _gemm_step(
            dynamic["x"], self._weights[key], None if bias is None or not np.any(bias) else f32(bias), out, dtype
        )

    # -- run time ------------------------------------------------------------------------------------
    def make_state(self) -> MILState:
        arrays = {
            name: np.zeros(t["shape"], dtype=self._float(np.dtype(t["dtype"])))
            for name, t in self.interface["states"].items()
        }
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
                raise ExecutionError(
                    f"{self.function_name}: input {name!r} expects {tuple(t['shape'])} {t['dtype']}, "
                    f"got {shape} {dtype}"
                )

    def predict(self, inputs: dict, state: MILState | None = None) -> dict:
        self._check_inputs(inputs)
        if self._stateful:
            if state is None:
                raise ExecutionError(f"{self.function_name}: this function is stateful; pass state=model.make_state()")
            if not isinstance(state, MILState) or state.package_path != self.path:
                raise ExecutionError(f"{self.function_name}: the state belongs to another model package")
        env = list(self._consts)
        for name, s in self._inputs.items():
            a = np.asarray(inputs[name])
            env[s] = a.astype(self._float(a.dtype), copy=False)
        for i, step in enumerate(self._steps):
            try:
                if getattr(step, "needs_state", False):
                    step(env, state)
                else:
                    step(env)
            except Exception as e:  # the inputs were checked above: what fails here is the program's
                raise self._failed(*self._written[i][0], e) from None
            if self.strict:
                self._check_finite(i, env)
        return {
            name: (env[s].copy() if name in self._copy_outputs else env[s])
            for name, s in self._outputs.items()
            if name in self.interface["outputs"]
        }

    def _check_finite(self, i: int, env: list) -> None:
        (name, op_type), written = self._written[i]
        for s in written:
            if not np.isfinite(env[s]).all():
                bad = "NaN" if np.isnan(env[s]).any() else "inf"
                raise ExecutionError(
                    f"{self.function_name}: op {name} ({op_type}) produced {bad} in {env[s].dtype} (strict mode)"
                )


class MILPackage:
    """Every function of one saved package, loaded together as Core ML loads a multifunction
    package: a weight the functions share is decompressed and widened once, and one state (from
    `make_state()`) serves every function."""

    def __init__(self, path, precision: str = "fp16", strict: bool | None = None):
        loader = _Loader(path, precision, strict)
        self.package, self.path = loader.package, loader.package.path
        self.functions = {f: MILModel._from_loader(loader, f) for f in self.package.function_names}
        # The loaded program (its constants: GBs of unpacked weights at E2B size) is garbage now: freed
        # at once, before the next package loads, when its reference cycles are broken.
        loader.program.unlink()

    def make_state(self) -> MILState | None:
        first = next(iter(self.functions.values()))
        return first.make_state() if first.interface["states"] else None

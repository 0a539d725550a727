"""Our own reader of a saved ML Program: the model spec, its MIL program and its weight file, read with protobuf and
numpy alone, so that loading a bundle never runs `coremltools/__init__.py` (which imports torch, transformers and
scikit-learn when they are installed: seconds on every load).

An .mlpackage is a folder:

    Manifest.json                        names the root model: itemInfoEntries[rootModelIdentifier]["path"],
                                         relative to Data/ (com.apple.CoreML/model.mlmodel)
    Data/com.apple.CoreML/model.mlmodel  a Model protobuf (Model.proto); an ML Program's is `spec.mlProgram`
    Data/com.apple.CoreML/weights/       weight.bin, the blob storage its constants point into

Every file a package names is read only if it lies inside the package (symbolic links followed), is a regular file
(a FIFO or a device is refused, never waited on or read) and is within its size bound: Manifest.json 1 MiB, the
model spec 256 MiB, a weight file 64 GiB (mapped, not read whole). So what `check` hashes is what runs.

The MIL program (MIL.proto): functions by name, each a block (`block_specializations[opset]`) of operations. An
operation has a type, attributes (its "name"; a const's "val"), inputs by parameter name (each a list of bindings,
by the name of an earlier var or by an immediate value) and typed outputs. A value is immediate (a tensor's floats,
ints, bools, strings, longInts or packed bytes) or a `blobFileValue` (a file and the offset of a blob's metadata).

What comes out (`read_program`) is the program as coremltools' milproto loader builds it, reduced to what the
executor, the audit and the static costs read: `Program.functions` -> `Function` (inputs by name, outputs,
operations) of `Op` (op_type, name, inputs by parameter name, outputs) and `Var` (name, dtype, shape, val, op,
child_ops). Where that loader departs from the file, we depart alike (tests/test_mil_reader.py holds us to it):
`write_state` becomes `coreml_update_state(state, value)`, merged with a `read_state` of the same state right after
it; an int64 constant becomes int32; a rank-0 value is a numpy scalar.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BundleError
from ..files import is_within, open_regular, read_regular


class ProgramError(BundleError):
    """A saved program we cannot read; `package.py` names the package in the message it raises."""


class BlobError(ProgramError):
    """A weight file that does not hold what the program reads from it: damaged, truncated or another file."""


# -- the protobuf classes -----------------------------------------------------------------------------------------

_PB2 = ("FeatureTypes_pb2", "MIL_pb2", "Model_pb2")
_pb2_lock = threading.Lock()


def pb2(name: str):
    """coremltools' generated protobuf module `name` (FeatureTypes_pb2, MIL_pb2, Model_pb2), without running
    `coremltools/__init__.py`. The generated modules need only google.protobuf, but importing them as
    `coremltools.proto.X` would run the package's __init__ first. So, unless coremltools is already imported (then
    its modules are used), stand-in parent packages whose `__path__` is the real folder are put in sys.modules for
    the import and taken out after it. The pb2 modules stay in sys.modules under their real names: a later real
    `import coremltools` finds them there and uses the same modules (protobuf registers each .proto file once per
    process, so two copies of a module would be two message classes for one message)."""
    full = f"coremltools.proto.{name}"
    with _pb2_lock:
        if full not in sys.modules:
            if "coremltools" in sys.modules:
                importlib.import_module(full)
            else:
                _import_with_stand_ins()
    return sys.modules[full]


def _import_with_stand_ins() -> None:
    spec = importlib.util.find_spec("coremltools")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ProgramError("coremltools is not installed (its protobuf classes describe a saved model)")
    root = Path(next(iter(spec.submodule_search_locations)))
    stand_ins = {}
    for name, folder in (("coremltools", root), ("coremltools.proto", root / "proto")):
        module = types.ModuleType(name, "stand-in while gemma_ane imports coremltools' protobuf modules")
        module.__path__ = [str(folder)]
        stand_ins[name] = sys.modules[name] = module
    try:
        for name in _PB2:
            importlib.import_module(f"coremltools.proto.{name}")
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


# -- the program model --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Var:
    """A value of the program: a function input (a state when `state`), or an op's output. `dtype` is MIL's name
    ("fp16", "int32", "uint4", "bool", "string"...), of the wrapped tensor for a state; `shape` holds None for an
    unknown dimension; `val` is a const's value (numpy), None for what is computed at run time."""

    name: str
    dtype: str
    shape: tuple
    state: bool = False
    val: object = None
    op: Op | None = None
    child_ops: list = field(default_factory=list)


@dataclass(eq=False)
class Op:
    """An operation: inputs by parameter name (a Var, or a list of Vars for a tuple parameter such as concat's
    `values`), and its outputs. `op.x` is `op.inputs["x"]`."""

    op_type: str
    name: str
    inputs: dict
    outputs: list

    def __getattr__(self, name: str):
        try:
            return self.__dict__["inputs"][name]
        except KeyError:
            # internal: the attribute protocol (getattr's default and hasattr catch exactly this)
            raise AttributeError(f"op {self.__dict__.get('name')!r} has no input {name!r}") from None


@dataclass(eq=False)
class Function:
    inputs: dict  # name -> Var
    outputs: list  # Vars
    operations: list  # Ops, in program order


@dataclass(eq=False)
class Program:
    functions: dict  # name -> Function

    def unlink(self) -> None:
        """Break the cycles between vars and ops (var.op, var.child_ops), so that the program, its constants with
        it, is freed as soon as it is dropped, without a full garbage collection (which walks every object of the
        process: a tenth of a second, at every package load)."""
        for fn in self.functions.values():
            for op in fn.operations:
                for var in op.outputs:
                    var.op, var.child_ops = None, []
            for var in fn.inputs.values():
                var.child_ops = []


# -- types and values ---------------------------------------------------------------------------------------------

# MIL.proto's DataType numbers -> MIL's type names (BFLOAT16 and the FLOAT8s are not read: coremltools has no type
# for them either)
_MIL_TYPES = {
    1: "bool",
    2: "string",
    10: "fp16",
    11: "fp32",
    12: "fp64",
    21: "int8",
    22: "int16",
    23: "int32",
    24: "int64",
    25: "int4",
    31: "uint8",
    32: "uint16",
    33: "uint32",
    34: "uint64",
    35: "uint4",
    36: "uint2",
    37: "uint1",
    38: "uint6",
    39: "uint3",
}
# MIL type -> the numpy dtype holding one element (sub-byte types one per byte, as coremltools unpacks them)
NP_DTYPES = {
    "bool": np.dtype(bool),
    "string": np.dtype(np.str_),
    "fp16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32),
    "fp64": np.dtype(np.float64),
    "int4": np.dtype(np.int8),
    **{f"int{n}": np.dtype(f"int{n}") for n in (8, 16, 32, 64)},
    **{f"uint{n}": np.dtype(np.uint8) for n in (1, 2, 3, 4, 6)},
    **{f"uint{n}": np.dtype(f"uint{n}") for n in (8, 16, 32, 64)},
}
# bits of one stored element; bool has none in MIL's type system (callers choose what a bool costs)
BITS = {t: int("".join(filter(str.isdigit, t))) for t in NP_DTYPES if t not in ("bool", "string")}
_SUB_BYTE = {"int4", "uint1", "uint2", "uint3", "uint4", "uint6"}
# values stored as packed bytes (TensorValue.bytes) when immediate; the others as floats, ints, bools, longInts...
_BYTES_TYPES = _SUB_BYTE | {"fp16", "int8", "uint8", "uint32"}
# op parameters that take a tuple of vars even when one is bound (MIL's TupleInputType)
_TUPLE_INPUTS = {
    "concat": {"values"},
    "stack": {"values"},
    "einsum": {"values"},
    "reshape_like": {"ref_tensors", "begins", "ends", "end_masks"},
}


def _mil_type(value_type) -> tuple[str, tuple, bool]:
    """(dtype, shape, is a state) of a MIL ValueType: a tensor, or a state wrapping one."""
    kind = value_type.WhichOneof("type")
    state = kind == "stateType"
    if state:
        value_type, kind = value_type.stateType.wrappedType, value_type.stateType.wrappedType.WhichOneof("type")
    if kind != "tensorType":
        raise ProgramError(f"a {kind} value (only tensors and states are read)")
    t = value_type.tensorType
    if t.dataType not in _MIL_TYPES:
        # a number no enum names is the file's error (protobuf's Name() would raise a bare ValueError)
        names = pb2("MIL_pb2").DataType.DESCRIPTOR.values_by_number
        name = names[t.dataType].name if t.dataType in names else f"number {t.dataType}"
        raise ProgramError(f"data type {name} (not read)")
    shape = tuple(d.constant.size if d.HasField("constant") else None for d in t.dimensions)
    return _MIL_TYPES[t.dataType], shape, state


def unpack_bits(packed: np.ndarray, bits: int, count: int, signed: bool) -> np.ndarray:
    """`count` elements of `bits` bits each, packed from the least significant bit of the first byte upward (MIL's
    sub-byte layout, coremltools' restore_elements_from_packed_bits); signed ones sign-extended to int8."""
    stream = np.unpackbits(np.frombuffer(packed, np.uint8), bitorder="little")
    if stream.size < count * bits:
        raise ProgramError(f"{count} {bits}-bit values need {count * bits} bits, the blob holds {stream.size}")
    rows = stream[: count * bits].reshape(count, bits)
    if signed:  # repeat the sign bit up to 8 bits, so the byte reads as the same value in int8
        rows = np.repeat(rows, [1] * (bits - 1) + [8 - bits + 1], axis=1)
    out = np.packbits(rows, bitorder="little", axis=-1).reshape(-1)
    return out.view(np.int8) if signed else out


class _Blobs:
    """Weight files, each read once (memory-mapped) and parsed on demand. MIL blob storage, version 2
    (coremltools' mlmodel/src/MILBlob/Blob/StorageFormat.hpp), little-endian, every record 64-byte aligned:

        storage_header (64 bytes): uint32 count, uint32 version (= 2), reserved
        per blob, at the offset a blobFileValue names:
          blob_metadata (64 bytes): uint32 sentinel 0xDEADBEEF, uint32 data type (BlobDataType), uint64 size in
            bytes, uint64 offset of the data in the file, uint64 padding in bits (the unused high bits of the last
            byte of sub-byte data), reserved
          the data: `size` bytes at `offset`
    """

    METADATA = np.dtype([("sentinel", "<u4"), ("dtype", "<u4"), ("size", "<u8"), ("offset", "<u8"), ("pad", "<u8")])
    SENTINEL = 0xDEADBEEF
    # BlobDataType (MILBlob/Blob/BlobDataType.hpp) -> MIL type
    TYPES = {
        1: "fp16",
        2: "fp32",
        3: "uint8",
        4: "int8",
        6: "int16",
        7: "uint16",
        8: "int4",
        9: "uint1",
        10: "uint2",
        11: "uint4",
        12: "uint3",
        13: "uint6",
        14: "int32",
        15: "uint32",
    }

    def __init__(self, folder: Path):
        self.folder, self.files = folder, {}

    def _file(self, name: str) -> np.ndarray:
        if name not in self.files:
            path = self.folder / name.split("/")[-1]  # "@model_path/weights/weight.bin": its weights folder
            package = self.folder.parents[2]  # PACKAGE/Data/com.apple.CoreML/weights
            inside(path, package, BlobError, f"weights/{path.name}")
            with open_regular(path, MAX_WEIGHT_BYTES, BlobError, f"weights/{path.name}") as fh:
                try:
                    size = os.fstat(fh.fileno()).st_size
                    data = np.memmap(fh, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
                except OSError as e:
                    raise BlobError(f"{e.strerror or type(e).__name__} reading weights/{path.name}") from None
            if data.size < 64 or int(data[4:8].view("<u4")[0]) != 2:
                raise BlobError(f"weights/{path.name} is not a version 2 blob storage file")
            self.files[name] = data
        return self.files[name]

    def read(self, file_value, dtype: str, shape: tuple) -> np.ndarray:
        data, at = self._file(file_value.fileName), file_value.offset
        where = f"at byte {at} of weights/{file_value.fileName.split('/')[-1]}"
        if at + 64 > data.size:
            raise BlobError(f"blob metadata past the end of the file ({data.size} bytes) {where}")
        meta = data[at : at + self.METADATA.itemsize].view(self.METADATA)[0]
        if int(meta["sentinel"]) != self.SENTINEL:
            raise BlobError(f"Invalid sentinel in blob_metadata {where}")
        if self.TYPES.get(int(meta["dtype"])) != dtype:
            raise BlobError(f"blob data type {int(meta['dtype'])} where the program reads {dtype} {where}")
        size, offset, pad = int(meta["size"]), int(meta["offset"]), int(meta["pad"])
        if offset + size > data.size:
            raise BlobError(f"{size} bytes at {offset} run past the end of the file ({data.size} bytes) {where}")
        raw = data[offset : offset + size]
        count = math.prod(shape)  # exact: numpy's int64 product wraps for a hostile shape
        if dtype in _SUB_BYTE:
            bits = BITS[dtype]
            if pad >= 8 or (size * 8 - pad) % bits:
                raise BlobError(f"invalid padding of {pad} bits for {dtype} data {where}")
            if (size * 8 - pad) // bits != count:
                raise BlobError(f"{(size * 8 - pad) // bits} values where the program reads {count} {where}")
            return unpack_bits(raw, bits, count, dtype.startswith("int")).reshape(shape)
        item = NP_DTYPES[dtype].itemsize
        if size != count * item:
            raise BlobError(f"{size} bytes where the program reads {count} {dtype} values {where}")
        # A read-only view of the mapped file, no copy: the executor never writes a constant (its alias analysis)
        # and copies those it widens, so the bytes are paged in once, when used.
        return np.frombuffer(raw, NP_DTYPES[dtype]).reshape(shape)


def _immediate(value, dtype: str, shape: tuple):
    """An immediate tensor value as coremltools' loader makes it: numpy, packed bytes unpacked."""
    imm = value.immediateValue
    if imm.WhichOneof("value") != "tensor":
        raise ProgramError(f"an immediate {imm.WhichOneof('value')} value (only tensors are read)")
    tensor = imm.tensor
    kind = tensor.WhichOneof("value")
    count = math.prod(shape)
    if dtype in _BYTES_TYPES:
        if kind != "bytes":
            raise ProgramError(f"a {dtype} value stored as {kind}")
        raw = np.frombuffer(tensor.bytes.values, np.uint8)
        if dtype in _SUB_BYTE:
            return unpack_bits(raw, BITS[dtype], count, dtype.startswith("int")).reshape(shape)
        if raw.size != count * NP_DTYPES[dtype].itemsize:
            raise ProgramError(f"an immediate {dtype} value of {raw.size} bytes where its type {shape} holds {count}")
        return raw.view(NP_DTYPES[dtype]).reshape(shape).copy()
    if dtype not in ("fp32", "string", "bool", "int16", "uint16", "int32", "int64"):
        raise ProgramError(f"an immediate {dtype} value (coremltools cannot read one either)")
    values = getattr(tensor, kind).values if kind else ()
    if len(values) != count:
        raise ProgramError(f"an immediate {dtype} value of {len(values)} values where its type {shape} holds {count}")
    if dtype == "string" and shape == ():
        return str(values[0])
    return np.array(values).astype(NP_DTYPES[dtype]).reshape(shape)


def _const(value, blobs: _Blobs) -> tuple[object, str, tuple]:
    """(value, dtype, shape) of a const's `val`, as coremltools' const op holds it: rank 0 a numpy scalar, int64 made
    int32 (its const op keeps no int64)."""
    dtype, shape, _ = _mil_type(value.type)
    if None in shape:
        raise ProgramError(f"a constant of unknown dimension {shape}")
    if value.WhichOneof("value") == "blobFileValue":
        val = blobs.read(value.blobFileValue, dtype, shape)
    else:
        val = _immediate(value, dtype, shape)
    if isinstance(val, str):
        return val, dtype, shape
    if dtype == "int64":
        # as coremltools' const op does it: a scalar clipped to int32's range, a tensor clipped above and wrapped
        # below (its lower clip tests the already wrapped values). coremltools never saves an int64 const itself.
        info = np.iinfo(np.int32)
        val = np.clip(val, info.min, info.max) if shape == () else np.where(val > info.max, info.max, val)
        val, dtype = val.astype(np.int32), "int32"
    return (val.reshape(()).astype(val.dtype)[()] if shape == () else val), dtype, shape


# -- reading ------------------------------------------------------------------------------------------------------

# the outputs an op the reader builds itself reads: const's value, a state op's result
_OUTPUTS = {"const": 1, "read_state": 1}


def _op_name(spec) -> str:
    """An op's name: its "name" attribute, one string."""
    if "name" not in spec.attributes:
        raise ProgramError("no name")
    value = spec.attributes["name"]
    tensor = value.immediateValue.tensor
    held = value.WhichOneof("value") == "immediateValue" and tensor.WhichOneof("value") == "strings"
    if not held or not tensor.strings.values:
        raise ProgramError("its name attribute holds no string")
    return tensor.strings.values[0]


def _label(spec, index: int) -> str:
    """How an error names an op: its name where it has one, else its place in the block; and its type."""
    try:
        name = repr(_op_name(spec))
    except ProgramError:
        name = f"#{index}"
    return f"{name} ({spec.type!r})" if spec.type else f"{name} (no type)"


class _Reader:
    def __init__(self, blobs: _Blobs):
        self.blobs = blobs
        self.taken: set[str] = set()  # the var names of the function being read: the file's, and those we made
        self.vars: dict[str, Var] = {}  # every var by name, as the milproto loader keeps them
        self.counts: dict[str, int] = {}

    def _fresh(self, base: str) -> str:
        """A name for what the file leaves unnamed, as coremltools' builder makes one (`base`_N, N counted from 0
        per base through the program: its count is per process, so only a first load in a process has these)."""
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        return f"{base}_{n}"

    def _unique(self, name: str) -> str:
        """`name`, or `name`_N if the function has a var of that name (the ops writing this program were named by
        such a count too): two vars of one name in a function would share the executor's slot."""
        n, found = 1, name
        while found in self.taken:
            found, n = f"{name}_{n}", n + 1
        return found

    def _bind(self, op_type: str, name: str, param: str, argument, ops: list) -> Var | list:
        out = []
        for b in argument.arguments:
            if b.WhichOneof("binding") == "name":
                if b.name not in self.vars:
                    raise ProgramError(f"{param} reads {b.name!r}, which no earlier op or input defines")
                out.append(self.vars[b.name])
            elif len(argument.arguments) == 1:
                # an immediate or blob value: the loader makes it a const op of its own, just before this op
                folded = op_type.startswith("constexpr_")
                val, dtype, shape = _const(b.value, self.blobs)
                var = Var(self._fresh(f"{name}_{param}" if folded else "const"), dtype, shape, val=val)
                self._add(Op("const", var.name, {}, [var]), ops)
                out.append(var)
            else:
                raise ProgramError(f"{param} binds a tuple of values (not read)")
        return out if len(out) != 1 or param in _TUPLE_INPUTS.get(op_type, ()) else out[0]

    def _op(self, spec, ops: list) -> None:
        if spec.type == "write_state":
            # the loader makes it coreml_update_state(state, value), named by its builder, whose output is the value
            # written; a read_state of the same state right after it is merged into it (below)
            name = self._fresh("coreml_update_state")
        else:
            name = _op_name(spec)
        wanted = _OUTPUTS.get(spec.type, 0)
        if len(spec.outputs) < wanted:
            raise ProgramError(f"{len(spec.outputs)} outputs (a {spec.type} op has {wanted})")
        inputs = {p: self._bind(spec.type, name, p, a, ops) for p, a in spec.inputs.items()}
        if spec.type == "const":
            if "val" not in spec.attributes:
                raise ProgramError("no val attribute")
            val, dtype, shape = _const(spec.attributes["val"], self.blobs)
            self._add(Op("const", name, inputs, [Var(spec.outputs[0].name, dtype, shape, val=val)]), ops)
        elif spec.type in ("write_state", "read_state") and not isinstance(inputs.get("input"), Var):
            raise ProgramError("no state as its input")
        elif spec.type == "write_state" and not isinstance(inputs.get("data"), Var):
            raise ProgramError("no value as its data")
        elif spec.type == "write_state":
            value = inputs["data"]
            out = Var(self._unique(name), value.dtype, value.shape)
            self._add(Op("coreml_update_state", name, {"state": inputs["input"], "value": value}, [out]), ops)
        elif spec.type == "read_state" and ops and ops[-1].op_type == "coreml_update_state":
            previous, out = ops[-1], spec.outputs[0].name
            if previous.inputs["state"] is not inputs["input"]:
                self._add(Op(spec.type, name, inputs, [Var(out, *_mil_type(spec.outputs[0].type)[:2])]), ops)
            else:
                previous.outputs[0].name = out
                self.vars[out] = previous.outputs[0]
        else:
            outputs = [Var(o.name, *_mil_type(o.type)[:2]) for o in spec.outputs]
            self._add(Op(spec.type, name, inputs, outputs), ops)

    def _add(self, op: Op, ops: list) -> None:
        for v in op.inputs.values():
            for var in v if isinstance(v, list) else [v]:
                var.child_ops.append(op)
        for o in op.outputs:
            o.op = op
            self.vars[o.name] = o
            self.taken.add(o.name)
        ops.append(op)

    def function(self, spec) -> Function:
        inputs = {}
        for nv in spec.inputs:
            try:
                dtype, shape, state = _mil_type(nv.type)
            except ProgramError as e:
                raise ProgramError(f"input {nv.name!r}: {e}") from None
            inputs[nv.name] = self.vars[nv.name] = Var(nv.name, dtype, shape, state=state)
        if spec.opset not in spec.block_specializations:
            raise ProgramError(f"no block for its opset {spec.opset!r}")
        block, ops = spec.block_specializations[spec.opset], []
        self.taken = set(inputs) | {o.name for op in block.operations for o in op.outputs}
        for i, op_spec in enumerate(block.operations):
            try:
                if op_spec.blocks:
                    raise ProgramError("nested blocks (control flow is not read)")
                self._op(op_spec, ops)
            except ProgramError as e:
                if isinstance(e, BlobError):  # names its file and byte; the op is the caller's to name
                    raise
                raise ProgramError(f"op {_label(op_spec, i)}: {e}") from None
        missing = [n for n in block.outputs if n not in self.vars]
        if missing:
            raise ProgramError(f"outputs {missing} are defined by no op")
        return Function(inputs, [self.vars[n] for n in block.outputs], ops)


MAX_MANIFEST_BYTES = 1 << 20  # a package's Manifest.json: a few hundred bytes
MAX_SPEC_BYTES = 1 << 28  # its model spec, the program without its weights: a few MB for a chunk
MAX_WEIGHT_BYTES = 1 << 36  # a weight file: the largest chunk at 16 bits is a few GB


def inside(path: Path, package: Path, error: type[Exception], name: str) -> None:
    """Refuses `path` (named `name`) unless it lies inside `package`, symbolic links followed."""
    if not is_within(path, package):
        raise error(f"{name}: lies outside the package ({os.path.realpath(path)})")


def read_spec(package: Path):
    """The Model protobuf of a package: the root model Manifest.json names, a file inside the package."""
    manifest = json.loads(read_regular(package / "Manifest.json", MAX_MANIFEST_BYTES, ProgramError, "Manifest.json"))
    root = manifest["rootModelIdentifier"]
    relative = manifest["itemInfoEntries"][root]["path"]
    field = f"Manifest.json: itemInfoEntries[{root!r}].path"
    if not isinstance(relative, str) or not relative or os.path.isabs(relative):
        raise ProgramError(f"{field}: {relative!r} is not a path relative to Data/")
    inside(package / "Data" / relative, package, ProgramError, f"{field} {relative!r}")
    model = pb2("Model_pb2").Model()
    model.ParseFromString(read_regular(package / "Data" / relative, MAX_SPEC_BYTES, ProgramError, f"Data/{relative}"))
    return model


def read_program(spec, weights: Path) -> Program:
    """Every function of an ML Program spec, its constants read from the weight files in `weights`."""
    reader, functions = _Reader(_Blobs(weights)), {}
    for name, fn in spec.mlProgram.functions.items():
        try:
            functions[name] = reader.function(fn)
        except BlobError:  # the weight file, which every function shares: no function to name
            raise
        except ProgramError as e:
            raise ProgramError(f"function {name!r}: {e}") from None
    return Program(functions)

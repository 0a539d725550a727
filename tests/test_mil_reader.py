"""Our reader of saved ML Programs (gemma_ane/mil/program.py) against its oracle, coremltools' own milproto loader:
every function's op sequence (type, name, input bindings, output names, shapes and dtypes), every constant's value
bit for bit, and who reads each var; then what it is for, a runtime path that never runs `coremltools/__init__.py`
(so never imports torch, transformers or scikit-learn); and a damaged weight file, still one line."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.backend.mil import helper
from coremltools.converters.mil.frontend.milproto.load import load
from coremltools.converters.mil.mil import types
from coremltools.libmilstoragepython import _BlobStorageWriter
from coremltools.proto import MIL_pb2, Model_pb2

from gemma_ane.mil.executor import MILModel
from gemma_ane.mil.package import Package, PackageError
from gemma_ane.mil.program import read_program

FP16, FP32 = types.fp16, types.fp32
IOS18 = ct.target.iOS18
WEIGHTS = Path("Data/com.apple.CoreML/weights")


# -- the comparison -------------------------------------------------------------------------------------------------


def oracle(spec, weights: Path, monkeypatch):
    """coremltools' reading of a spec. Its builder numbers the names it makes (a write_state's op, the consts a
    constexpr's inline values become) per process; a fresh count is what a first load in a process gets, as ours."""
    monkeypatch.setattr(mb, "name_count", defaultdict(int))
    return load(spec, spec.specificationVersion, str(weights))


def _names(v):
    return [x.name for x in v] if isinstance(v, (list, tuple)) else v.name


def _value(val):
    """A constant as bits: its Python type, dtype, shape and bytes (a str as itself)."""
    if val is None or isinstance(val, str):
        return val
    return type(val).__name__ if np.ndim(val) == 0 else "ndarray", np.dtype(val.dtype).str, np.shape(val), val.tobytes()


def describe(fn, dtype_name) -> tuple:
    inputs = [
        (n, v.name, dtype_name(v), tuple(v.shape), sorted(c.name for c in v.child_ops)) for n, v in fn.inputs.items()
    ]
    ops = [
        (
            op.op_type,
            op.name,
            {k: _names(v) for k, v in op.inputs.items()},
            [
                (o.name, tuple(o.shape), dtype_name(o), _value(o.val), sorted(c.name for c in o.child_ops))
                for o in op.outputs
            ],
        )
        for op in fn.operations
    ]
    return inputs, [v.name for v in fn.outputs], ops


def assert_reads_alike(spec, weights: Path, monkeypatch) -> int:
    """Ours equal to coremltools' for every function of `spec`; returns how many ops were compared."""
    ours, theirs = read_program(spec, weights), oracle(spec, weights, monkeypatch)
    assert list(ours.functions) == list(theirs.functions)
    compared = 0
    for name, fn in theirs.functions.items():
        want = describe(fn, lambda v: types.builtin_to_string(v.dtype))
        got = describe(ours.functions[name], lambda v: v.dtype)
        assert got[:2] == want[:2], name
        assert len(got[2]) == len(want[2]), name
        for g, w in zip(got[2], want[2]):
            assert g == w, (name, g[:2], w[:2])
        states = [n for n, v in fn.inputs.items() if types.is_state(v.sym_type)]
        assert [n for n, v in ours.functions[name].inputs.items() if v.state] == states
        compared += len(want[2])
    return compared


def assert_package_reads_alike(path: Path, monkeypatch) -> int:
    return assert_reads_alike(Package.open(path).spec, path / WEIGHTS, monkeypatch)


# -- values: every data type, immediate and in the blob file ---------------------------------------------------------

# MIL type -> (BlobStorageWriter method, what it takes); sub-byte types as one value per byte, as coremltools keeps them
BLOB_TYPES = {
    "fp16": ("write_fp16_data", lambda a: a.view(np.uint16)),
    "fp32": ("write_float_data", None),
    "int8": ("write_int8_data", None),
    "uint8": ("write_uint8_data", None),
    "int16": ("write_int16_data", None),
    "uint16": ("write_uint16_data", None),
    "int32": ("write_int32_data", None),
    "uint32": ("write_uint32_data", None),
    "int4": ("write_int4_data", None),
    **{f"uint{n}": (f"write_uint{n}_data", None) for n in (1, 2, 3, 4, 6)},
}


def sample(dtype: str, shape: tuple, rng) -> np.ndarray:
    """Values spanning the type's range, as the numpy array coremltools writes one from."""
    if dtype in ("fp16", "fp32", "fp64"):
        return rng.standard_normal(shape).astype({"fp16": np.float16, "fp32": np.float32, "fp64": np.float64}[dtype])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    bits = int(dtype.lstrip("uint"))
    low, high = (0, 2**bits) if dtype.startswith("u") else (-(2 ** (bits - 1)), 2 ** (bits - 1))
    np_dtype = types.nptype_from_builtin(types.string_to_builtin(dtype))
    return rng.integers(low, high, shape, dtype=np.int64).astype(np_dtype)


def const_program(values: dict) -> Model_pb2.Model:
    """A one-function ML Program spec whose ops are const ops holding `values` (name -> MIL Value)."""
    program = MIL_pb2.Program(version=1)
    fn = program.functions["main"]
    fn.opset = "CoreML8"
    x = fn.inputs.add()
    x.name = "x"
    x.type.CopyFrom(helper.create_valuetype_tensor([1], MIL_pb2.FLOAT32))
    block = fn.block_specializations["CoreML8"]
    for name, value in values.items():
        op = block.operations.add()
        op.type = "const"
        op.attributes["name"].CopyFrom(helper.create_scalar_value(name))
        op.attributes["val"].CopyFrom(value)
        out = op.outputs.add()
        out.name = name
        out.type.CopyFrom(value.type)
    block.outputs.append("x")
    model = Model_pb2.Model(specificationVersion=9)
    model.mlProgram.CopyFrom(program)
    return model


def test_immediate_values_read_as_coremltools_reads_them(monkeypatch, tmp_path):
    rng = np.random.default_rng(0)
    values = {}
    for dtype in (
        "fp16",
        "fp32",
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int4",
        "uint1",
        "uint2",
        "uint3",
        "uint4",
        "uint6",
    ):
        for shape in ((), (1,), (3, 5)):  # a scalar, and 15 values: sub-byte ones end mid-byte
            a = sample(dtype, shape, rng)
            values[f"{dtype}_{len(shape)}"] = (
                helper.create_tensor_value(a) if shape else helper.create_scalar_value(a[()])
            )
    values["int64"] = helper.create_tensor_value(np.array([2**40, -(2**40) - 3, 7], np.int64))  # made int32
    values["int64_0"] = helper.create_scalar_value(np.int64(-(2**40)))
    values["string"] = helper.create_scalar_value("TANH_APPROXIMATION")
    assert assert_reads_alike(const_program(values), tmp_path, monkeypatch) == len(values)


@pytest.mark.parametrize("dtype", list(BLOB_TYPES))
def test_blob_values_read_as_coremltools_reads_them(dtype, monkeypatch, tmp_path):
    method, prepare = BLOB_TYPES[dtype]
    rng = np.random.default_rng(1)
    writer = _BlobStorageWriter(str(tmp_path / "weight.bin"))
    values = {}
    for i, shape in enumerate(((15,), (3, 7, 2), (64,))):  # 15 and 42 values end mid-byte for sub-byte types
        a = sample(dtype, shape, rng)
        offset = getattr(writer, method)((prepare or np.ravel)(a.ravel()))
        proto_type = helper.types_to_proto_primitive(types.string_to_builtin(dtype))
        values[f"w{i}"] = helper.create_file_value_tensor("@model_path/weights/weight.bin", offset, shape, proto_type)
    del writer  # written out
    assert assert_reads_alike(const_program(values), tmp_path, monkeypatch) == 3


# -- saved programs: states, several functions, LUT and block-wise weights -----------------------------------------


def save(prog, path: Path) -> Path:
    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=IOS18,
        compute_precision=ct.precision.FLOAT16,
        pass_pipeline=ct.PassPipeline.EMPTY,
        skip_model_load=True,
    )
    model.save(str(path))
    return path


def stateful_program():
    """A state written and left (write_state alone), and one written and read back (write_state merged with the
    read_state after it), a concat (a tuple input), a gelu mode (a string), scalars."""

    @mb.program(
        input_specs=[
            mb.StateTensorSpec(shape=(1, 4), dtype=FP16),
            mb.StateTensorSpec(shape=(1, 4), dtype=FP16),
            mb.TensorSpec(shape=(1, 4), dtype=FP16),
        ],
        opset_version=IOS18,
    )
    def prog(a, b, x):
        total = mb.add(x=mb.read_state(input=a), y=x)
        mb.coreml_update_state(state=a, value=total)
        again = mb.coreml_update_state(state=b, value=mb.mul(x=total, y=np.float16(2)))
        both = mb.concat(values=[again, mb.gelu(x=x, mode="TANH_APPROXIMATION")], axis=0)
        return mb.reduce_sum(x=both, axes=[0], keep_dims=True, name="out")

    return prog


def compressed_program():
    """LUT weights with 1- to 6-bit indices (inline when small, in the blob file when not), block-wise int4 and int8
    weights with and without offsets: every sub-byte layout the compression ops write."""
    rng = np.random.default_rng(2)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 8), dtype=FP16)], opset_version=IOS18)
    def prog(x):
        outs = []
        for bits in (1, 2, 3, 4, 6):
            for rows in (2, 6):  # 16 indices inline, 48 in the blob file
                nptype = types.nptype_from_builtin(types.string_to_builtin(f"uint{bits}"))
                indices = rng.integers(0, 2**bits, (rows, 8)).astype(nptype)
                lut = rng.standard_normal((1, 1, 2**bits, 1)).astype(np.float16)
                w = mb.constexpr_lut_to_dense(indices=indices, lut=lut)
                outs.append(mb.linear(x=x, weight=w))
        for dtype, offset in (("int4", False), ("int8", True), ("uint4", True)):
            nptype = types.nptype_from_builtin(types.string_to_builtin(dtype))
            low, high = (-8, 8) if dtype == "int4" else (0, 16) if dtype == "uint4" else (-128, 128)
            data = rng.integers(low, high, (6, 8)).astype(nptype)
            scale = rng.random((6, 2)).astype(np.float16)
            kw = {"offset": rng.integers(0, 4, (6, 2)).astype(nptype)} if offset else {}
            outs.append(mb.linear(x=x, weight=mb.constexpr_blockwise_shift_scale(data=data, scale=scale, **kw)))
        return mb.concat(values=outs, axis=1, name="y")

    return prog


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reader")
    parts = {
        "stateful": save(stateful_program(), root / "stateful.mlpackage"),
        "compressed": save(compressed_program(), root / "compressed.mlpackage"),
    }
    desc = ct.utils.MultiFunctionDescriptor()
    for name in ("stateful", "compressed"):
        desc.add_function(str(parts[name]), src_function_name="main", target_function_name=name)
    desc.default_function_name = "compressed"
    ct.utils.save_multifunction(desc, str(root / "multi.mlpackage"))
    return {**parts, "multi": root / "multi.mlpackage"}


def test_saved_programs_read_as_coremltools_reads_them(saved, monkeypatch):
    for path in saved.values():
        assert assert_package_reads_alike(path, monkeypatch) > 0
    fn = Package.open(saved["stateful"]).program().functions["main"]
    kinds = [op.op_type for op in fn.operations if op.op_type.endswith("state")]
    assert kinds == ["read_state", "coreml_update_state", "coreml_update_state"]  # the second merged with its read
    compressed = Package.open(saved["compressed"]).program().functions["main"].operations
    assert {op.outputs[0].dtype for op in compressed if op.op_type == "const"} >= {
        "uint1",
        "uint2",
        "uint3",
        "uint4",
        "uint6",
        "int4",
        "int8",
    }


def test_bundles_read_as_coremltools_reads_them(tiny_bundle16, tiny_bundle4, monkeypatch):
    for bundle in (tiny_bundle16, tiny_bundle4):
        for path in sorted(bundle.glob("*.mlpackage")):
            assert assert_package_reads_alike(path, monkeypatch) > 100, path


@pytest.mark.slow
def test_media_packages_read_as_coremltools_reads_them(vision_bundle, audio_bundle, monkeypatch):
    paths = [p for b in (vision_bundle, audio_bundle) for p in sorted(b.glob("*.mlpackage"))]
    assert {p.name for p in paths} >= {"vision.mlpackage", "audio.mlpackage"}
    for path in paths:
        assert assert_package_reads_alike(path, monkeypatch) > 0, path


# -- what it is for: no coremltools package on the runtime path ---------------------------------------------------

BANNED = ("torch", "transformers", "sklearn", "coremltools.converters", "coremltools.models")

CHILD = """
import sys
{load}
banned = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "sklearn")
          or m.startswith(("coremltools.converters", "coremltools.models")) or m == "coremltools"]
assert not banned, banned
from gemma_ane.mil import program
ours = program.pb2("Model_pb2")
import coremltools
from coremltools.converters.mil.frontend.milproto.load import load
assert coremltools.proto.Model_pb2 is ours  # the real package took the modules our reader loaded
spec = coremltools.utils.load_spec(sys.argv[1])
assert isinstance(spec, ours.Model)
load(spec, spec.specificationVersion, sys.argv[1] + "/Data/com.apple.CoreML/weights")
print("OK")
"""


def run_child(code: str, path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_a_bundle_loads_and_generates_without_the_coremltools_package(tiny_bundle16):
    load_bundle = """
import gemma_ane
model = gemma_ane.load(sys.argv[1].rsplit("/", 1)[0], backend="mil")
assert len(model.generate("hello", max_tokens=1, temperature=0).tokens) == 1
"""
    run_child(CHILD.format(load=load_bundle), tiny_bundle16 / "chunk_1.mlpackage")


def test_the_executor_reads_without_the_coremltools_package(saved):
    run_executor = """
import numpy as np
from gemma_ane.mil.executor import MILPackage
package = MILPackage(sys.argv[1])
state = package.make_state()
out = package.functions["stateful"].predict({"x": np.ones((1, 4), np.float16)}, state=state)
assert out["out"].shape == (1, 4)
"""
    run_child(CHILD.format(load=run_executor), saved["multi"])


@pytest.mark.parametrize("protos", ["1", "0"])
def test_with_coremltools_imported_first_its_modules_are_used(saved, protos, monkeypatch):
    """Imported first, coremltools is left in place: its pb2 modules are used, imported through it when its
    proto package did not import them (IMPORT_COREMLTOOLS_PROTO=0)."""
    monkeypatch.setenv("IMPORT_COREMLTOOLS_PROTO", protos)
    code = """
import sys
import coremltools
from gemma_ane.mil.package import Package
Package.open(sys.argv[1]).program()
from gemma_ane.mil import program
assert sys.modules["coremltools"] is coremltools, "coremltools was taken out of sys.modules"
assert program.pb2("Model_pb2") is sys.modules["coremltools.proto.Model_pb2"]
from coremltools.proto import Model_pb2
assert program.pb2("Model_pb2") is Model_pb2
print("OK")
"""
    run_child(code, saved["multi"])


def test_the_executor_runs_what_it_read(saved):
    """The reader feeds the executor: the block-wise and LUT weights decompress to what coremltools' loader holds."""
    theirs = load(Package.open(saved["compressed"]).spec, 9, str(saved["compressed"] / WEIGHTS))
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float16)
    want = []
    for op in theirs.functions["main"].operations:
        if op.op_type == "linear":
            w = op.weight.op
            if w.op_type == "constexpr_lut_to_dense":
                lut, idx = np.asarray(w.lut.val, np.float32)[0, 0, :, 0], np.asarray(w.indices.val).astype(np.intp)
                dense = lut[idx]
            else:
                data = np.asarray(w.data.val, np.float32)
                per_block = lambda t: np.repeat(np.asarray(t.val, np.float32), 4, axis=1)  # noqa: E731
                dense = (data - (per_block(w.offset) if "offset" in w.inputs else 0)) * per_block(w.scale)
            want.append(x.astype(np.float32) @ dense.T)
    got = MILModel(saved["compressed"], precision="fp32").predict({"x": x})["y"]
    np.testing.assert_allclose(got, np.concatenate(want, axis=1), rtol=1e-5, atol=1e-6)


# -- a damaged weight file: one line naming the package and the file -------------------------------------------------


def _first_blob(path: Path) -> tuple[int, int, int]:
    """(metadata offset, data size, data offset) of the first blob of a weight file (blob storage v2)."""
    data = (path / WEIGHTS / "weight.bin").read_bytes()
    _, _, size, offset = struct.unpack_from("<IIQQ", data, 64)
    return 64, size, offset


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b, at, size, off: b[:off], r"past the end of the file"),  # truncated after the first header
        (lambda b, at, size, off: b[:at] + b"\0" * 4 + b[at + 4 :], r"Invalid sentinel in blob_metadata at byte 64"),
        (lambda b, at, size, off: b[: at + 4] + struct.pack("<I", 2) + b[at + 8 :], r"blob data type 2 where"),
        (
            lambda b, at, size, off: b[: at + 8] + struct.pack("<Q", size + 2) + b[at + 16 :],
            r"(bytes|values) where the program reads|invalid padding",
        ),
        (lambda b, at, size, off: b[:4] + struct.pack("<I", 1) + b[8:], r"is not a version 2 blob storage file"),
        (lambda b, at, size, off: b[:32], r"not a version 2 blob storage file"),
    ],
)
def test_a_damaged_weight_file_is_one_line_naming_package_and_file(saved, tmp_path, damage, message):
    pkg = shutil.copytree(saved["stateful"].parent / "compressed.mlpackage", tmp_path / "c.mlpackage")
    weights = pkg / WEIGHTS / "weight.bin"
    weights.write_bytes(damage(weights.read_bytes(), *_first_blob(pkg)))
    with pytest.raises(PackageError) as e:
        MILModel(pkg)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{pkg}: weight file damaged (")
    assert "weights/weight.bin" in text and text.endswith("re-convert or run gemma-ane check")
    assert re.search(message, text), text


def test_a_missing_weight_file_is_one_line(saved, tmp_path):
    pkg = shutil.copytree(saved["compressed"], tmp_path / "c.mlpackage")
    (pkg / WEIGHTS / "weight.bin").unlink()
    damaged = r"c.mlpackage: weight file damaged \(weights/weight.bin: No such file or directory\)"
    with pytest.raises(PackageError, match=damaged):
        Package.open(pkg).program()


def test_a_name_the_reader_makes_never_takes_one_the_file_gives(tmp_path):
    """A write_state's op has no name in the file, and coremltools' builder numbers one per process: a program saved
    in a process that had counted further holds vars named as a fresh count would name that op."""

    @mb.program(
        input_specs=[mb.StateTensorSpec(shape=(1, 4), dtype=FP16), mb.TensorSpec(shape=(1, 4), dtype=FP16)],
        opset_version=IOS18,
    )
    def prog(acc, x):
        doubled = mb.mul(x=x, y=np.float16(2), name="coreml_update_state_0")
        mb.coreml_update_state(state=acc, value=mb.add(x=mb.read_state(input=acc), y=x))
        return mb.add(x=doubled, y=np.float16(1), name="y")

    path = save(prog, tmp_path / "named.mlpackage")
    fn = Package.open(path).program().functions["main"]
    update = next(op for op in fn.operations if op.op_type == "coreml_update_state")
    assert update.name == "coreml_update_state_0" and update.outputs[0].name == "coreml_update_state_0_1"
    model = MILModel(path)
    x = np.array([[1, 2, 3, 4]], np.float16)
    np.testing.assert_array_equal(model.predict({"x": x}, state=model.make_state())["y"], 2 * x + 1)

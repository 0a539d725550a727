"""Hostile saved programs: a package whose spec a careless tool or an attacker edited. Every one is refused in one
line naming the package, the file and the field (the op, the input, the state), as a GemmaAneError: through the
reader, the executor (load and first call), inspect's costs and the Neural Engine audit, which fails what it cannot
judge. Each case edits one field of a small program coremltools saved (a state, a linear, a reshape)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types
from coremltools.proto import Model_pb2

from gemma_ane.bundle import check
from gemma_ane.cli import main
from gemma_ane.errors import BundleError, DeviceError, GemmaAneError
from gemma_ane.mil.executor import MILModel
from gemma_ane.mil.package import MAX_STATE_BYTES, Package, PackageError
from gemma_ane.runtime.audit import audit_bundle
from gemma_ane.server.errors import error_of

SPEC = Path("Data/com.apple.CoreML/model.mlmodel")
WIDTH = 64


def program():
    """x + state through a linear into the state, then reshaped: an input, a state, a weight, a dynamic reshape."""
    weight = (np.eye(WIDTH) + np.random.default_rng(0).standard_normal((WIDTH, WIDTH)) / 16).astype(np.float16)

    @mb.program(
        input_specs=[mb.StateTensorSpec((1, WIDTH), dtype=types.fp16), mb.TensorSpec((1, WIDTH), dtype=types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(s, x):
        total = mb.add(x=x, y=mb.read_state(input=s), name="total")
        y = mb.linear(x=total, weight=weight, name="proj")
        mb.coreml_update_state(state=s, value=y)
        return mb.reshape(x=y, shape=(8, WIDTH // 8), name="out")

    return prog


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "bundle" / "chunk_1.mlpackage"
    ct.convert(
        program(),
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
        pass_pipeline=ct.PassPipeline.EMPTY,
        skip_model_load=True,
    ).save(str(path))
    return path


def edited(saved: Path, tmp_path: Path, edit) -> Path:
    """A copy of the saved package (in a bundle folder of its own) with `edit(spec)` applied to its model spec."""
    pkg = shutil.copytree(saved, tmp_path / "bundle" / saved.name)
    spec = Model_pb2.Model()
    spec.ParseFromString((pkg / SPEC).read_bytes())
    edit(spec)
    (pkg / SPEC).write_bytes(spec.SerializeToString())
    return pkg


def ops(spec):
    return spec.mlProgram.functions["main"].block_specializations["CoreML8"].operations


def op(spec, type_: str, name: str | None = None):
    def named(o):
        return name is None or o.attributes["name"].immediateValue.tensor.strings.values[:1] == [name]

    return next(o for o in ops(spec) if o.type == type_ and named(o))


def shape_const(spec):
    """The const op holding the reshape's shape (the saved program binds it by name)."""
    reshape = op(spec, "reshape")
    bound = reshape.inputs["shape"].arguments[0].name
    return next(o for o in ops(spec) if o.type == "const" and o.outputs[0].name == bound)


def one_line(e: BaseException, pkg: Path, *fields: str) -> str:
    text = str(e)
    assert isinstance(e, GemmaAneError) and "\n" not in text, text
    assert text.startswith(f"{pkg}: ") and "model.mlmodel" in text, text
    for f in fields:
        assert f in text, (f, text)
    return text


def test_the_saved_program_runs(saved):
    """The program every case edits loads and runs: what fails below fails for its edit."""
    model = MILModel(saved)
    x = np.full((1, WIDTH), 0.25, np.float16)
    out = model.predict({"x": x}, state=model.make_state())["out"]
    assert out.shape == (8, WIDTH // 8) and np.isfinite(out).all()
    assert audit_bundle(saved.parent)["verdict"] == "pass"


# -- the reader: the program ------------------------------------------------------------------------------------


def _no_name_string(spec):
    op(spec, "linear").attributes["name"].immediateValue.tensor.strings.ClearField("values")


def _unknown_dtype(spec):
    op(spec, "add").outputs[0].type.tensorType.dataType = 99


def _short_immediate(spec):
    values = shape_const(spec).attributes["val"].immediateValue.tensor.ints.values
    values.pop()  # a (2,) int32 const holding one value


def _no_outputs(spec):
    del shape_const(spec).outputs[:]


@pytest.mark.parametrize(
    "edit, fields",
    [
        (_no_name_string, ["function 'main'", "op #", "('linear')", "name attribute holds no string"]),
        (_unknown_dtype, ["function 'main'", "op 'total' ('add')", "data type number 99"]),
        (_short_immediate, ["function 'main'", "('const')", "of 1 values where its type (2,) holds 2"]),
        (_no_outputs, ["function 'main'", "('const')", "0 outputs"]),
    ],
    ids=["name-no-string", "unknown-dtype", "short-immediate", "const-without-output"],
)
def test_a_malformed_program_is_one_line_naming_package_file_and_op(saved, tmp_path, edit, fields):
    pkg = edited(saved, tmp_path, edit)
    with pytest.raises(PackageError) as e:
        Package.open(pkg).program()
    one_line(e.value, pkg, *fields)
    with pytest.raises(PackageError) as e:
        MILModel(pkg)
    one_line(e.value, pkg, *fields)


# -- the reader: the interface (what the runtime allocates) --------------------------------------------------------


def _description_dtype(spec):
    spec.description.input[0].type.multiArrayType.dataType = 7


def _negative_state_dim(spec):
    spec.description.state[0].type.stateType.arrayType.shape[1] = -WIDTH


def _huge_state(spec):
    spec.description.state[0].type.stateType.arrayType.shape[1] = 2**40


@pytest.mark.parametrize(
    "edit, fields",
    [
        (_description_dtype, ["function 'main', input 'x'", "data type number 7"]),
        (_negative_state_dim, ["function 'main', state 's'", "negative dimension in shape [1, -64]"]),
        (_huge_state, ["function 'main': states of 2048 GiB", "s [1, 1099511627776] float16", "(16 GiB)"]),
    ],
    ids=["unknown-dtype", "negative-dim", "2^40-elements"],
)
def test_a_malformed_interface_is_refused_before_anything_is_allocated(saved, tmp_path, edit, fields, monkeypatch):
    pkg = edited(saved, tmp_path, edit)

    def never(*a, **k):  # the huge state must be refused from its declared size, not by a failed allocation
        raise AssertionError("a state was allocated")

    model = None
    with pytest.raises(PackageError) as e:
        model = MILModel(pkg)
        monkeypatch.setattr(np, "zeros", never)
        model.make_state()
    one_line(e.value, pkg, *fields)
    report = audit_bundle(pkg.parent)
    [chunk] = report["chunks"]
    assert report["verdict"] == chunk["verdict"] == "fail" and chunk["reason"].startswith("unreadable: ")
    assert model is None


def test_a_state_of_no_dimension_fails_the_audit(saved, tmp_path):
    pkg = edited(saved, tmp_path, lambda spec: spec.description.state[0].type.stateType.arrayType.ClearField("shape"))
    report = audit_bundle(pkg.parent)
    assert report["verdict"] == "fail"
    assert any(f["detail"] == "a state of no dimension" for f in report["chunks"][0]["findings"])


def test_the_state_bound_admits_the_largest_real_cache():
    """E4B's five full-attention cache owners in one chunk at the full 131072-token context: K and V, 2 KV heads,
    width 512, fp16 (the sliding rings are a few MB more)."""
    assert 2 * 5 * 2 * 131072 * 512 * 2 * 1.1 < MAX_STATE_BYTES < 2**40


# -- the executor: what only running finds -------------------------------------------------------------------------


def _unknown_op_type(spec):
    op(spec, "add").type = "__import__('os').system('false')"


def test_an_unknown_op_type_names_the_package_and_fails_the_audit(saved, tmp_path, capsys):
    pkg = edited(saved, tmp_path, _unknown_op_type)
    with pytest.raises(DeviceError) as e:
        MILModel(pkg)
    one_line(e.value, pkg, "function 'main', op 'total'", "is not implemented by the MIL executor")
    assert main(["inspect", str(pkg.parent), "--ane"]) == 1
    out = capsys.readouterr().out
    assert "known violation: __import__('os').system('false') x1 (total)" in out
    assert out.rstrip().endswith("Neural Engine audit: fail")


def test_a_reshape_that_does_not_fit_is_the_bundles_fault_not_the_callers(saved, tmp_path):
    def edit(spec):
        shape_const(spec).attributes["val"].immediateValue.tensor.ints.values[0] = 7  # 7 x 8 of 64 values

    pkg = edited(saved, tmp_path, edit)
    model = MILModel(pkg)  # the shape is only wrong for the value it meets
    with pytest.raises(DeviceError) as e:
        model.predict({"x": np.zeros((1, WIDTH), np.float16)}, state=model.make_state())
    one_line(e.value, pkg, "function 'main', op 'out' (reshape): ValueError: cannot reshape")
    assert error_of(e.value).status == 500  # the server answers the bundle's fault with a 500, never a 400


def test_a_linear_of_unknown_dimension_is_one_line_from_inspect(saved, tmp_path):
    def edit(spec):
        op(spec, "add").outputs[0].type.tensorType.dimensions[0].unknown.variadic = False

    pkg = edited(saved, tmp_path, edit)
    with pytest.raises(BundleError) as e:
        check._inspect_package(pkg)
    one_line(e.value, pkg, "function 'main', op 'proj' (linear): x of unknown dimension (None, 64)")
    report = audit_bundle(pkg.parent)
    assert report["verdict"] == "fail"
    assert any("symbolic shape" in f["detail"] for f in report["chunks"][0]["functions"]["main"]["findings"])


def test_the_audit_report_names_an_unreadable_package(saved, tmp_path, capsys):
    pkg = edited(saved, tmp_path, _huge_state)
    assert main(["inspect", str(pkg.parent), "--ane"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("chunk_1 (chunk_1.mlpackage): fail (unreadable: ") and "more than a package's" in out[0]
    assert out[-1] == "Neural Engine audit: fail"
    assert main(["inspect", str(pkg.parent), "--ane", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["chunks"][0]["verdict"] == "fail"


@pytest.mark.parametrize("edit", [_no_name_string, _unknown_dtype, _short_immediate, _description_dtype, _huge_state])
def test_the_cli_prints_one_line_naming_the_package(saved, tmp_path, capsys, edit):
    pkg = edited(saved, tmp_path, edit)
    assert main(["inspect", str(pkg.parent), "--no-sha"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"gemma-ane inspect: error: {pkg}: ") and "model.mlmodel" in err[0], err

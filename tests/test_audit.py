"""`inspect --ane`: the static Neural Engine audit. Small MIL programs that each break one rule (and
one that breaks none), the shared tiny bundles, the host's mask, and the command line."""

import json
import shutil

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol, types

from gemma_ane.bundle import host
from gemma_ane.cli import main
from gemma_ane.mil.package import Package
from gemma_ane.runtime import audit
from gemma_ane.runtime.audit import audit_bundle, format_audit

iOS18 = ct.target.iOS18


def fp16(*shape):
    return mb.TensorSpec(shape, dtype=types.fp16)


def convert(prog, precision=ct.precision.FLOAT16):
    return ct.convert(prog, minimum_deployment_target=iOS18, compute_precision=precision, skip_model_load=True)


def write_bundle(tmp_path, prog, precision=ct.precision.FLOAT16):
    """A one-chunk bundle holding `prog` (a MIL program, or a converted model), as Core ML will load it."""
    out = tmp_path / "bundle"
    (prog if isinstance(prog, ct.models.MLModel) else convert(prog, precision)).save(str(out / "chunk_1.mlpackage"))
    return out


def findings(report, verdict=None):
    for c in report["chunks"] + report.get("models", []):
        for f in c.get("findings", []) + [g for fn in c.get("functions", {}).values() for g in fn["findings"]]:
            if verdict in (None, f["verdict"]):
                yield f


def clean():
    @mb.program(input_specs=[fp16(1, 64, 64)], opset_version=iOS18)
    def prog(x):
        return mb.relu(x=mb.mul(x=x, y=np.full((1, 1, 64), 0.5, np.float16)))

    return prog


def rank6():
    @mb.program(input_specs=[fp16(1, 2, 2, 2, 2, 32)], opset_version=iOS18)
    def prog(x):
        return mb.relu(x=x)

    return prog


def symbolic():
    @mb.program(input_specs=[fp16(1, get_new_symbol(), 64)], opset_version=iOS18)
    def prog(x):
        return mb.relu(x=x)

    return prog


def fp32_compute():
    @mb.program(input_specs=[mb.TensorSpec((1, 64), dtype=types.fp32)], opset_version=iOS18)
    def prog(x):
        return mb.mul(x=x, y=np.linspace(0, 1, 64, dtype=np.float32)[None])

    return prog


def gather_table(rows):
    @mb.program(input_specs=[mb.TensorSpec((1,), dtype=types.int32)], opset_version=iOS18)
    def prog(i):
        return mb.gather(x=np.ones((rows, 64), np.float16), indices=i, axis=0)

    return prog


def int_add(n):
    @mb.program(input_specs=[mb.TensorSpec((1, n), dtype=types.int32)], opset_version=iOS18)
    def prog(p):
        return mb.add(x=p, y=np.int32(1))

    return prog


def stateful(shape, count=1):
    specs = [mb.StateTensorSpec(shape, dtype=types.fp16) for _ in range(count)] + [fp16(*shape)]

    def accumulate(states, x):
        for s in states:
            x = mb.add(x=x, y=mb.read_state(input=s))
            mb.coreml_update_state(state=s, value=x)
        return x

    if count == 1:
        return mb.program(input_specs=specs, opset_version=iOS18)(lambda a, x: accumulate([a], x))
    return mb.program(input_specs=specs, opset_version=iOS18)(lambda a, b, c, x: accumulate([a, b, c], x))


def palettized_stateful():
    @mb.program(input_specs=[mb.StateTensorSpec((1, 64), dtype=types.fp16), fp16(1, 64)], opset_version=iOS18)
    def prog(s, x):
        y = mb.linear(x=mb.add(x=x, y=mb.read_state(input=s)), weight=np.eye(64, dtype=np.float16))
        mb.coreml_update_state(state=s, value=y)
        return y

    config = ct.optimize.coreml.OpPalettizerConfig(mode="uniform", nbits=4, weight_threshold=1)
    return ct.optimize.coreml.palettize_weights(convert(prog), ct.optimize.coreml.OptimizationConfig(config))


def singleton_last_axis():
    @mb.program(input_specs=[fp16(1, 64, 64)], opset_version=iOS18)
    def prog(x):
        y = mb.relu(x=mb.reshape(x=x, shape=(1, 4096, 1)))
        return mb.reshape(x=y, shape=(1, 64, 64))

    return prog


def constant(value):
    @mb.program(input_specs=[fp16(1, 64)], opset_version=iOS18)
    def prog(x):
        c = np.ones((1, 64), np.float16)
        c[0, 3] = value
        return mb.add(x=x, y=c)

    return prog


def test_a_clean_program_passes_with_no_findings(tmp_path):
    report = audit_bundle(write_bundle(tmp_path, clean()))
    assert report["verdict"] == "pass" and report["chunks"][0]["functions"]["main"]["verdict"] == "pass"
    assert list(findings(report)) == []
    assert json.loads(json.dumps(report)) == report  # JSON-able as it is


# each program breaks exactly one rule: the audit names that rule and the op, and nothing else fails
BROKEN = [
    ("rank", rank6, "relu", "rank 6"),
    ("static", symbolic, "relu", "symbolic shape"),
    ("fp16", fp32_compute, "mul", "computes in fp32"),
    ("fp16", fp32_compute, "const", "fp32 tensor (1, 64) feeding mul.y"),
    ("int", lambda: gather_table(512), "gather", "gathers from fp16 (512, 64)"),
    ("int", lambda: int_add(128), "add", "int32 (1, 128)"),
    ("state", lambda: stateful((2, 33)), "state", "last axis 33 not a multiple of 32"),
    ("state", lambda: stateful((2, 32), count=3), "state", "3 states (at most 2)"),
    ("last-axis", singleton_last_axis, "relu", "last axis 1 (singleton): fp16 (1, 4096, 1)"),
    ("finite", lambda: constant(np.inf), "const", "inf/NaN in fp16 (1, 64) feeding add.y"),
    ("finite", lambda: constant(-65504.0), "const", "|v| = 65504 (fp16's limit)"),
]


@pytest.mark.filterwarnings("ignore:Some dimensions in the input shape are unknown")
@pytest.mark.parametrize("rule,make,op,detail", BROKEN, ids=[f"{b[0]}-{b[3][:24]}" for b in BROKEN])
def test_each_broken_rule_is_named_with_its_op(tmp_path, monkeypatch, rule, make, op, detail):
    # coremltools itself refuses rank > 5 while converting: let it write one, as another tool might
    monkeypatch.setattr(Program, "_check_early_error_out_for_invalid_program", lambda self: None)
    precision = ct.precision.FLOAT32 if make is fp32_compute else ct.precision.FLOAT16
    report = audit_bundle(write_bundle(tmp_path, make(), precision))
    hits = [f for f in findings(report, "violation") if f["rule"] == rule and f["op"] == op and detail in f["detail"]]
    assert hits, format_audit(report)
    assert {f["rule"] for f in findings(report, "violation")} == {rule}
    assert report["verdict"] == report["chunks"][0]["verdict"] == "fail"
    assert f"rule {rule}: " in format_audit(report)


def rsqrt_with_fp32_epsilon():
    @mb.program(input_specs=[fp16(1, 64)], opset_version=iOS18)
    def prog(x):
        return mb.rsqrt(x=mb.abs(x=x), epsilon=np.float32(1e-6))

    return prog


def test_what_stays_a_note(tmp_path):
    """An fp32 scalar parameter of an fp16 op, a gather from a small table, small index arithmetic, a
    size-16 second-to-last state axis, 4-bit LUT weights beside states: reported, and the program passes."""
    for make, rule, op, detail in [
        (rsqrt_with_fp32_epsilon, "fp16", "const", "fp32 scalar parameter rsqrt.epsilon = 1e-06"),
        (lambda: gather_table(16), "int", "gather", "gathers from fp16 (16, 64)"),
        (lambda: int_add(64), "int", "add", "int32 (1, 64) from int32 (1, 64)"),
        (lambda: stateful((2, 16, 64)), "state", "state", "second-to-last axis 16"),
        (palettized_stateful, "lut4-state", "constexpr_lut_to_dense", "4-bit LUT weights and states, coremltools ?"),
    ]:
        report = audit_bundle(write_bundle(tmp_path / rule / op, make()))
        notes = [f for f in findings(report) if f["rule"] == rule and f["op"] == op]
        assert [f["verdict"] for f in notes] == ["note"] and detail in notes[0]["detail"], format_audit(report)
        assert report["verdict"] == "pass", format_audit(report)


def test_compiled_chunks_are_not_audited(tmp_path, capsys):
    (tmp_path / "chunk_1.mlmodelc").mkdir()
    report = audit_bundle(tmp_path)
    assert report["chunks"][0]["verdict"] == report["verdict"] == "not audited"
    assert "audit the .mlpackage before compiling" in format_audit(report)
    assert main(["inspect", str(tmp_path), "--ane"]) == 1


def test_every_model_beside_the_chunks_is_audited_and_counts(tmp_path):
    """A vision model or drafter is audited like a chunk: its violation fails the bundle, and a compiled one
    is 'not audited' rather than skipped (inspect --ane used to say "pass" without looking at them)."""
    root = write_bundle(tmp_path, clean())
    convert(singleton_last_axis(), ct.precision.FLOAT16).save(str(root / "vision.mlpackage"))
    report = audit_bundle(root)
    assert [m["name"] for m in report["models"]] == ["vision"] and report["models"][0]["verdict"] == "fail"
    assert report["verdict"] == "fail" and "vision (vision.mlpackage): fail" in format_audit(report)
    shutil.rmtree(root / "vision.mlpackage")
    (root / "assistant.mlmodelc").mkdir()
    report = audit_bundle(root)
    assert [(m["name"], m["verdict"]) for m in report["models"]] == [("assistant", "not audited")]
    assert report["verdict"] == "not audited"


# -- the host's mask ------------------------------------------------------------------------------


def host_findings():
    return list(audit.check_host_mask())


def test_the_hosts_mask_is_finite_for_the_scores_it_states():
    [(verdict, _, name, detail)] = host_findings()
    assert name == "MASK_BLOCKED" and verdict == "note", detail
    # what the host promises, in fp16 arithmetic: the sum and its distance from the row's max stay
    # finite for every |score| up to its bound, and the bound covers what the audit requires
    mask, bound = np.float16(host.MASK_BLOCKED), np.float16(host.MASK_SCORE_BOUND)
    assert np.isfinite(np.float16(mask - bound) - bound) and host.MASK_SCORE_BOUND >= audit.SCORE_BOUND
    with np.errstate(over="ignore"):  # the overflow is what is asserted
        assert not np.isfinite(np.float16(mask - np.float16(bound + 64)) - np.float16(bound + 64))  # the bound is tight


def test_the_fp16_limit_as_a_mask_is_a_violation(monkeypatch):
    monkeypatch.setattr(host, "MASK_BLOCKED", np.float16(-65504.0))
    [(verdict, _, _, detail)] = host_findings()
    assert verdict == "violation" and "-inf in fp16 for scores below -16" in detail
    monkeypatch.setattr(audit, "SCORE_BOUND", 20000.0)  # more than -40000 tolerates
    monkeypatch.setattr(host, "MASK_BLOCKED", np.float16(-40000.0))
    assert host_findings()[0][0] == "violation"


# -- the shared tiny bundles ----------------------------------------------------------------------


@pytest.mark.slow  # the fixture comes through getfixturevalue, which conftest's auto-marking cannot see
@pytest.mark.parametrize("name", ["tiny_bundle16", "tiny_bundle4", "tiny_published"])
def test_tiny_bundles(request, name):
    root = request.getfixturevalue(name)
    report = audit_bundle(root)
    assert report["verdict"] == "pass" and not list(findings(report, "violation")), format_audit(report)
    for c in report["chunks"]:
        pkg = Package.open(root / c["path"])
        program, states = pkg.program(), pkg.interface()["states"]
        assert bool(states) == (c["name"] != "chunk_3")
        for fname, f in c["functions"].items():
            by_rule = {}
            for g in f["findings"]:
                by_rule.setdefault(g["rule"], []).append(g)
            assert set(by_rule) <= {"fp16", "int"}, by_rule
            # the fp32 constants are exactly the epsilons of rsqrt, one per RMSNorm: scalar parameters
            rsqrt = sum(op.op_type == "rsqrt" for op in program.functions[fname].operations)
            [eps] = by_rule["fp16"]
            assert eps["detail"] == "fp32 scalar parameter rsqrt.epsilon = 1e-12" and eps["count"] == rsqrt > 0
            # int work: position bookkeeping and the KV writes it places, and the published head's argmax
            expected = {"add", "concat", "slice_update"} if states else set()
            if name == "tiny_published" and c["name"] == "chunk_3":
                expected.add("reduce_argmax")
            assert {g["op"] for g in by_rule.get("int", [])} == expected, by_rule.get("int")
            assert all(g["verdict"] == "note" for g in by_rule.get("int", []))
        # the tiny model's window (16 slots) is no multiple of 32: a note on the sliding cache alone
        rules = sorted(g["rule"] for g in c["findings"])
        assert rules == ((["lut4-state", "state"] if name == "tiny_bundle4" else ["state"]) if states else [])
        for g in c["findings"]:
            assert g["verdict"] == "note"
            if g["rule"] == "state":
                assert g["example"] == "kv_cache_sliding" and "second-to-last axis 16" in g["detail"], g


# -- the command line -----------------------------------------------------------------------------


def test_cli_exit_codes_and_json(tmp_path, capsys):
    good, bad = write_bundle(tmp_path / "good", clean()), write_bundle(tmp_path / "bad", singleton_last_axis())
    assert main(["inspect", str(good), "--ane", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"bundle", "rules", "chunks", "models", "host", "verdict"} and report["verdict"] == "pass"
    assert set(report["rules"]) == set(audit.FUNCTION_CHECKS) | set(audit.CHUNK_CHECKS)
    [chunk] = report["chunks"]
    assert {"name", "path", "verdict", "findings", "functions"} <= set(chunk)
    assert main(["inspect", str(bad), "--ane", "--json"]) == 1
    [f] = [
        g
        for g in json.loads(capsys.readouterr().out)["chunks"][0]["functions"]["main"]["findings"]
        if g["op"] == "relu"
    ]
    assert set(f) == {"rule", "verdict", "op", "count", "example", "detail"} and f["count"] == 1
    assert main(["inspect", str(bad), "--ane"]) == 1
    out = capsys.readouterr().out
    assert "last-axis violation: relu x1 (relu_0)" in out and out.rstrip().endswith("Neural Engine audit: fail")
    assert main(["inspect", str(tmp_path / "nowhere"), "--ane"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("gemma-ane inspect: error: ") and "not a bundle directory" in err[0]

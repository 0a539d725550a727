"""`convert --quant {lut,block}` and `--keep`: the weight pass picks LUT or block-wise per weight, `inspect` shows
which, `inspect --ane` notes where the Neural Engine's support is documented, and a checkpoint on q4_0's grid
converted with `block` is lossless up to fp16 arithmetic (bench/quant_quality.py builds it)."""

import json
import re
import sys
import time
import warnings
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from gemma_ane.bundle.spec import ModelSpec
from gemma_ane.cli import main
from gemma_ane.convert import ConvertError, ConvertOptions
from gemma_ane.convert.blockquant import dequantize_blockwise
from gemma_ane.convert.coreml import _palettize_pass
from gemma_ane.mil.executor import MILModel
from gemma_ane.mil.package import Package, weight_formats
from gemma_ane.runtime.audit import audit_bundle, format_audit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from quant_quality import both_grids, corpus, int8_row_grid, move_onto_grid, q4_0_grid  # noqa: E402

iOS18 = ct.target.iOS18


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(quant="kmeans"), "--quant 'kmeans': choose lut or block"),
        (dict(quant="block", bits=6), "--bits 6: --quant block stores int4 or int8; choose 4, 8 or 16"),
        (dict(quant="block", vision_bits=6), "--vision-bits 6: --quant block stores int4 or int8"),
        (dict(keep=("layers_(",)), r"--keep 'layers_\(': not a regular expression"),
        # Python's parser recursed once per group: a RecursionError traceback
        (dict(keep=("(" * 5000 + "a" + ")" * 5000,)), r"\.\.\.: 10001 characters \(at most 500\)"),
        (dict(keep=("(" * 17 + "o_proj" + ")" * 17,)), r"groups nested 17 deep \(at most 16\)"),
        # each ran for hours on a name it did not match: exponential backtracking
        (dict(keep=(r"(\w|\w)*!",)), r"a repeated group holds another repeat or an alternation"),
        (
            dict(keep=(r"o_proj", r"(layers_\d+_)+x")),
            re.escape("--keep " + repr(r"(layers_\d+_)+x") + ": a repeated group"),
        ),
    ],
)
def test_bad_quantization_options_are_refused_in_one_line(options, message):
    started = time.monotonic()
    with pytest.raises(ConvertError, match=message) as e:
        ConvertOptions(**options).check()
    assert "\n" not in str(e.value) and time.monotonic() - started < 1


@pytest.mark.parametrize(
    "keep", [r"layers_0_.*o_proj", r"(q|k|v)_proj", r"layers\.(1|2)\.", r"[qkv]_proj+", r"(?:ab)*c"]
)
def test_ordinary_keep_patterns_pass(keep):
    ConvertOptions(keep=(keep,)).check()


@pytest.mark.parametrize(
    "options, refused",
    [
        (dict(quant="block", group_size=3), "does not divide 64, the inputs"),  # it divides none of e2b-mini's
        (dict(quant="block", group_size=2**40), "does not divide 64, the inputs"),
        (dict(quant="block", group_size=128), "does not divide 64, the inputs"),  # divides some, not the hidden width
        (dict(quant="lut", group_size=2**40), "does not divide 32, the output rows"),  # divides none
        (dict(quant="block", group_size=32), None),
        (dict(quant="block", group_size=64), None),
        (dict(quant="lut", group_size=128), None),  # some rows stay fp16, with a note (as gqa-mini's at 32)
        (dict(quant="block", group_size=3, bits=16), None),  # nothing is quantized
    ],
)
def test_a_group_size_that_leaves_the_weights_fp16_is_refused(tiny_e2b, options, refused):
    spec = ModelSpec.from_pretrained(tiny_e2b)
    divisor = 64 if options["quant"] == "block" else 16  # e2b-mini: inputs 64, 128, 256; rows 32 ... 512 and 240
    if refused is None:
        ConvertOptions(**options).check_group_size(spec)
        return
    with pytest.raises(ConvertError, match=rf"^--group-size {options['group_size']}: {refused}.*divisor of {divisor}$"):
        ConvertOptions(**options).check_group_size(spec)


def test_convert_refuses_the_group_size_before_converting(tiny_e2b, tmp_path, capsys):
    out = tmp_path / "out"
    rc, text, err = run(capsys, "convert", tiny_e2b, out, "--quant", "block", "--group-size", 3, "--quiet")
    assert rc == 2 and err.count("\n") == 1 and "--group-size 3: does not divide 64" in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.partial*"))


def test_the_cli_refuses_before_reading_the_checkpoint(capsys, tmp_path):
    rc, out, err = run(capsys, "convert", tmp_path / "missing", tmp_path / "out", "--quant", "block", "--bits", "6")
    assert rc == 2 and err.count("\n") == 1 and "--quant block stores int4 or int8" in err, err
    assert not (tmp_path / "out").exists()


def test_the_manifest_states_quantization_only_when_not_the_default():
    """A default conversion's manifest is the one written before --quant existed (tests/test_byte_identity.py)."""
    assert {"quant", "keep"}.isdisjoint(ConvertOptions().record())
    record = ConvertOptions(quant="block", keep=("lm_head",)).record()
    assert record["quant"] == "block" and list(record["keep"]) == ["lm_head"]
    assert json.loads(json.dumps(record))["keep"] == ["lm_head"]


def grid_weight(out, cols, seed):
    rng = np.random.default_rng(seed)
    return q4_0_grid(rng.normal(0, 0.03, (out, cols)).astype(np.float32)).astype(np.float16)


def linear_program(weights: dict):
    """One linear op per named fp16 weight, applied in turn to a [1, 128] input."""

    @mb.program(input_specs=[mb.TensorSpec((1, 128), dtype=types.fp16)], opset_version=iOS18)
    def prog(x):
        for name, w in weights.items():
            x = mb.linear(x=x, weight=mb.const(val=w, name=name))
        return x

    return prog


def saved_main(prog, path: Path):
    """A program's main function as saved and read back (the package reader reads saved programs only)."""
    ct.convert(prog, minimum_deployment_target=iOS18, pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True).save(
        str(path)
    )
    return Package.open(path).program().functions["main"]


def test_the_pass_stores_block_weights_keeps_matches_and_skips_what_does_not_divide(tmp_path):
    weights = {
        "layers_0_q_proj_weight": grid_weight(128, 128, 0),  # blocks of 32 inputs: block int4
        "layers.0.o_proj.weight": grid_weight(128, 128, 1),  # kept by --keep, named as traced
    }
    odd = {"layers_0_odd_weight": np.full((48, 128), 0.01, np.float16)}
    prog = linear_program({**weights, **odd})
    options = ConvertOptions(quant="block", bits=4, group_size=32, keep=("layers_0_o_proj",))  # as saved
    skipped, kept = set(), set()
    _palettize_pass(ConvertOptions(quant="block", group_size=48, keep=("o_proj",)), {}, skipped, kept)(
        linear_program(odd)
    )
    assert skipped == {"layers_0_odd_weight (48, 128)"}  # 128 inputs do not divide into blocks of 48
    skipped, kept = set(), set()
    _palettize_pass(options, {}, skipped, kept)(prog)
    assert kept == {"layers_0_o_proj_weight"} and not skipped  # named as saved, and as inspect shows it
    fn = prog.functions["main"]
    producers = {op.weight.op.name: op.weight.op for op in fn.operations if op.op_type == "linear"}
    assert producers["layers.0.o_proj.weight"].op_type == "const"
    block = producers["layers_0_q_proj_weight_quantized"]
    assert block.op_type == "constexpr_blockwise_shift_scale"
    assert types.builtin_to_string(block.data.dtype) == "int4" and block.scale.shape == (128, 4)
    # on the grid: the stored integers and scales give the weight back bit for bit
    q, scale = block.data.val.astype(np.int8), block.scale.val
    np.testing.assert_array_equal(dequantize_blockwise(q, scale), weights["layers_0_q_proj_weight"].astype(np.float32))
    assert weight_formats(saved_main(prog, tmp_path / "p.mlpackage")) == {
        "formats": {"block int4 / 32 inputs": 2, "fp16": 1},
        "fp16": ["layers_0_o_proj_weight"],  # as saved
    }


def test_the_lut_pass_is_the_default_and_inspect_and_the_audit_name_each_form(tmp_path):
    w = {"a_weight": grid_weight(128, 128, 2), "b_weight": grid_weight(128, 128, 3)}
    lut, block = linear_program(w), linear_program(w)
    _palettize_pass(ConvertOptions(), {}, set())(lut)
    _palettize_pass(ConvertOptions(quant="block", bits=8), {}, set())(block)
    for name, prog in (("lut", lut), ("block", block)):
        model = ct.convert(
            prog, minimum_deployment_target=iOS18, pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True
        )
        model.save(str(tmp_path / name / "chunk_1.mlpackage"))
    saved = Package.open(tmp_path / "lut" / "chunk_1.mlpackage").program().functions["main"]
    assert weight_formats(saved)["formats"] == {"lut 4-bit / 32 rows": 2}
    saved = Package.open(tmp_path / "block" / "chunk_1.mlpackage").program().functions["main"]
    assert weight_formats(saved) == {"formats": {"block int8 / 32 inputs": 2}, "fp16": []}
    # the executor runs the saved block-wise program as the fp16 weights it stores
    x = np.random.default_rng(4).normal(size=(1, 128)).astype(np.float16)
    want = x.astype(np.float32) @ w["a_weight"].astype(np.float32).T @ w["b_weight"].astype(np.float32).T
    got = MILModel(tmp_path / "block" / "chunk_1.mlpackage", precision="fp32").predict({"x": x})
    np.testing.assert_allclose(next(iter(got.values())), want, rtol=1e-5, atol=1e-6)
    report = audit_bundle(tmp_path / "block")
    found = [f for c in report["chunks"] for f in c["findings"] if f["rule"] == "block"]
    # per-block weights leave the Neural Engine (coremltools#2510) and were reported wrong there (coreai-models#279)
    assert [(n["verdict"], n["count"]) for n in found] == [("violation", 2)] and report["verdict"] == "fail"
    assert "int8 weights, one scale per 32 inputs: per-block, runs on the CPU" in found[0]["detail"]
    text = format_audit(report)
    assert "rule block: Core ML runs per-block linear weights" in text  # a violation prints its rule, and why
    assert "coremltools issue 2510" in text and "coreai-models issue 279" in text
    assert not [f for c in audit_bundle(tmp_path / "lut")["chunks"] for f in c["findings"] if f["rule"] == "block"]
    assert audit_bundle(tmp_path / "lut")["verdict"] == "pass"


def test_per_channel_block_weights_stay_a_note(tmp_path):
    """One scale per row (--group-size = the input width) is the per-channel form the Neural Engine executes."""
    prog = linear_program({"a_weight": grid_weight(64, 128, 2)})
    _palettize_pass(ConvertOptions(quant="block", bits=8, group_size=128), {}, set())(prog)
    ct.convert(prog, minimum_deployment_target=iOS18, pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True).save(
        str(tmp_path / "b" / "chunk_1.mlpackage")
    )
    report = audit_bundle(tmp_path / "b")
    [found] = [f for c in report["chunks"] for f in c["findings"] if f["rule"] == "block"]
    assert found["verdict"] == "note" and "per-channel" in found["detail"] and report["verdict"] == "pass"


def test_convert_warns_that_block_weights_leave_the_neural_engine(tiny_e2b, tmp_path):
    """Said once the options are checked, before the conversion (here refused right after it: OUT lies inside the
    checkpoint), so a user who picked block for its exact QAT result can still choose."""
    from gemma_ane.convert import convert

    with pytest.warns(UserWarning, match=r"^--quant block: Core ML runs per-block linear weights .* on the CPU") as w:
        with pytest.raises(ConvertError, match="must not be, hold or lie inside the checkpoint"):
            convert(str(tiny_e2b), str(tiny_e2b / "out"), ConvertOptions(quant="block"), progress=False)
    assert "coremltools issue 2510" in str(w[0].message) and "coreai-models issue 279" in str(w[0].message)
    for options in (ConvertOptions(), ConvertOptions(quant="block", bits=16)):  # LUT; nothing quantized
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ConvertError, match="must not be, hold or lie inside the checkpoint"):
                convert(str(tiny_e2b), str(tiny_e2b / "out"), options, progress=False)


def test_the_grids_are_exact_where_the_bundle_reads_them():
    """bench/quant_quality.py's grids: q4_0's comes back from the block quantizer bit for bit, the int8 rows from
    host.quantize_rows, and the tied embedding's from both."""
    from gemma_ane.bundle.host import quantize_rows
    from gemma_ane.convert.blockquant import quantize_blockwise

    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.03, (64, 256)).astype(np.float32)

    def block_exact(g):
        q, s = quantize_blockwise(g.astype(np.float16), 4, 32)
        return np.array_equal(dequantize_blockwise(q, s), g)

    def rows_exact(g):
        q, s = quantize_rows(g)
        return np.array_equal(q.astype(np.float32) * (s.astype(np.float32) / 127)[:, None], g)

    assert block_exact(q4_0_grid(w)) and rows_exact(int8_row_grid(w)) and not block_exact(w)
    tied = both_grids(w)
    assert block_exact(tied) and rows_exact(tied)
    assert np.corrcoef(tied.ravel(), w.ravel())[0, 1] > 0.9  # still the weight it was moved from


@pytest.mark.slow
def test_a_q4_0_grid_checkpoint_converts_losslessly_with_block(tiny_e2b, tmp_path, capsys):
    """The q4_0-grid variant of e2b-mini, `convert --quant block --bits 4` (one weight kept fp16 by --keep):
    against transformers in fp32 arithmetic, KLD mean <= 1e-5 and top-1 1.0; inspect and the records say how."""
    grid = move_onto_grid(tiny_e2b, tmp_path / "grid")
    out = tmp_path / "bundle"
    argv = ["convert", grid, out, "--quant", "block", "--bits", 4, "--context", 64, "--no-vision", "--quiet"]
    rc, text, err = run(capsys, *argv, "--keep", "layers_0_.*o_proj")
    assert rc == 0, err
    assert "kept fp16 by --keep" in text and "o_proj" in text
    rc, text, err = run(
        capsys,
        "eval",
        grid,
        "--bundle",
        out,
        "--text",
        corpus(tmp_path / "t.txt", 120),
        "--context",
        64,
        "--precision",
        "fp32",
        "--json",
        "--quiet",
    )
    assert rc == 0, err
    report = json.loads(text)
    assert report["tokens"] > 100
    assert report["kld_mean"] <= 1e-5 and report["top1_agreement"] == 1.0, report
    rc, text, err = run(capsys, "inspect", out, "--no-sha")
    assert rc == 0, err
    assert "block int4 / 32 inputs" in text and "lut" not in text
    assert "fp16 (>= 2048 values): " in text and "o_proj" in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["quant"] == "block" and manifest["options"]["keep"] == ["layers_0_.*o_proj"]
    config = json.loads((out / "model_config.json").read_text())
    assert config["quantization"] == "int4"
    assert config["weights"] == {
        "quant": "block",
        "bits": 4,
        "group_size": 32,
        "group_axis": "input",
        "keep": ["layers_0_.*o_proj"],
    }
    assert "int4 block-wise linear quantization" in (out / "README.md").read_text()

"""`gemma-ane convert` and `gemma-ane inspect` on the tiny E2B-shaped checkpoint.

Conversions cost ~30 s each here, so the tiny checkpoint is converted once at --bits 16 and once
at --bits 4 (module fixtures) and every check reads those two bundles. Everything that can be
read back is read with coremltools itself (the protobuf spec, the MIL proto, the milproto loader)
or recomputed from the checkpoint with numpy and transformers, never from our own metadata: the
point is to catch a converter that writes a manifest describing a bundle it did not build.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from gemma_ane.bundle.plan import ChunkPlan
from gemma_ane.bundle.spec import FULL, SLIDING, ModelSpec
from gemma_ane.convert import ConvertError, ConvertOptions, StageTimer, convert

CONTEXT = 128
LM = "model.language_model."
GROUP = 32
# coremltools' OpPalettizerConfig default weight_threshold: smaller weights stay dense. Our pass
# uses the same cut-off; at E2B dims every linear weight is far above it.
WEIGHT_THRESHOLD = 2048
WEIGHTS = Path("Data/com.apple.CoreML/weights/weight.bin")


# -- fixtures ------------------------------------------------------------------------------------


def _partials(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.partial-*"))


@pytest.fixture(scope="module")
def bundle16(tiny_bundle16):
    return {"path": tiny_bundle16, "seconds": json.loads((tiny_bundle16.parent / "seconds.json").read_text())}


@pytest.fixture(scope="module")
def bundle4(tiny_bundle4):
    return {"path": tiny_bundle4, "seconds": json.loads((tiny_bundle4.parent / "seconds.json").read_text())}


@pytest.fixture(params=[16, 4], ids=["bits16", "bits4"])
def bundle(request):
    b = request.getfixturevalue(f"bundle{request.param}")
    return {**b, "bits": request.param}


# The published layout's functions map one to one onto checkpoint weights; the KV-only prefill
# functions (a slice of the PLE projection, owning layers only) are checked in test_kv_prefill.
PUBLISHED_FUNCTIONS = {"infer", "prefill_b8"}


@pytest.fixture(scope="module")
def plan(tiny_e2b) -> ChunkPlan:
    # the converter's default KV-only prefill batches: those of 64 and 8 that divide the window (16)
    return ChunkPlan.build(ModelSpec.from_pretrained(tiny_e2b), CONTEXT, kv_batches=(8,))


@pytest.fixture(scope="module")
def text_cfg(tiny_e2b) -> dict:
    """The tiny text config, with `global_head_dim` filled in from `per_layer_config` (the form
    transformers 5.24 writes) so the checks below can use either spelling."""
    t = json.loads((tiny_e2b / "config.json").read_text())["text_config"]
    if "global_head_dim" not in t:
        dims = {v["head_dim"] for v in t["per_layer_config"].values()}
        assert len(dims) == 1, dims
        t["global_head_dim"] = dims.pop()
    return t


@pytest.fixture(scope="module")
def ckpt_np(tiny_e2b) -> dict:
    """The checkpoint's text tensors as float32, read with safetensors (not our loader)."""
    from safetensors.numpy import load_file

    return {
        k[len(LM) :]: v.astype(np.float32)
        for k, v in load_file(tiny_e2b / "model.safetensors").items()
        if k.startswith(LM)
    }


_programs: dict = {}


def load_program(package: Path):
    """The pymil program of a saved package, through coremltools' own milproto loader."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load

    if package not in _programs:
        spec = ct.utils.load_spec(str(package))
        _programs[package] = load(spec, spec.specificationVersion, str(package / WEIGHTS.parent))
    return _programs[package]


def load_spec(package: Path):
    import coremltools as ct

    return ct.utils.load_spec(str(package))


# -- reading the proto ---------------------------------------------------------------------------


def _dtype_name(enum_value) -> str:
    from coremltools.proto import FeatureTypes_pb2

    name = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(enum_value)
    return {"FLOAT16": "float16", "FLOAT32": "float32", "INT32": "int32"}.get(name, name)


def feature(f, kind: str) -> dict:
    which = f.type.WhichOneof("Type")
    assert which == kind, (f.name, which)
    arr = f.type.stateType.arrayType if kind == "stateType" else f.type.multiArrayType
    return {"shape": [int(d) for d in arr.shape], "dtype": _dtype_name(arr.dataType)}


def proto_ops(spec, function: str) -> list:
    fn = spec.mlProgram.functions[function]
    return list(fn.block_specializations[fn.opset].operations)


def tensor_type(value_type):
    from coremltools.proto import MIL_pb2

    t = value_type.tensorType
    return MIL_pb2.DataType.Name(t.dataType), [int(d.constant.size) for d in t.dimensions]


def blob_refs(spec, function: str) -> dict:
    """(producing op output, input/attribute key) -> offset in weight.bin, for every blob value."""
    refs = {}
    for op in proto_ops(spec, function):
        out = op.outputs[0].name if op.outputs else op.type
        for key, arg in op.inputs.items():
            for a in arg.arguments:
                if a.WhichOneof("binding") == "value" and a.value.WhichOneof("value") == "blobFileValue":
                    refs[(out, key)] = a.value.blobFileValue.offset
        for key, val in op.attributes.items():
            if val.WhichOneof("value") == "blobFileValue":
                refs[(out, key)] = val.blobFileValue.offset
    return refs


def mil_base_name(mil_name: str) -> str:
    """`layers_3_mlp_up_proj_weight_to_fp16_palettized` -> `layers_3_mlp_up_proj_weight`."""
    return re.sub(r"(_to_fp16)?(_palettized)?$", "", mil_name)


def snr_db(ref, approx) -> float:
    ref = np.asarray(ref, np.float64)
    noise = ref - np.asarray(approx, np.float64)
    return float(10 * np.log10((ref**2).sum() / (noise**2).sum()))


def tree_files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- the I/O contract, read back with coremltools ------------------------------------------------


def test_io_contract_read_back_from_the_packages(bundle, plan):
    expected = plan.to_json()
    assert sorted(p.name for p in bundle["path"].glob("chunk_*")) == [
        f"{c['name']}.mlpackage" for c in expected["chunks"]
    ]
    for c in expected["chunks"]:
        spec = load_spec(bundle["path"] / f"{c['name']}.mlpackage")
        assert spec.WhichOneof("Type") == "mlProgram"
        assert spec.specificationVersion >= 9, "states and constexpr_lut_to_dense need the iOS18 spec (9)"
        desc = spec.description
        assert desc.defaultFunctionName == "infer"
        assert sorted(f.name for f in desc.functions) == sorted(c["functions"])
        assert sorted(spec.mlProgram.functions) == sorted(c["functions"])
        assert len(c["states"]) <= 2  # three states fail at predict on iPhone (CONTRACT §5)
        for f in desc.functions:
            want = c["functions"][f.name]
            got_in = {x.name: feature(x, "multiArrayType") for x in f.input}
            got_out = {x.name: feature(x, "multiArrayType") for x in f.output}
            got_states = {x.name: feature(x, "stateType") for x in f.state}
            assert got_in == want["inputs"], (c["name"], f.name)
            assert got_out == want["outputs"], (c["name"], f.name)
            assert got_states == c["states"], (c["name"], f.name)
    # spot-check the contract itself, so a plan that drifted with the converter would not pass
    c3 = expected["chunks"][2]["functions"]["infer"]
    assert c3["outputs"] == {"logits": {"shape": [1, 1, 512], "dtype": "float16"}}
    c1 = expected["chunks"][0]["functions"]["prefill_b8"]["inputs"]
    assert c1["current_pos"] == c1["ring_pos"] == {"shape": [1], "dtype": "int32"}


def test_stage_timings_are_reported(bundle):
    stages = set(bundle["seconds"])
    assert {"load", "trace", "convert", "merge", "sidecars"} <= stages, stages
    assert ("palettize" in stages) == (bundle["bits"] == 4), stages
    assert all(v >= 0 for v in bundle["seconds"].values())


# -- weights: 4-bit LUTs and 16-bit dense ---------------------------------------------------------


def _linear_weights(spec, function):
    """[(weight var name, producing proto op)] for every linear op of a function."""
    producers = {o.name: op for op in proto_ops(spec, function) for o in op.outputs}
    out = []
    for op in proto_ops(spec, function):
        if op.type == "linear":
            name = op.inputs["weight"].arguments[0].name
            assert name in producers, f"linear weight {name} has no producing op"
            out.append((name, producers[name]))
    return out


def test_4bit_linear_weights_are_lut_palettized(bundle4, plan, ckpt_np):
    palettized = 0
    for chunk in plan.chunks:
        package = bundle4["path"] / f"{chunk.name}.mlpackage"
        spec = load_spec(package)
        program = load_program(package)
        for fname in PUBLISHED_FUNCTIONS & set(chunk.functions):
            constexpr_total = sum(op.type == "constexpr_lut_to_dense" for op in proto_ops(spec, fname))
            seen = 0
            pymil_ops = {op.outputs[0].name: op for op in program.functions[fname].operations}
            for name, op in _linear_weights(spec, fname):
                dtype, (rows, cols) = tensor_type(op.outputs[0].type)
                assert dtype == "FLOAT16"
                should = rows % GROUP == 0 and rows * cols >= WEIGHT_THRESHOLD
                assert (op.type == "constexpr_lut_to_dense") == should, (chunk.name, fname, name, op.type, rows, cols)
                if not should:
                    assert op.type == "const", (name, op.type)
                    continue
                seen += 1
                lut_arg = op.inputs["lut"].arguments[0].value.type
                idx_arg = op.inputs["indices"].arguments[0].value.type
                assert tensor_type(lut_arg) == ("FLOAT16", [rows // GROUP, 1, 16, 1]), name
                # UINT4 in the proto: stored as 4-bit, not an int8/uint8 array that happens to hold <16
                assert tensor_type(idx_arg) == ("UINT4", [rows, cols]), name

                p = pymil_ops[name]
                lut = np.asarray(p.lut.val, np.float16).reshape(rows // GROUP, 16)
                idx = np.asarray(p.indices.val).astype(np.int64)
                assert idx.shape == (rows, cols) and idx.min() >= 0 and idx.max() < 16
                dense = lut[np.arange(rows)[:, None] // GROUP, idx]
                ref = _ckpt_weight(ckpt_np, name)
                assert ref.shape == (rows, cols), name
                assert snr_db(ref, dense) > 15.0, (name, snr_db(ref, dense))
            assert seen == constexpr_total > 0, (chunk.name, fname)
            palettized += seen
    # the tied LM head is palettized too (CONTRACT §5: all weights incl. the LM head)
    lm = [
        n
        for n, op in _linear_weights(load_spec(bundle4["path"] / "chunk_3.mlpackage"), "infer")
        if n.startswith("lm_head")
    ]
    assert lm and lm[0].endswith("_palettized"), lm
    assert palettized > 50


def _ckpt_weight(ckpt_np: dict, mil_name: str) -> np.ndarray:
    """The checkpoint tensor behind a MIL weight name (the LM head is the tied embedding)."""
    base = mil_base_name(mil_name)
    if base == "lm_head_weight":
        return ckpt_np["embed_tokens.weight"]
    by_mil = {k.replace(".", "_"): k for k in ckpt_np}
    assert base in by_mil, f"{mil_name}: no checkpoint tensor of that name"
    return ckpt_np[by_mil[base]]


def test_16bit_weights_are_dense_and_exact(bundle16, plan, ckpt_np):
    for chunk in plan.chunks:
        package = bundle16["path"] / f"{chunk.name}.mlpackage"
        spec = load_spec(package)
        program = load_program(package)
        for fname in PUBLISHED_FUNCTIONS & set(chunk.functions):
            assert not [op.type for op in proto_ops(spec, fname) if op.type.startswith("constexpr")]
            pymil_ops = {op.outputs[0].name: op for op in program.functions[fname].operations}
            linears = _linear_weights(spec, fname)
            assert linears
            for name, op in linears:
                assert op.type == "const", (name, op.type)
                got = np.asarray(pymil_ops[name].outputs[0].val)
                assert got.dtype == np.float16, name
                # nothing folded into the weights: each is the checkpoint's tensor rounded to fp16
                np.testing.assert_array_equal(got, _ckpt_weight(ckpt_np, name).astype(np.float16), err_msg=name)


# -- weight sharing between the functions of a chunk ---------------------------------------------


def test_functions_reference_the_same_weight_blobs(bundle, plan):
    """The merged functions must point at the same bytes of weight.bin for every weight (and,
    at 4 bits, every LUT and index array): that is what bit-identical LUTs buy."""
    for chunk in plan.chunks:
        if len(chunk.functions) < 2:
            continue
        spec = load_spec(bundle["path"] / f"{chunk.name}.mlpackage")
        fa, fb = "infer", "prefill_b8"
        weights = {n for n, _ in _linear_weights(spec, fa)}
        assert weights == {n for n, _ in _linear_weights(spec, fb)}, chunk.name
        # (T-shaped constants such as the cache padding legitimately differ; weights may not)
        a, b = ({k: v for k, v in blob_refs(spec, f).items() if k[0] in weights} for f in (fa, fb))
        assert a == b, chunk.name
        # every linear weight is in weight.bin once per chunk, not once per function
        assert len(a) >= len(weights) > 10 and len(set(a.values())) == len(a), chunk.name


@pytest.mark.slow
def test_merged_package_is_within_5_percent_of_one_function(bundle4, plan, tiny_e2b, tmp_path):
    import torch

    from gemma_ane.convert import coreml as convert_mod
    from gemma_ane.convert.checkpoint import Checkpoint
    from gemma_ane.convert.models.text import load_chunk

    # chunk_2 is the largest multifunction chunk of the tiny model
    chunk = plan.chunks[1]
    ckpt = Checkpoint(tiny_e2b)
    try:
        model = load_chunk(plan, chunk, ckpt, torch.float32, fp16_range=True)  # as convert() does
        mlmodel = convert_mod.convert_function(
            model, chunk, "infer", ConvertOptions(context=CONTEXT, bits=4), {}, StageTimer()
        )
    finally:
        ckpt.close()
    alone = tmp_path / "alone.mlpackage"
    mlmodel.save(str(alone))
    merged = bundle4["path"] / f"{chunk.name}.mlpackage"
    alone_w, merged_w = (alone / WEIGHTS).stat().st_size, (merged / WEIGHTS).stat().st_size
    print(
        f"\n{chunk.name} 4-bit weight.bin: merged {merged_w} B, infer alone {alone_w} B "
        f"({merged_w / alone_w:.3f}x); whole package: merged {tree_size(merged)} B, alone {tree_size(alone)} B"
    )
    assert merged_w <= 1.05 * alone_w, (merged_w, alone_w)


@pytest.mark.slow
def test_convert_function_works_on_its_own(plan, tiny_e2b, tmp_path):
    """convert_function is the public per-function step; it must not depend on convert() having
    run earlier in the same process (coremltools op overrides are process-global)."""
    import subprocess
    import sys

    script = f"""
import torch
from gemma_ane.convert.checkpoint import Checkpoint
from gemma_ane.convert import ConvertOptions, StageTimer, convert_function
from gemma_ane.convert.models.text import load_chunk
from gemma_ane.bundle.plan import ChunkPlan
ckpt = Checkpoint({str(tiny_e2b)!r})
plan = ChunkPlan.build(ckpt.spec, {CONTEXT})
chunk = plan.chunks[2]
model = load_chunk(plan, chunk, ckpt, torch.float32)
convert_function(model, chunk, "infer", ConvertOptions(context={CONTEXT}, bits=16), {{}}, StageTimer())
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
    assert proc.returncode == 0 and "OK" in proc.stdout, f"convert_function alone failed:\n{tail}"


# -- sidecars --------------------------------------------------------------------------------------


def spec_int8(w: np.ndarray):
    """CONTRACT §2, written out independently: scale = fp16(max|row|), q = clamp(round(w*127/scale))."""
    w = w.astype(np.float64)
    scale = np.abs(w).max(axis=1).astype(np.float16)
    s = scale.astype(np.float64)
    q = np.clip(np.rint(w * 127.0 / np.where(s > 0, s, 1.0)[:, None]), -127, 127).astype(np.int8)
    return q, scale


def test_sidecar_sizes_follow_spec(bundle, text_cfg):
    V, H, L, P = (
        text_cfg[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "hidden_size_per_layer_input")
    )
    root = bundle["path"]
    expected = {
        "embed_tokens_q8.bin": V * H,
        "embed_tokens_scales.bin": V * 2,
        "embed_tokens_per_layer_q8.bin": V * L * P,
        "embed_tokens_per_layer_scales.bin": V * 2,
        "per_layer_projection.bin": L * P * H * 2,
        "per_layer_norm_weight.bin": P * 2,
    }
    assert {n: (root / n).stat().st_size for n in expected} == expected


def test_int8_tables_round_trip_the_checkpoint(bundle4, ckpt_np, text_cfg):
    root = bundle4["path"]
    V = text_cfg["vocab_size"]
    for q_name, s_name, tensor in (
        ("embed_tokens_q8.bin", "embed_tokens_scales.bin", "embed_tokens.weight"),
        ("embed_tokens_per_layer_q8.bin", "embed_tokens_per_layer_scales.bin", "embed_tokens_per_layer.weight"),
    ):
        w = ckpt_np[tensor]
        q = np.fromfile(root / q_name, dtype=np.int8).reshape(V, -1)
        scale = np.fromfile(root / s_name, dtype="<f2")
        want_q, want_scale = spec_int8(w)
        np.testing.assert_array_equal(scale, want_scale, err_msg=s_name)
        assert q.shape == w.shape
        # exact: the random tiny weights put no product on a .5 tie, so float32 and float64
        # arithmetic agree, and any other rounding rule (or scale/127 as the scale) shows up
        mismatched = int((q != want_q).sum())
        assert mismatched == 0, (q_name, mismatched)
        assert np.abs(q).max() == 127  # the row max maps to +-127: scale is max|row|, not max/127
        # dequantised rows are within half a step of the checkpoint (step = scale/127)
        step = scale.astype(np.float64)[:, None] / 127.0
        err = np.abs(q * step - w)
        assert (err <= 0.5 * step * (1 + 1e-2) + 1e-3 * step).all(), q_name


def test_projection_and_norm_sidecars(bundle16, ckpt_np, text_cfg):
    root = bundle16["path"]
    H, L, P = text_cfg["hidden_size"], text_cfg["num_hidden_layers"], text_cfg["hidden_size_per_layer_input"]
    proj = np.fromfile(root / "per_layer_projection.bin", dtype="<f2").reshape(L * P, H)
    np.testing.assert_array_equal(proj, ckpt_np["per_layer_model_projection.weight"].astype(np.float16))
    norm = np.fromfile(root / "per_layer_norm_weight.bin", dtype="<f2")
    np.testing.assert_array_equal(norm, ckpt_np["per_layer_projection_norm.weight"].astype(np.float16))
    # the tiny norm weights are drawn in [0.5, 2]: read as fp32 these bytes would be garbage
    assert 0.4 < norm.min() and norm.max() < 2.1


@pytest.mark.parametrize("kind,width_key", [("sliding", "head_dim"), ("full", "global_head_dim")])
def test_rope_npy_files_are_safe_fp16_v1(bundle16, text_cfg, kind, width_key):
    for which in ("cos", "sin"):
        path = bundle16["path"] / f"{which}_{kind}.npy"
        head = path.read_bytes()[:8]
        assert head == b"\x93NUMPY\x01\x00", head  # npy format version 1.0
        arr = np.load(path, allow_pickle=False)
        assert arr.dtype == np.dtype("<f2")
        assert arr.shape[0] >= max(CONTEXT, 4096) and arr.shape[1] == text_cfg[width_key], arr.shape
        assert np.isfinite(arr).all()


@pytest.fixture(scope="module")
def hf_rope(tiny_e2b):
    import transformers
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    cfg = transformers.AutoConfig.from_pretrained(tiny_e2b).text_config
    return cfg, Gemma4TextRotaryEmbedding(cfg)


@pytest.mark.parametrize("layer_type,kind", [(SLIDING, "sliding"), (FULL, "full")])
def test_rope_tables_match_transformers(bundle16, hf_rope, layer_type, kind):
    import torch

    cfg, rot = hf_rope
    positions = [0, 1, 7, 100, 1000, 4095]
    x = torch.zeros(1, len(positions), 8, dtype=torch.float32)
    cos_hf, sin_hf = rot(x, torch.tensor([positions]), layer_type)
    cos = np.load(bundle16["path"] / f"cos_{kind}.npy", allow_pickle=False)
    sin = np.load(bundle16["path"] / f"sin_{kind}.npy", allow_pickle=False)
    assert cos.shape[1] == cos_hf.shape[-1], (cos.shape, cos_hf.shape)
    # fp16 storage: half an ulp of values in [-1, 1] is <= 2^-12
    np.testing.assert_allclose(cos[positions].astype(np.float32), cos_hf[0].numpy(), atol=2.5e-4, rtol=0)
    np.testing.assert_allclose(sin[positions].astype(np.float32), sin_hf[0].numpy(), atol=2.5e-4, rtol=0)

    d = cos.shape[1]
    rotating = int(np.any(sin[:, : d // 2] != 0, axis=0).sum())
    params = cfg.rope_parameters[layer_type]
    factor = params.get("partial_rotary_factor", 1.0) if params.get("rope_type") == "proportional" else 1.0
    assert rotating == int(factor * d / 2), (layer_type, rotating)
    if layer_type == FULL:
        assert rotating < d // 2  # the published defect: every full-layer pair rotating
        # the non-rotating pairs are exact identity
        assert (cos[:, rotating : d // 2] == 1).all() and (sin[:, rotating : d // 2] == 0).all()
    np.testing.assert_array_equal(cos[:, : d // 2], cos[:, d // 2 :])  # split-half pairing


# -- model_config.json and hf_model/ ----------------------------------------------------------------

SPEC_FIELDS = (
    "model_name",
    "architecture",
    "hidden_size",
    "num_hidden_layers",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "vocab_size",
    "context_length",
    "sliding_window",
    "per_layer_dim",
    "num_kv_shared_layers",
    "layer_types",
    "embed_scale",
    "per_layer_embed_scale",
    "per_layer_model_projection_scale",
    "per_layer_input_scale",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "final_logit_softcapping",
    "quantization",
    "compute_units",
)


def test_model_config_has_every_spec_field(bundle, text_cfg):
    mc = json.loads((bundle["path"] / "model_config.json").read_text())
    missing = [f for f in SPEC_FIELDS if f not in mc]
    assert not missing, missing
    t = text_cfg
    H, P = t["hidden_size"], t["hidden_size_per_layer_input"]
    want = {
        "architecture": "gemma4",
        "hidden_size": H,
        "num_hidden_layers": t["num_hidden_layers"],
        "num_layers": t["num_hidden_layers"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t["head_dim"],
        "global_head_dim": t["global_head_dim"],
        "vocab_size": t["vocab_size"],
        "context_length": CONTEXT,
        "sliding_window": t["sliding_window"],
        "per_layer_dim": P,
        "num_kv_shared_layers": t["num_kv_shared_layers"],
        "layer_types": t["layer_types"],
        "rms_norm_eps": t["rms_norm_eps"],
        "bos_token_id": 2,
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "compute_units": "CPU_AND_NE",
    }
    assert {k: mc[k] for k in want} == want
    assert mc["embed_scale"] == pytest.approx(H**0.5, rel=1e-9)
    assert mc["per_layer_embed_scale"] == pytest.approx(P**0.5, rel=1e-9)
    assert mc["per_layer_model_projection_scale"] == pytest.approx(H**-0.5, rel=1e-9)
    assert mc["per_layer_input_scale"] == pytest.approx(2**-0.5, rel=1e-9)
    assert isinstance(mc["model_name"], str) and mc["model_name"]
    if bundle["bits"] == 4:
        assert mc["quantization"] == "int4"
    else:
        assert mc["quantization"] in ("none", "fp16", "float16"), mc["quantization"]


def test_hf_model_is_copied_from_src(bundle16, tiny_e2b):
    hf = bundle16["path"] / "hf_model"
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (hf / name).read_bytes() == (tiny_e2b / name).read_bytes(), name
    has_template = (hf / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (hf / "tokenizer_config.json").read_text()
    )
    assert has_template
    if (tiny_e2b / "chat_template.jinja").is_file():
        assert (hf / "chat_template.jinja").read_bytes() == (tiny_e2b / "chat_template.jinja").read_bytes()
    # never the weights
    assert not list(hf.glob("*.safetensors*"))


# -- manifest, model card, permissions -----------------------------------------------------------


def test_manifest_lists_every_file_with_size_and_sha256(bundle, tiny_e2b):
    import coremltools as ct
    import torch

    import gemma_ane

    root = bundle["path"]
    manifest = json.loads((root / "manifest.json").read_text())
    on_disk = {rel: p for rel, p in tree_files(root).items() if rel != "manifest.json"}
    assert set(manifest["files"]) == set(on_disk)
    assert "chunk_2.mlpackage/" + str(WEIGHTS) in manifest["files"]
    for rel, p in on_disk.items():
        entry = manifest["files"][rel]
        assert entry["size"] == p.stat().st_size, rel
        assert entry["sha256"] == sha256(p), rel
    conv = manifest["converter"]
    assert conv["coremltools"] == ct.__version__ and conv["torch"] == torch.__version__
    assert conv["gemma_ane"] == gemma_ane.__version__
    assert manifest["source"]["config_sha256"] == sha256(tiny_e2b / "config.json")
    opts = manifest["options"]
    assert (opts["bits"], opts["context"], opts["group_size"], opts["prefill_batch"]) == (
        bundle["bits"],
        CONTEXT,
        32,
        8,
    )
    assert opts["split"] == [5, 13]


def test_check_manifest_detects_damage(bundle16, tmp_path):
    from gemma_ane.bundle import check_manifest

    assert check_manifest(bundle16["path"]) == []
    copy = tmp_path / "copy"
    shutil.copytree(bundle16["path"], copy)
    assert check_manifest(copy) == []

    flipped = copy / "chunk_2.mlpackage" / WEIGHTS
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated = copy / "embed_tokens_per_layer_q8.bin"
    truncated.write_bytes(truncated.read_bytes()[:-1])
    deleted = copy / "hf_model" / "tokenizer.json"
    deleted.unlink()

    problems = check_manifest(copy)
    assert len(problems) == 3, problems
    for path in (flipped, truncated, deleted):
        lines = [p for p in problems if str(path) in p]
        assert len(lines) == 1 and "\n" not in lines[0], (path, problems)
    assert "sha256" in next(p for p in problems if str(flipped) in p)
    assert "size" in next(p for p in problems if str(truncated) in p)
    assert "missing" in next(p for p in problems if str(deleted) in p)


def test_model_card_front_matter(bundle):
    import yaml

    text = (bundle["path"] / "README.md").read_text()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "coreml"
    assert isinstance(meta["license"], str) and meta["license"]
    assert isinstance(meta["base_model"], str) and meta["base_model"]
    assert isinstance(meta["tags"], list) and meta["tags"]
    # it says what was built: the options are in the body
    assert f"context {CONTEXT}" in body
    assert ("4-bit" in body) == (bundle["bits"] == 4)


def test_bundle_is_readable_by_others(bundle16):
    """A bundle is meant to be shared (served, copied, uploaded): nothing inside may keep the
    private modes tempfile/coremltools create (0600 files, 0700 dirs)."""
    private = []
    for p in [bundle16["path"], *bundle16["path"].rglob("*")]:
        mode = p.stat().st_mode & 0o777
        need = 0o555 if p.is_dir() else 0o444
        if mode & need != need:
            private.append(f"{oct(mode)} {p.relative_to(bundle16['path'])}")
    assert not private, "not world-readable:\n" + "\n".join(private)


# -- atomicity and --force -----------------------------------------------------------------------


@pytest.mark.slow
def test_failed_conversion_leaves_no_out(tiny_e2b, tmp_path, monkeypatch):
    from gemma_ane.convert import coreml as convert_mod

    def failing_merge(paths, out):  # after chunk_1's functions are written
        raise RuntimeError("injected failure in merge")

    monkeypatch.setattr(convert_mod, "merge_functions", failing_merge)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="injected failure"):
        convert(str(tiny_e2b), str(out), ConvertOptions(context=CONTEXT, bits=16, vision=False), progress=False)
    assert not out.exists()
    assert _partials(tmp_path, "out") == []
    assert sorted(os.listdir(tmp_path)) == []


def test_interrupted_conversion_leaves_no_out_and_keeps_an_old_one(tiny_e2b, tmp_path, monkeypatch):
    from gemma_ane.convert import coreml as convert_mod

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    # Ctrl-C during the first function: cheap, and KeyboardInterrupt is not an Exception
    monkeypatch.setattr(convert_mod, "trace_function", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert(str(tiny_e2b), str(out), ConvertOptions(context=CONTEXT, bits=16, vision=False), progress=False)
    assert not out.exists() and _partials(tmp_path, "out") == []

    # with --force the old bundle must survive a failed replacement
    out.mkdir()
    (out / "keep.txt").write_text("old bundle")
    with pytest.raises(KeyboardInterrupt):
        convert(
            str(tiny_e2b), str(out), ConvertOptions(context=CONTEXT, bits=16, vision=False, force=True), progress=False
        )
    assert (out / "keep.txt").read_text() == "old bundle"
    assert _partials(tmp_path, "out") == []


def test_existing_out_is_refused_without_force(tiny_e2b, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = sorted(os.listdir(out))
    with pytest.raises(ConvertError) as e:
        convert(str(tiny_e2b), str(out), ConvertOptions(context=CONTEXT, bits=16, vision=False), progress=False)
    assert str(out) in str(e.value) and "--force" in str(e.value)
    assert sorted(os.listdir(out)) == before and (out / "keep.txt").read_text() == "mine"
    assert _partials(tmp_path, "out") == []


def test_force_replaces_an_existing_out(bundle16):
    root = bundle16["path"]
    assert not (root / "stale.txt").exists()
    assert (root / "chunk_1.mlpackage").is_dir() and (root / "manifest.json").is_file()
    assert _partials(root.parent, root.name) == []


# -- inspect ----------------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    from gemma_ane.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors exit from parse_args
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


_inspected: dict = {}


def inspect_json(capsys, root: Path) -> dict:
    if root not in _inspected:
        rc, out, err = run_cli(capsys, "inspect", root, "--json")
        assert rc == 0, err
        _inspected[root] = json.loads(out)
    return _inspected[root]


def hand_macs_per_token(text: dict, plan: ChunkPlan, chunk_index: int) -> int:
    """Linear layers + the two attention matmuls + the LM head, from the config's dims alone."""
    t = text
    H, nh, P, V = t["hidden_size"], t["num_attention_heads"], t["hidden_size_per_layer_input"], t["vocab_size"]
    L, shared = t["num_hidden_layers"], t["num_kv_shared_layers"]
    chunk = plan.chunks[chunk_index]
    total = 0
    for i in chunk.layers:
        full = t["layer_types"][i] == FULL
        D = t["global_head_dim"] if full else t["head_dim"]
        kvh = t["num_key_value_heads"]
        owns = i < L - shared
        I = t["intermediate_size"] * (2 if t["use_double_wide_mlp"] and not owns else 1)
        S = CONTEXT if full else t["sliding_window"]
        total += H * nh * D + nh * D * H  # q, o
        if owns:
            total += 2 * H * kvh * D  # k, v
        total += 3 * H * I  # gate, up, down
        total += 2 * H * P  # per-layer input gate and projection
        total += 2 * nh * D * S  # q.k^T and attn.v over the whole cache
    if chunk_index == 0:
        total += H * L * P  # PLE model projection
    if chunk_index == 2:
        total += H * V  # LM head
    return total


def test_inspect_json_reads_the_bundle(capsys, bundle16, bundle4, plan, text_cfg):
    expected = plan.to_json()["chunks"]
    r16, r4 = inspect_json(capsys, bundle16["path"]), inspect_json(capsys, bundle4["path"])
    for report, root in ((r16, bundle16["path"]), (r4, bundle4["path"])):
        assert report["manifest"]["verified"] is True and report["manifest"]["problems"] == []
        assert [c["name"] for c in report["chunks"]] == [c["name"] for c in expected]
        for got, want in zip(report["chunks"], expected):
            assert got["layers"] == want["layers"]
            assert got["states"] == want["states"]
            assert got["size_bytes"] == tree_size(root / f"{got['name']}.mlpackage")
            assert set(got["functions"]) == set(want["functions"])
            for fname, f in got["functions"].items():
                assert f["inputs"] == want["functions"][fname]["inputs"]
                assert f["outputs"] == want["functions"][fname]["outputs"]
                assert isinstance(f["weight_bytes"], int) and f["weight_bytes"] > 0
    for ci, (c16, c4) in enumerate(zip(r16["chunks"], r4["chunks"])):
        for fname in c16["functions"]:
            if fname.startswith("prefill_kv"):  # other layers and masks: path totals are checked in test_kv_prefill
                assert c16["functions"][fname]["macs_per_token"] > 0
                continue
            want = hand_macs_per_token(text_cfg, plan, ci)
            assert c16["functions"][fname]["macs_per_token"] == want, (c16["name"], fname)
            assert c4["functions"][fname]["macs_per_token"] == want, (c4["name"], fname)
            ratio = c4["functions"][fname]["weight_bytes"] / c16["functions"][fname]["weight_bytes"]
            # 4-bit indices + fp16 LUTs, plus the few tiny weights left dense: between 1/4 and ~1/3
            assert 0.24 < ratio < 0.36, (c16["name"], fname, ratio)
    # an explicit number, so a silent change in the hand formula shows too
    assert r16["chunks"][2]["functions"]["infer"]["macs_per_token"] == 253952


def test_inspect_text_output(capsys, bundle4):
    rc, out, err = run_cli(capsys, "inspect", bundle4["path"])
    assert rc == 0, err
    for name in ("chunk_1", "chunk_2", "chunk_3"):
        assert name in out
    assert "kv_cache_sliding" in out and "prefill_b8" in out
    assert out.strip().splitlines()[-1] == "manifest: verified"


def test_inspect_reports_an_unverified_manifest(capsys, bundle16, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundle16["path"], copy)
    damaged = copy / "embed_tokens_q8.bin"
    data = bytearray(damaged.read_bytes())
    data[0] ^= 0x7F
    damaged.write_bytes(bytes(data))
    rc, out, err = run_cli(capsys, "inspect", copy)
    assert rc == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("manifest: ") and "embed_tokens_q8.bin" in last and "verified" not in last
    rc, out, err = run_cli(capsys, "inspect", copy, "--json")
    assert rc == 1
    report = json.loads(out)
    assert report["manifest"]["verified"] is False
    assert len(report["manifest"]["problems"]) == 1 and "embed_tokens_q8.bin" in report["manifest"]["problems"][0]


# -- bad input: one line on stderr, exit status 2, nothing left behind -----------------------------


def assert_one_line_error(err: str, *needles):
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gemma-ane convert: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


@pytest.fixture
def edited_ckpt(tiny_e2b, tmp_path):
    def make(edit_config=None, drop_tensor=None, edit_tensor=None) -> Path:
        dst = tmp_path / "src"
        shutil.copytree(tiny_e2b, dst)
        if edit_config:
            cfg = json.loads((dst / "config.json").read_text())
            edit_config(cfg["text_config"])
            (dst / "config.json").write_text(json.dumps(cfg))
        if drop_tensor or edit_tensor:
            from safetensors.numpy import load_file, save_file

            tensors = load_file(dst / "model.safetensors")
            if drop_tensor:
                del tensors[drop_tensor]
            if edit_tensor:
                edit_tensor(tensors)
            save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        return dst

    return make


def _convert_cli(capsys, src, out, *flags):
    return run_cli(capsys, "convert", src, out, "--context", CONTEXT, "--bits", 16, "--no-vision", "--quiet", *flags)


@pytest.mark.parametrize(
    "case", ["bits", "bits_text", "group_size", "context_not_32", "context_zero", "prefill_batch", "split"]
)
def test_bad_flag_values(case, capsys, tiny_e2b, tmp_path):
    flags, needles = {
        "bits": (["--bits", "5"], ["--bits 5"]),
        "bits_text": (["--bits", "four"], ["--bits", "four"]),
        "group_size": (["--group-size", "0"], ["--group-size 0"]),
        "context_not_32": (["--context", "100"], ["--context 100", "32"]),
        "context_zero": (["--context", "0"], ["--context 0"]),
        "prefill_batch": (["--prefill-batch", "0"], ["--prefill-batch 0"]),
        "split": (["--split", "9,3"], ["--split 9,3"]),
    }[case]
    out = tmp_path / "out"
    rc, stdout, err = _convert_cli(capsys, tiny_e2b, out, *flags)
    assert rc == 2 and stdout == "", stdout
    assert_one_line_error(err, *needles)
    assert not out.exists() and _partials(tmp_path, "out") == []


def test_context_smaller_than_the_window(capsys, edited_ckpt, tmp_path):
    # the tiny window (16) is below every multiple of 32: widen it so context 32 falls short
    src = edited_ckpt(edit_config=lambda t: t.update(sliding_window=64))
    out = tmp_path / "out"
    rc, stdout, err = run_cli(capsys, "convert", src, out, "--context", 32, "--quiet")
    assert rc == 2 and stdout == ""
    assert_one_line_error(err, "--context 32", "sliding window", "64")
    assert not out.exists() and _partials(tmp_path, "out") == []


def test_missing_tensor(capsys, edited_ckpt, tmp_path):
    name = LM + "layers.6.mlp.up_proj.weight"
    src = edited_ckpt(drop_tensor=name)
    out = tmp_path / "out"
    rc, stdout, err = _convert_cli(capsys, src, out)
    assert rc == 2 and stdout == ""
    assert_one_line_error(err, name)
    assert not out.exists() and _partials(tmp_path, "out") == []


def test_weight_beyond_fp16(capsys, edited_ckpt, tmp_path):
    name = "layers.3.self_attn.o_proj.weight"

    def blow_up(tensors):
        tensors[LM + name][0, 0] = 1e6

    src = edited_ckpt(edit_tensor=blow_up)
    out = tmp_path / "out"
    rc, stdout, err = _convert_cli(capsys, src, out)
    assert rc == 2 and "wrote" not in stdout
    assert_one_line_error(err, name, "float16")
    assert not out.exists() and _partials(tmp_path, "out") == []


def test_unsupported_config(capsys, edited_ckpt, tmp_path):
    src = edited_ckpt(edit_config=lambda t: t.update(enable_moe_block=True))
    out = tmp_path / "out"
    rc, stdout, err = _convert_cli(capsys, src, out)
    assert rc == 2 and stdout == ""
    assert_one_line_error(err, "enable_moe_block")
    assert not out.exists()


def test_existing_out_via_cli(capsys, tiny_e2b, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rc, stdout, err = _convert_cli(capsys, tiny_e2b, out)
    assert rc == 2 and stdout == ""
    assert_one_line_error(err, str(out), "--force")
    assert os.listdir(out) == []


def test_unwritable_out(capsys, tiny_e2b, tmp_path):
    # we run as root, so a read-only directory would not stop us: put OUT under a regular file
    blocker = tmp_path / "somefile"
    blocker.write_text("not a directory")
    out = blocker / "bundle"
    rc, stdout, err = _convert_cli(capsys, tiny_e2b, out)
    # stdout may only carry notes (e2b-mini's stand-in audio tower is skipped with one): no progress, no result
    assert rc == 2 and all(line.startswith("note: ") for line in stdout.splitlines())
    assert_one_line_error(err, str(out))
    assert blocker.read_text() == "not a directory"
    assert _partials(tmp_path, "somefile") == [] and sorted(os.listdir(tmp_path)) == ["somefile"]


def test_hub_id_offline(capsys, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    # huggingface_hub reads its environment at import time, so patch its constants as well;
    # an empty cache keeps a previously downloaded snapshot from answering offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = run_cli(capsys, "convert", "google/gemma-4-E2B-it", tmp_path / "out", "--quiet")
    assert rc == 2 and stdout == ""
    assert_one_line_error(err, "google/gemma-4-E2B-it", "could not fetch")
    assert not (tmp_path / "out").exists()


def test_missing_local_src(capsys, tmp_path):
    rc, stdout, err = run_cli(capsys, "convert", tmp_path / "nowhere", tmp_path / "out", "--quiet")
    assert rc == 2 and stdout == ""
    assert_one_line_error(err, "nowhere")


@pytest.mark.skipif(platform.system() == "Darwin", reason="--compile is refused on Linux only")
def test_compile_is_refused_off_macos(capsys, tiny_e2b, tmp_path):
    out = tmp_path / "out"
    rc, stdout, err = _convert_cli(capsys, tiny_e2b, out, "--compile")
    assert rc == 2 and stdout == ""
    assert_one_line_error(err, "--compile", "macOS")
    assert not out.exists()


def test_vision_flags_reach_the_options(capsys, tiny_e2b, tmp_path, monkeypatch):
    """convert's vision flags as ConvertOptions (the conversion itself: conftest's vision_bundle), and the vision
    model's default bits: the chunks' when 8 or more, else 8 (4-bit soft tokens lose too much: README)."""
    import gemma_ane.convert

    seen = []
    monkeypatch.setattr(gemma_ane.convert, "convert", lambda src, out, opts, **kw: seen.append(opts) or {})
    for flags in ([], ["--no-vision"], ["--image-tokens", "560", "--vision-bits", "4"]):
        assert run_cli(capsys, "convert", tiny_e2b, tmp_path / "out", "--quiet", *flags)[0] == 0
    default, off, chosen = seen
    assert (default.vision, default.image_tokens, default.vision_bits) == (True, 280, None)
    assert off.vision is False and (chosen.image_tokens, chosen.vision_bits) == (560, 4)
    bits = {b: ConvertOptions(bits=b).vision_options.bits for b in (4, 6, 8, 16)}
    assert bits == {4: 8, 6: 8, 8: 8, 16: 16} and chosen.vision_options.bits == 4


def test_a_vision_config_without_tower_weights_converts_text_only(capsys, tiny_e2b, edited_ckpt):
    """A text-only export that kept the multimodal config.json: no vision model, and a note saying why."""
    from gemma_ane.convert.vision import VisionComponent

    options = ConvertOptions(context=CONTEXT)
    assert VisionComponent.find(options, tiny_e2b).name == "vision"
    assert VisionComponent.find(ConvertOptions(context=CONTEXT, vision=False), tiny_e2b) is None
    text_only = edited_ckpt(edit_tensor=lambda t: [t.pop(k) for k in [k for k in t if "vision" in k]])
    capsys.readouterr()
    assert VisionComponent.find(options, text_only) is None
    assert (
        "config.json states a vision tower but the weights hold none; converting text only" in capsys.readouterr().out
    )


def test_media_token_ids_past_the_vocabulary_are_refused_before_converting(capsys, tiny_e2b, tmp_path):
    """A config.json whose media token ids lie past the text vocabulary would make a bundle `load` refuses
    (model_config.json's vision entry): conversion refuses it first, naming the field, and writes nothing."""
    src = tmp_path / "src"
    shutil.copytree(tiny_e2b, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["boi_token_id"] = cfg["text_config"]["vocab_size"] + 7
    (src / "config.json").write_text(json.dumps(cfg))
    rc, out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--context", CONTEXT, "--bits", 16, "--quiet")
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"vision.boi_token_id={cfg['boi_token_id']}: expected a token id below vocab_size" in err
    assert "--no-vision converts text only" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]

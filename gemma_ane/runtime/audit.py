"""`gemma-ane inspect BUNDLE --ane`: a static audit of each saved program against the Neural
Engine's published rules, since we cannot run the Neural Engine itself.

It reads the saved artifact alone (as `package.py` does), so what it judges is what Core ML will
load. Each rule is a small check yielding (verdict, op type, op name, detail); equal hits become
one finding with a count and an example. A "violation" fails its function, chunk and bundle; a
"note" does not. A compiled .mlmodelc cannot be read back: it is "not audited", never "pass". What the audit
cannot judge fails: an op type it does not know (nothing of it runs), a package it cannot read (a state past what
a package may declare, a negative dimension), each named in the report.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np

from ..bundle import chunk_paths, host, layout
from ..errors import BundleError
from ..files import read_json
from ..mil.ops import OPS
from ..mil.package import Package
from ..mil.program import BITS

LARGE = 4096  # elements: a "large" tensor (8 KiB in fp16); our threshold, not a published one
INDEX_SMALL = 64  # elements: int compute up to this size is index bookkeeping; ours too
LAST_AXIS_BYTES = 64  # 32 fp16 elements
FP16_MAX, FP16_OVERFLOW = 65504.0, 65520.0  # the largest fp16; fp16 rounds |x| >= 65520 to inf
MAX_STATES = 2
# |attention score| the mask must absorb (ours): Gemma 4 normalizes q and k before q.k, so real
# scores are tens at most; host.MASK_SCORE_BOUND states what the mask actually tolerates.
SCORE_BOUND = 1024.0
V, N = "violation", "note"

_NE = "Apple's Neural Engine rules (apple/coreai-models: model-authoring/references/neural_engine_rules.md)"
# why block-wise weights leave the Neural Engine: `convert --quant block` warns with it, the audit's rule states it
BLOCK_WHY = (
    "Core ML runs per-block linear weights (constexpr_blockwise_shift_scale with more than one scale per row) on "
    "the CPU: the Neural Engine executes only per-tensor or per-channel linear quantization (coremltools issue "
    "2510), and on Apple's newer runtime per-block weights on the Neural Engine were reported to give wrong output "
    "(apple/coreai-models issue 279: cosine 0.367 against 0.9975 for palettized weights)."
)
RULES = {
    "rank": f"every tensor has rank <= 5; rank-6+ intermediates are rejected [{_NE}]",
    "static": f"every shape is static, one function per shape [{_NE}]",
    "fp16": f"compute in fp16, int8/int16 storage allowed: fp32 falls back to GPU/CPU [{_NE}]. An op computing in "
    "fp32, or an fp32 tensor constant feeding one, is a violation; an fp32 scalar parameter of an fp16 op "
    "(rsqrt's epsilon, which MIL types apart from the op since iOS17) makes no fp32 tensor: a note",
    "int": f"the Neural Engine's dtypes are fp16, int8, int16 [{_NE}]: int32/int64/uint/bool ops over <= {INDEX_SMALL} "
    f"elements are index bookkeeping (a note), over more a violation, as is a gather from a table of >= {LARGE} "
    "elements (both thresholds ours)",
    "last-axis": f"the last axis is padded to 64 bytes, a singleton one costing 32x in fp16; Apple asks it of "
    f"inputs and outputs and to design intermediates for the same worst case [{_NE}]: every activation of "
    f">= {LARGE} elements (our threshold; weights excluded) has a last axis of >= 64 bytes",
    "state": "coremltools#2631 (open): a stateful model fails on the ANE when a state dimension is not a multiple "
    "of 32; its repro varies only the width, the last axis (270 fails, 256 works), so the last axis is a "
    "violation and the second-to-last a note. At most two states per chunk is our project's rule (three were "
    "reported to fail at predict on iPhone), not a published one",
    "finite": "no constant is inf/NaN or at fp16's limit (|v| >= 65504, where adding to it overflows), and the "
    "host's additive mask keeps softmax(score + mask) finite in fp16: the Neural Engine mishandles -inf in "
    f"softmax, Apple's own mask is a finite -40000 [{_NE}]",
    "lut4-state": "coremltools#2716 (open): 4-bit palettized stateful packages built with coremltools 9.0 are "
    "reported to crash after ~100-200 sequential predictions on the ANE, 8.3.0 builds of the same source not; "
    "a bug report, not a rule: a note",
    "known": "every op is of a type the MIL executor implements (the ops the converter writes): of any other the audit "
    "knows nothing, so it fails, whatever its name says",
    "block": f"{BLOCK_WHY} So per-block weights are a violation: those layers leave the Neural Engine (and may "
    "compute wrong there); per-channel ones (one scale per row) are Core ML's Neural Engine form, a note. "
    "coremltools' guide (Optimizing Models > Quantization > Performance, apple.github.io/coremltools/docs-guides/"
    "source/opt-quantization-perf.html) documents per-block scales' gains on the GPU and recommends per-channel "
    "scales on the Neural Engine",
}

_NE_DTYPES = {"fp16", "int8", "int16"}  # what the Neural Engine computes in; fp32 is the fp16 rule
_GATHERS = {"gather", "gather_nd", "gather_along_axis"}


def _dtype(var) -> str:
    return var.dtype


def _symbolic(shape) -> bool:
    return any(d is None for d in shape)  # the reader's unknown dimension


def _is_int(var) -> bool:  # int32, int64, uint*, bool
    return _dtype(var) not in _NE_DTYPES | {"fp32", "fp64"}


def _desc(var) -> str:
    return f"{_dtype(var)} {tuple(var.shape)}"


def _size(var) -> int:
    return 0 if _symbolic(var.shape) else math.prod(var.shape)  # exact: numpy's int64 product wraps


def _is_weight(op) -> bool:
    return op.op_type == "const" or op.op_type.startswith("constexpr_")


def _activations(fn):
    """(op type, op name, var) of every tensor made at run time: inputs, states, op outputs."""
    yield from (("input", name, v) for name, v in fn.inputs.items())
    yield from ((op.op_type, op.name, v) for op in fn.operations if not _is_weight(op) for v in op.outputs)


def _flat(x):
    return x if isinstance(x, (list, tuple)) else [x]


def _uses(var) -> str:
    """The op inputs a variable feeds, e.g. "rsqrt.epsilon"."""
    slots = {f"{c.op_type}.{k}" for c in var.child_ops for k, x in c.inputs.items() if any(y is var for y in _flat(x))}
    return ", ".join(sorted(slots))


# -- per-function checks: each yields (verdict, op type, op name, detail) -------------------------


def check_rank(fn):
    weights = [(op.op_type, op.name, v) for op in fn.operations if _is_weight(op) for v in op.outputs]
    for op_type, name, v in [*_activations(fn), *weights]:
        if len(v.shape) > 5:
            yield V, op_type, name, f"rank {len(v.shape)}: {_desc(v)}"


def check_static(fn):
    for op_type, name, v in _activations(fn):
        if _symbolic(v.shape):
            yield V, op_type, name, f"symbolic shape {_desc(v)}"


def check_fp16(fn):
    for op in fn.operations:
        v = op.outputs[0] if op.outputs else None
        if v is None or _dtype(v) != "fp32" or (op.op_type == "const" and not v.child_ops):
            continue
        if op.op_type != "const":
            yield V, op.op_type, op.name, f"computes in fp32: {_desc(v)}"
        elif np.size(v.val) > 1:
            yield V, "const", op.name, f"fp32 tensor {tuple(v.shape)} feeding {_uses(v)}"
        else:
            yield N, "const", op.name, f"fp32 scalar parameter {_uses(v)} = {float(v.val):g}"


def check_int(fn):
    for op in fn.operations:
        if _is_weight(op):
            continue
        ints = [v for v in op.outputs if _is_int(v)]
        dynamic = [v for x in op.inputs.values() for v in _flat(x) if v.val is None]
        index = [v for v in dynamic if _is_int(v)]
        if op.op_type in _GATHERS:
            yield (V if _size(op.x) >= LARGE else N), op.op_type, op.name, f"gathers from {_desc(op.x)}"
        elif ints:
            detail = f"{', '.join(map(_desc, ints))} from {', '.join(map(_desc, dynamic)) or 'constants'}"
            yield (N if max(map(_size, ints)) <= INDEX_SMALL else V), op.op_type, op.name, detail
        elif index:  # a data op placed by a position: a KV write, a dynamic slice
            data = max((v for v in dynamic if all(v is not i for i in index)), key=_size, default=index[0])
            yield N, op.op_type, op.name, f"indexes {_desc(data)} by {', '.join(map(_desc, index))}"


def check_last_axis(fn):
    for op_type, name, v in _activations(fn):
        bits = BITS.get(v.dtype, 8)  # bool has no bit width: a byte
        if v.shape and _size(v) >= LARGE and v.shape[-1] * bits < LAST_AXIS_BYTES * 8:
            last = v.shape[-1]
            yield V, op_type, name, f"last axis {last}{' (singleton)' if last == 1 else ''}: {_desc(v)}"


def check_finite(fn):
    for op in fn.operations:
        v = op.outputs[0] if op.op_type == "const" else None
        if v is None or _dtype(v) not in ("fp16", "fp32"):
            continue
        a = np.abs(np.asarray(v.val, np.float32))
        if not np.isfinite(a).all():
            yield V, "const", op.name, f"inf/NaN in {_desc(v)} feeding {_uses(v)}"
        elif a.size and a.max() >= FP16_MAX:
            yield V, "const", op.name, f"|v| = {a.max():g} (fp16's limit) in {_desc(v)} feeding {_uses(v)}"


# the op types the reader makes itself (`mil/program.py`) or the executor runs outside its table
_KNOWN = set(OPS) | {"const", "read_state", "coreml_update_state", "linear"}


def check_known(fn):
    for op in fn.operations:
        if op.op_type not in _KNOWN:
            yield V, op.op_type, op.name, "an op type the audit does not know"


FUNCTION_CHECKS = {
    "known": check_known,
    "rank": check_rank,
    "static": check_static,
    "fp16": check_fp16,
    "int": check_int,
    "last-axis": check_last_axis,
    "finite": check_finite,
}


# -- per-chunk and host checks ------------------------------------------------------------------


def check_states(program, states: dict, built_with):
    if len(states) > MAX_STATES:
        yield V, "state", next(iter(states)), f"{len(states)} states (at most {MAX_STATES}): {', '.join(states)}"
    for name, t in states.items():
        shape = t["shape"]
        if not shape:  # a scalar state holds no cache, and Core ML's states are tensors
            yield V, "state", name, "a state of no dimension"
            continue
        if shape[-1] % 32:
            yield V, "state", name, f"last axis {shape[-1]} not a multiple of 32: {shape}"
        if len(shape) > 1 and shape[-2] > 1 and shape[-2] % 32:  # a size-1 axis is a batch, not a width
            yield N, "state", name, f"second-to-last axis {shape[-2]} not a multiple of 32: {shape}"


def check_lut4_state(program, states: dict, built_with):
    if not states or (built_with and not built_with.startswith("9.0")):
        return
    for fn in program.functions.values():
        for op in fn.operations:
            if op.op_type == "constexpr_lut_to_dense" and _dtype(op.indices) == "uint4":
                yield N, op.op_type, op.name, f"4-bit LUT weights and states, coremltools {built_with or '?'}"
                return


def check_block(program, states: dict, built_with):
    for fn in program.functions.values():
        for op in fn.operations:
            if op.op_type == "constexpr_blockwise_shift_scale":
                inputs, blocks = op.outputs[0].shape[-1], op.scale.shape[-1]
                if blocks == 1:
                    yield N, op.op_type, op.name, f"{_dtype(op.data)} weights, per-channel scales (the NE's form)"
                else:
                    per = f"one scale per {inputs // blocks} inputs"
                    yield V, op.op_type, op.name, f"{_dtype(op.data)} weights, {per}: per-block, runs on the CPU"
        return  # the functions of a chunk share their weights: one function names them all


CHUNK_CHECKS = {"state": check_states, "lut4-state": check_lut4_state, "block": check_block}


def check_host_mask():
    """softmax(score + mask) runs in fp16 on the device: the sum, and its difference from the row's
    max (softmax subtracts it), must stay within fp16's range for every |score| up to the bound."""
    mask = float(np.float16(host.MASK_BLOCKED))
    tolerated = (FP16_MAX + mask) / 2  # mask - 2 |score| >= -65504
    if tolerated >= SCORE_BOUND:
        yield N, "host", "MASK_BLOCKED", f"{mask:g}: softmax(score + mask) finite for |score| <= {tolerated:g}"
    else:
        below = f"score + mask is -inf in fp16 for scores below {-(FP16_OVERFLOW + mask):g}"
        yield V, "host", "MASK_BLOCKED", f"{mask:g}: {below}; softmax is finite only for |score| <= {tolerated:g}"


# -- the report -----------------------------------------------------------------------------------


def _group(rule: str, hits) -> list[dict]:
    counts, first = Counter(), {}
    for verdict, op_type, name, detail in hits:
        counts[verdict, op_type, detail] += 1
        first.setdefault((verdict, op_type, detail), name)
    return [
        {"rule": rule, "verdict": v, "op": t, "count": n, "example": first[v, t, d], "detail": d}
        for (v, t, d), n in counts.items()
    ]


def _verdict(findings: list[dict], parts=()) -> str:
    if "fail" in parts or any(f["verdict"] == V for f in findings):
        return "fail"
    return "not audited" if "not audited" in parts else "pass"


def audit_package(path: Path, built_with: str | None = None) -> dict:
    pkg = Package.open(path)
    program = pkg.program()
    states = pkg.interface(pkg.default_function)["states"]
    findings = [f for rule, check in CHUNK_CHECKS.items() for f in _group(rule, check(program, states, built_with))]
    functions = {}
    for fname in pkg.function_names:
        found = [f for rule, check in FUNCTION_CHECKS.items() for f in _group(rule, check(program.functions[fname]))]
        functions[fname] = {"verdict": _verdict(found), "findings": found}
    parts = [f["verdict"] for f in functions.values()]
    return {"verdict": _verdict(findings, parts), "findings": findings, "functions": functions}


def _audit_model(path: Path, built_with: str | None) -> dict:
    entry = {"name": layout.model_name(path), "path": path.name}
    if path.suffix == ".mlmodelc":
        entry.update(verdict="not audited", reason="compiled; audit the .mlpackage before compiling")
        return entry
    try:
        entry.update(audit_package(path, built_with))
    except BundleError as e:  # a package the audit cannot read is one it cannot judge: it fails, saying why
        entry.update(verdict="fail", reason=f"unreadable: {e}")
    return entry


def audit_bundle(root: str | Path) -> dict:
    """Per model (the chunks, then every one-function model the bundle holds: drafter, vision...) and function:
    findings and a verdict; the host's mask; one verdict for the bundle, which passes only if every model was
    audited and passed (nothing is skipped silently)."""
    root = Path(root)
    manifest = root / layout.MANIFEST
    built_with = read_json(manifest).get("converter", {}).get("coremltools") if manifest.is_file() else None
    chunks = [_audit_model(path, built_with) for path in chunk_paths(root)]
    models = [
        _audit_model(paths[0], built_with)
        for name in sorted(layout.ONE_FUNCTION_MODELS)
        if (paths := layout.model_paths(root, name))
    ]
    found = _group("finite", check_host_mask())
    hosted = {"verdict": _verdict(found), "findings": found}
    verdict = _verdict([], [m["verdict"] for m in chunks + models] + [hosted["verdict"]])
    return {"bundle": str(root), "rules": RULES, "chunks": chunks, "models": models, "host": hosted, "verdict": verdict}


def format_audit(report: dict) -> str:
    out, broken = [], set()

    def findings(items, indent):
        for f in items:
            out.append(f"{indent}{f['rule']} {f['verdict']}: {f['op']} x{f['count']} ({f['example']}): {f['detail']}")
            broken.update([f["rule"]] if f["verdict"] == V else [])

    for c in report["chunks"] + report.get("models", []):
        out.append(f"{c['name']} ({c['path']}): {c['verdict']}" + (f" ({c['reason']})" if "reason" in c else ""))
        findings(c.get("findings", []), "  ")
        for fname, f in c.get("functions", {}).items():
            out.append(f"  {fname}: {f['verdict']}")
            findings(f["findings"], "    ")
    out.append(f"host: {report['host']['verdict']}")
    findings(report["host"]["findings"], "  ")
    out += [f"rule {r}: {report['rules'][r]}" for r in sorted(broken)]
    out.append(f"Neural Engine audit: {report['verdict']}")
    return "\n".join(out)

"""`gemma-ane convert`: a Hugging Face Gemma 4 checkpoint -> the stateful 3-chunk Core ML bundle.

Per chunk and function: trace the chunk graph, convert it to an iOS18 ML Program (fp16, KV caches
as states), replace every large linear weight by our k-means LUT (`palettize.py`), then merge the
functions into one multifunction package whose weights and states are shared. The host-side
tables go into raw sidecars (CONTRACT §2). Everything is built in a temporary sibling directory and
renamed into place at the end, so a failed run leaves no OUT.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import __version__
from .checkpoint import Checkpoint
from .files import FileFormatError, building, is_within, sha256_file, stop_point, tree_size
from .host import quantize_rows, rope_tables
from .images import SOFT_TOKEN_BUDGETS
from .spec import MAX_DRAFT_TOKENS, ChunkPlan, ConfigError, ModelSpec

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
)
ROW_BLOCK = 8192  # rows of an embedding table quantised at a time: bounded memory at any vocab


class ConvertError(ValueError):
    """A conversion that cannot proceed; the message names the option, file or value."""


@dataclass(frozen=True)
class ConvertOptions:
    context: int = 2048
    bits: int = 4
    group_size: int = 32
    prefill_batch: int = 8
    split: tuple[int, int] | None = None
    compile: bool | None = None  # None: compile on macOS, keep .mlpackage elsewhere
    force: bool = False
    # "published" reproduces the published layout for compatibility tests: chunk_3 returns
    # token_id + token_logit, the PLE norm weight is fp32, the full-layer RoPE tables rotate every
    # pair (CONTRACT §4) with 8192 rows, and there is no manifest.
    layout: str = "ours"
    # KV-only prefill batch sizes; None = those of 64 and 8 that divide the window
    kv_prefill_batches: tuple[int, ...] | None = None
    # a Gemma 4 drafter's checkpoint directory: adds assistant.mlpackage and verify_b{draft_tokens + 1} functions
    assistant: str | None = None
    draft_tokens: int = 3
    # the vision tower (when the checkpoint has one) as vision.mlpackage, for this many soft tokens per image, its
    # weights at vision_bits (None: 8 when the chunks' bits are lower; at 4 bits its soft tokens lose too much)
    vision: bool = True
    image_tokens: int = 280
    vision_bits: int | None = None

    def check(self) -> None:
        if self.bits not in (4, 6, 8, 16):
            raise ConvertError(f"--bits {self.bits}: choose 4, 6, 8 or 16 (16 = no palettization)")
        if self.layout not in ("ours", "published"):
            raise ConvertError(f"--layout {self.layout!r}: choose ours or published")
        if self.group_size < 1:
            raise ConvertError(f"--group-size {self.group_size}: must be >= 1")
        if self.compile and platform.system() != "Darwin":
            raise ConvertError("--compile: compiling to .mlmodelc needs macOS (coremlcompiler); use --no-compile here")
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int):
            raise ConvertError(f"--draft-tokens {self.draft_tokens!r}: expected an integer")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConvertError(f"--draft-tokens {self.draft_tokens}: choose 1 to {MAX_DRAFT_TOKENS}")
        if self.assistant and self.layout == "published":
            raise ConvertError("--assistant: the published layout has no drafter (its head is an argmax); use ours")
        if self.image_tokens not in SOFT_TOKEN_BUDGETS:
            budgets = ", ".join(map(str, SOFT_TOKEN_BUDGETS))
            raise ConvertError(f"--image-tokens {self.image_tokens}: choose one of {budgets}")
        if self.vision_bits not in (None, 4, 6, 8, 16):
            raise ConvertError(f"--vision-bits {self.vision_bits}: choose 4, 6, 8 or 16 (16 = no palettization)")

    @property
    def vision_options(self) -> ConvertOptions:
        """These options with the vision model's bits."""
        bits = self.vision_bits or (self.bits if self.bits >= 8 else 8)
        return dataclasses.replace(self, bits=bits)


# -- coremltools glue ---------------------------------------------------------------------------


def _register_int_fix() -> None:
    """coremltools 9.0 translates `aten::Int` of a folded (1,)-shaped constant with `int(array)`,
    which numpy 2 refuses. The tracer emits one wherever a slice end is `pos + T`; this override
    (the documented `register_torch_op(override=True)` hook) squeezes such constants first."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs
    from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op

    @register_torch_op(torch_alias=["int"], override=True)
    def _int(context, node):
        x = _get_inputs(context, node, expected=1)[0]
        if x.can_be_folded_to_const():
            res = mb.const(val=np.int32(np.asarray(x.val).reshape(())), name=node.name)
        else:
            if len(x.shape) > 0:
                x = mb.squeeze(x=x, name=node.name + "_item")
            res = mb.cast(x=x, dtype="int32", name=node.name)
        context.add(res, node.name)


def _palettize_pass(nbits: int, group_size: int, cache: dict, skipped: set):
    """A MIL graph pass replacing each linear weight (fp16 const of >= 2048 values, coremltools'
    default threshold) by `constexpr_lut_to_dense`; weights whose rows do not divide into groups
    stay fp16 and are named in `skipped`. `cache` maps weight bytes to their LUT, so the functions of a chunk
    get bit-identical LUTs (and the merge can share them) without running k-means twice."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass

    from .palettize import kmeans_lut

    index_dtype = types.nptype_from_builtin(types.string_to_builtin(f"uint{nbits}"))

    class PalettizeLinearWeights(AbstractGraphPass):
        def apply(self, prog):
            for fn in prog.functions.values():
                with fn:
                    for op in list(fn.operations):
                        self._maybe_palettize(op)

        def _maybe_palettize(self, op):
            if op.op_type != "const":
                return
            var = op.outputs[0]
            val = var.val
            if not isinstance(val, np.ndarray) or val.ndim != 2 or val.size < 2048:
                return
            if not var.child_ops or any(c.op_type != "linear" or c.weight is not var for c in var.child_ops):
                return
            if val.shape[0] % group_size:
                skipped.add(f"{op.name} {val.shape}")
                return
            key = hashlib.sha1(np.ascontiguousarray(val, np.float16).tobytes()).hexdigest()
            if key not in cache:
                cache[key] = kmeans_lut(val, nbits, group_size)
            lut, indices = cache[key]
            new = mb.constexpr_lut_to_dense(
                indices=indices.astype(index_dtype), lut=lut, before_op=op, name=op.name + "_palettized"
            )
            op.enclosing_block.replace_uses_of_var_after_op(anchor_op=op, old_var=var, new_var=new)
            op.enclosing_block.remove_ops([op])

    return PalettizeLinearWeights()


def _tensor_types(io: dict):
    import coremltools as ct

    return [
        ct.TensorType(name=n, shape=t.shape, dtype=np.int32 if t.dtype == "int32" else np.float16)
        for n, t in io.items()
    ]


@contextmanager
def _quiet_coremltools():
    """coremltools draws a progress bar per pass pipeline, a dozen per function, with no option to
    turn them off; our own per-function bar says where the conversion is. So tqdm bars created
    inside this block start disabled (tqdm reads its TQDM_* variables only at import)."""
    from tqdm.std import tqdm

    init = tqdm.__init__

    def quiet_init(self, *args, **kwargs):
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    tqdm.__init__ = quiet_init
    try:
        yield
    finally:
        tqdm.__init__ = init


@contextmanager
def _temp_files_in(work: Path):
    """save_multifunction writes each merged chunk to a temporary package in $TMPDIR and leaves it to
    an atexit hook: held until the process ends, and left for good if it is killed. Inside this block
    such files go to `work`, in the partial bundle, and are removed with it."""
    saved, tempfile.tempdir = tempfile.tempdir, str(work)
    try:
        yield
    finally:
        tempfile.tempdir = saved


@contextmanager
def _lean_fp16_overflow():
    """coremltools 9.0 decides per op whether its fp32 consts fit fp16 with
    `abs[np.where(abs < 1e38)]`: int64 index arrays twice the size of each weight, ~10 GB for the
    LM head alone, and ~20 s per function at E2B size. Same answer, in bounded blocks, while
    converting (load_chunk has already refused weights beyond fp16, so it never says yes here)."""
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision

    def fp16_overflow(op) -> bool:
        for value in op.inputs.values():
            for var in value if isinstance(value, (list, tuple)) else [value]:
                if var.op is not None and var.op.op_type == "const" and var.is_tensor_or_scalar_of(dtype="fp32"):
                    flat = np.ravel(var.op.val.val)
                    for i in range(0, flat.size, 1 << 22):
                        a = np.abs(flat[i : i + (1 << 22)])
                        if np.any((a > 65504) & (a < 1e38)):
                            return True
        return False

    original = FP16ComputePrecision.__dict__["fp16_overflow"]
    FP16ComputePrecision.fp16_overflow = staticmethod(fp16_overflow)
    try:
        yield
    finally:
        FP16ComputePrecision.fp16_overflow = original


def trace_function(model, chunk, function: str, timer):
    """Trace one function of one chunk into an fp16 MIL program (states, CONTRACT §3 I/O names)."""
    import coremltools as ct
    import torch

    _register_int_fix()
    model.use_function(function)
    io = chunk.functions[function]
    float_type = next(model.parameters()).dtype
    examples = tuple(
        torch.zeros(t.shape, dtype=torch.int32 if t.dtype == "int32" else float_type) for t in io["inputs"].values()
    )
    with timer("trace"), torch.no_grad(), _quiet_coremltools():
        traced = torch.jit.trace(model, examples, strict=False, check_trace=False)
    states = [
        ct.StateType(wrapped_type=ct.TensorType(shape=t.shape, dtype=np.float16), name=n)
        for n, t in chunk.states.items()
    ]
    with timer("convert"), _quiet_coremltools(), _lean_fp16_overflow():
        return ct.convert(
            traced,
            inputs=_tensor_types(io["inputs"]),
            outputs=[
                ct.TensorType(name=n, dtype=np.int32 if t.dtype == "int32" else np.float16)
                for n, t in io["outputs"].items()
            ],
            states=states or None,
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT16,
            convert_to="milinternal",
        )


def finish_function(
    prog, options: ConvertOptions, lut_cache: dict, timer, skipped: set | None = None, package_dir: Path | None = None
):
    """Palettize a traced program and serialise it; with `package_dir` the package is written
    there directly (otherwise coremltools keeps a temporary copy until the process exits)."""
    import coremltools as ct

    if options.bits != 16:
        with timer("palettize"):
            _palettize_pass(options.bits, options.group_size, lut_cache, skipped if skipped is not None else set())(
                prog
            )
    with timer("convert"), _quiet_coremltools():
        # The program already went through the default pipeline; running it again could fold
        # our constexpr ops back into dense weights.
        return ct.convert(
            prog,
            convert_to="mlprogram",
            minimum_deployment_target=ct.target.iOS18,
            pass_pipeline=ct.PassPipeline.EMPTY,
            skip_model_load=True,
            package_dir=str(package_dir) if package_dir else None,
        )


def convert_function(
    model,
    chunk,
    function: str,
    options: ConvertOptions,
    lut_cache: dict,
    timer,
    skipped: set | None = None,
    package_dir: Path | None = None,
):
    """Trace, palettize and serialise one function of one chunk; returns the MLModel."""
    return finish_function(
        trace_function(model, chunk, function, timer), options, lut_cache, timer, skipped, package_dir
    )


def merge_functions(paths: dict[str, Path], out: Path, default: str = "infer") -> None:
    """One multifunction package; save_multifunction deduplicates identical consts, so weights
    and LUTs are stored once and the states are shared by every function."""
    from coremltools.models.utils import MultiFunctionDescriptor, save_multifunction

    desc = MultiFunctionDescriptor()
    for name, path in paths.items():
        desc.add_function(str(path), src_function_name="main", target_function_name=name)
    desc.default_function_name = default
    save_multifunction(desc, str(out))


def save_one_function(prog, function: str, name: str, options: ConvertOptions, out: Path, timer, compile_) -> Path:
    """A traced one-function program (the drafter's `draft`, the vision model's `encode`), palettized and saved as
    OUT/NAME.mlpackage with its function so named (merged alone: a plain save would call it `main`), or compiled
    to OUT/NAME.mlmodelc. Returns the path written."""
    work = out / ".work"
    work.mkdir(exist_ok=True)
    path, skipped = work / f"{name}.{function}.mlpackage", set()
    finish_function(prog, options, {}, timer, skipped, path)
    if skipped:
        print(f"note: {len(skipped)} weight(s) of {name} stay fp16 (e.g. {sorted(skipped)[0]})")
    final = out / f"{name}.mlpackage"
    with timer("merge"), _quiet_coremltools(), _temp_files_in(work):
        merge_functions({function: path}, final, default=function)
    shutil.rmtree(work)
    if not compile_:
        return final
    with timer("compile"):
        compile_package(final, out / f"{name}.mlmodelc")
        shutil.rmtree(final)
    return out / f"{name}.mlmodelc"


# -- sidecars -----------------------------------------------------------------------------------


def _write_rows_int8(ckpt: Checkpoint, name: str, q_path: Path, scale_path: Path) -> None:
    """Stream a [V, N] table into int8 rows + fp16 scales (CONTRACT §2), ROW_BLOCK rows at a time."""
    rows = ckpt.entries[ckpt.prefix + name][1]["shape"][0]
    with open(q_path, "wb") as fq, open(scale_path, "wb") as fs:
        for start in range(0, rows, ROW_BLOCK):
            q, scale = quantize_rows(ckpt.rows(name, start, min(rows, start + ROW_BLOCK)))
            fq.write(q.tobytes())
            fs.write(scale.astype("<f2").tobytes())


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, np.ascontiguousarray(array), version=(1, 0), allow_pickle=False)


def model_config(spec: ModelSpec, plan: ChunkPlan, options: ConvertOptions, name: str, extras: dict) -> dict:
    config = {
        "model_name": name,
        "architecture": "gemma4",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.kv_heads[0],
        "head_dim": spec.head_dim_of("sliding_attention")
        if "sliding_attention" in spec.layer_types
        else spec.head_dims[0],
        "global_head_dim": spec.head_dim_of("full_attention"),
        "vocab_size": spec.vocab_size,
        "context_length": plan.context,
        "sliding_window": plan.window,
        "per_layer_dim": spec.per_layer_dim,
        "num_kv_shared_layers": spec.num_kv_shared_layers,
        "layer_types": list(spec.layer_types),
        "embed_scale": spec.embed_scale,
        "per_layer_embed_scale": spec.per_layer_embed_scale,
        "per_layer_model_projection_scale": spec.hidden_size**-0.5,
        "per_layer_input_scale": 2**-0.5,
        "rms_norm_eps": spec.rms_norm_eps,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_ids[0],
        "final_logit_softcapping": spec.final_logit_softcapping,
        "quantization": "none" if options.bits == 16 else f"int{options.bits}",
        "compute_units": "CPU_AND_NE",
        "prefill_batch": plan.prefill_batch,
        "split": list(plan.split),
        "head": "token_id" if options.layout == "published" else "logits",
    }
    # the one-function models' entries: assistant.config_entry (the drafter's shapes and head, K drafts per verify
    # call), vision.config_entry (the budget, preprocessing, the image token ids)
    return {**config, **extras}


def write_sidecars(
    ckpt: Checkpoint, plan: ChunkPlan, options: ConvertOptions, out: Path, name: str, extras: dict
) -> None:
    spec = ckpt.spec
    _write_rows_int8(ckpt, "embed_tokens.weight", out / "embed_tokens_q8.bin", out / "embed_tokens_scales.bin")
    _write_rows_int8(
        ckpt,
        "embed_tokens_per_layer.weight",
        out / "embed_tokens_per_layer_q8.bin",
        out / "embed_tokens_per_layer_scales.bin",
    )
    (out / "per_layer_projection.bin").write_bytes(ckpt["per_layer_model_projection.weight"].astype("<f2").tobytes())
    published = options.layout == "published"
    norm = ckpt["per_layer_projection_norm.weight"]
    (out / "per_layer_norm_weight.bin").write_bytes(norm.astype("<f4" if published else "<f2").tobytes())
    rows = 8192 if published else max(plan.context, 4096)
    if published:  # the published tables: every full-layer pair rotates (CONTRACT §4)
        from .spec import Rope

        full = spec.rope["full_attention"]
        spec = dataclasses.replace(
            spec, rope={**spec.rope, "full_attention": Rope(full.theta, full.dim // 2, full.dim)}
        )
    tables = rope_tables(spec, rows)
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    for layer_type, (cos, sin) in tables.items():
        _save_npy(out / f"cos_{names[layer_type]}.npy", cos.astype(np.float16))
        _save_npy(out / f"sin_{names[layer_type]}.npy", sin.astype(np.float16))
    config = model_config(spec, plan, options, name, extras)
    (out / "model_config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf = out / "hf_model"
    hf.mkdir()
    for f in HF_FILES:
        if (ckpt.root / f).is_file():
            shutil.copyfile(ckpt.root / f, hf / f)


# -- manifest and model card ---------------------------------------------------------------------


def bundle_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name not in ("manifest.json",))


def write_manifest(out: Path, src: Path, options: ConvertOptions, plan: ChunkPlan, extras: dict) -> dict:
    import coremltools as ct
    import torch

    config_bytes = (src / "config.json").read_bytes()
    manifest = {
        "format": "gemma-ane-bundle",
        "format_version": 1,
        "converter": {"gemma_ane": __version__, "coremltools": ct.__version__, "torch": torch.__version__},
        "source": {"path": str(src), "config_sha256": hashlib.sha256(config_bytes).hexdigest()},
        "options": {**asdict(options), "split": list(plan.split)},
        "plan": plan.to_json(),
        # the one-function packages' interfaces, as the plan states the chunks' (a compiled one cannot be read back)
        **extras,
        "files": {
            str(p.relative_to(out)): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in bundle_files(out)
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def model_card(name: str, src: Path, options: ConvertOptions, plan: ChunkPlan, sizes: dict) -> str:
    quant = (
        "fp16 weights (no palettization)"
        if options.bits == 16
        else (f"{options.bits}-bit k-means LUT palettization, one LUT per {options.group_size} output channels")
    )
    chunks = "\n".join(
        f"| `{c.name}` | {c.layers[0]}-{c.layers[-1]} | {', '.join(c.functions)} "
        f"| {sizes.get(c.name, 0) / 1e6:.1f} MB |"
        for c in plan.chunks
    )
    if options.assistant:
        chunks += f"\n| `assistant` | drafter | draft | {sizes.get('assistant', 0) / 1e6:.1f} MB |"
    drafter = (
        f"\n- speculative decoding: Gemma 4's drafter (`{Path(options.assistant).name}`) as `assistant`, "
        f"{plan.draft_tokens} drafts checked per `verify_b{plan.draft_tokens + 1}` call"
        if options.assistant
        else ""
    )
    if "vision" in sizes:
        bits = options.vision_options.bits
        chunks += f"\n| `vision` | vision tower | encode | {sizes['vision'] / 1e6:.1f} MB |"
        drafter += f"\n- image input: the vision tower as `vision`, {options.image_tokens} soft tokens per image, " + (
            "fp16 weights" if bits == 16 else f"{bits}-bit weights"
        )
    return f"""---
license: gemma
base_model: {name}
library_name: coreml
pipeline_tag: {"image-text-to-text" if "vision" in sizes else "text-generation"}
tags:
- coreml
- apple-neural-engine
- gemma4
- stateful
---

# {name} for the Apple Neural Engine (gemma-ane)

Converted from `{src.name}` by gemma-ane {__version__}: the stateful 3-chunk Core ML layout, with
KV caches as Core ML states and chunk_3 returning full logits (sample with any temperature, top-k,
top-p or seed).

- weights: {quant}; token and per-layer embeddings as int8 sidecars
- context {plan.context}, sliding window {plan.window}, prefill batch {plan.prefill_batch}
- iOS 18 / macOS 15 ML Programs, fp16 compute{drafter}

| chunk | layers | functions | size |
|---|---|---|---|
{chunks}

## Run it

```bash
pip install gemma-ane
gemma-ane inspect .          # functions, I/O, states, costs; sizes and sha256 against manifest.json
```

`manifest.json` lists every file with its size and sha256, the converter versions and the options
used.
"""


# -- the whole conversion -----------------------------------------------------------------------


class StageTimer:
    """Wall time and peak resident memory per stage. The peak comes from the kernel's high-water
    mark (VmHWM), reset at each stage entry through /proc/self/clear_refs, so it is exact rather
    than sampled; where /proc is missing (macOS) only times are kept."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peak_rss: dict[str, int] = {}

    @contextmanager
    def __call__(self, stage: str):
        stop_point()  # between stages: a signal swallowed inside the last one ends the conversion here
        _reset_peak_rss()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0
            peak = _peak_rss()
            if peak:
                self.peak_rss[stage] = max(self.peak_rss.get(stage, 0), peak)


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resolve_source(src: str) -> Path:
    path = Path(src)
    if path.exists():
        return path
    if src.count("/") == 1 and not src.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ConvertError(
                f"{src}: not a local directory, and huggingface_hub is not installed to fetch it"
            ) from None
        try:
            return Path(snapshot_download(src, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
        except Exception as e:  # offline or unknown repo: one line, not a traceback
            raise ConvertError(
                f"{src}: could not fetch from the Hugging Face Hub ({type(e).__name__}); "
                "pass a local checkpoint directory"
            ) from None
    raise ConvertError(f"{src}: no such checkpoint directory")


def convert(
    src: str,
    out: str,
    options: ConvertOptions = ConvertOptions(),
    progress: bool = True,
    timer: StageTimer | None = None,
) -> dict:
    """Convert SRC into the bundle directory OUT; returns {stage: seconds} (`timer` also holds
    each stage's peak resident memory). OUT appears whole, or not at all."""
    options.check()
    timer = timer or StageTimer()
    out = Path(out)
    if out.exists() and not options.force:
        raise ConvertError(f"{out}: already exists (use --force to replace it)")
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory; refusing to replace it")
    with timer("load"):
        root, ckpt, plan = open_source(src, options)
    compile_ = options.compile if options.compile is not None else platform.system() == "Darwin"
    try:
        if is_within(out, root) or is_within(root, out):  # replacing OUT would delete or litter the checkpoint
            raise ConvertError(f"{out}: OUT must not be, hold or lie inside the checkpoint {root}; choose another OUT")
        # before anything is written: a bad pairing or budget costs nothing
        extras = [e for e in (_check_assistant(options, plan), _check_vision(options, root)) if e]
        with building(out) as tmp:
            if not compile_ and options.compile is None:
                print("note: not on macOS, so chunks stay .mlpackage (Core ML compiles them on first load)")
            sizes = {
                chunk.name: convert_chunk(ckpt, plan, chunk, options, tmp, timer, progress, compile_)
                for chunk in plan.chunks
            }
            for extra in extras:
                sizes[extra["name"]] = extra["convert"](tmp, timer, compile_)
            name = ckpt.spec.source.get("_name_or_path") or (src if not Path(src).exists() else root.name)
            with timer("sidecars"):
                write_sidecars(ckpt, plan, options, tmp, name, {e["name"]: e["config"] for e in extras})
                (tmp / "README.md").write_text(model_card(name, root, options, plan, sizes))
                if options.layout == "ours":
                    write_manifest(tmp, root, options, plan, {e["name"]: e["manifest"] for e in extras})
    except FileFormatError as e:
        raise ConvertError(str(e)) from None
    finally:
        ckpt.close()
    return timer.seconds


def _check_assistant(options: ConvertOptions, plan: ChunkPlan) -> dict | None:
    """With --assistant: the drafter's model_config.json and manifest entries and its conversion (a callable of
    (out, timer, compile_)), the pairing and tensors checked."""
    if not options.assistant:
        return None
    from .assistant import config_entry, convert_assistant, draft_io, open_assistant

    spec, ckpt = open_assistant(options.assistant, plan.spec)
    ckpt.close()
    try:
        package = draft_io(spec, plan)
    except ConfigError as e:
        raise ConvertError(f"--assistant: {e}") from None
    config_sha = hashlib.sha256((ckpt.root / "config.json").read_bytes()).hexdigest()
    source = {"path": str(ckpt.root), "config_sha256": config_sha}
    return {
        "name": "assistant",
        "config": config_entry(spec, plan),
        "manifest": {"source": source, **package.to_json()},
        "convert": functools.partial(convert_assistant, options.assistant, plan, options),
    }


def _check_vision(options: ConvertOptions, root: Path) -> dict | None:
    """The vision model's entries and conversion, as _check_assistant's, when the checkpoint has a vision tower and
    the options want it (the published layout is text-only)."""
    from .vision import config_entry, convert_vision, encode_io, open_vision, read_spec

    if not options.vision or options.layout == "published":
        return None
    try:
        found = read_spec(root)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{root / 'config.json'}: {e}") from None
    if found is None:
        return None
    spec, ckpt = open_vision(root, options.image_tokens)
    has_tower = "model.vision_tower.patch_embedder.input_proj.weight" in ckpt
    ckpt.close()
    if not has_tower:  # a text-only export that kept the multimodal config.json
        print(f"note: {root}: config.json states a vision tower but the weights hold none; converting text only")
        return None
    tokens, vision = options.image_tokens, options.vision_options
    return {
        "name": "vision",
        "config": config_entry(spec, tokens),
        "manifest": encode_io(spec, tokens).to_json(),
        "convert": lambda out, timer, compile_: tree_size(convert_vision(root, vision, out, timer, tokens, compile_)),
    }


def open_source(src: str, options: ConvertOptions) -> tuple[Path, Checkpoint, ChunkPlan]:
    """The checkpoint directory, the validated checkpoint, and the chunk plan for these options."""
    root = resolve_source(src)
    ckpt = Checkpoint(root)
    ckpt.validate()
    kv = options.kv_prefill_batches
    if kv is None:
        kv = tuple(T for T in (64, 8) if ckpt.spec.sliding_window % T == 0)
    if options.layout == "published":
        kv = ()  # the published build knows only infer and prefill_b8
    try:
        plan = ChunkPlan.build(
            ckpt.spec,
            options.context,
            options.prefill_batch,
            options.split,
            head="token_id" if options.layout == "published" else "logits",
            kv_batches=kv,
            draft_tokens=options.draft_tokens if options.assistant else 0,
        )
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    return root, ckpt, plan


def convert_chunk(
    ckpt: Checkpoint, plan: ChunkPlan, chunk, options: ConvertOptions, out: Path, timer, progress: bool, compile_: bool
) -> int:
    """Every function of one chunk, traced, converted, palettized and merged into OUT/chunk_N; its size."""
    import torch
    from tqdm import tqdm

    from .graph import load_chunk

    _register_int_fix()
    work = out / ".work"
    work.mkdir(exist_ok=True)
    with timer("load"):
        # fp32, as coremltools' torch frontend builds the program anyway (it promotes fp16
        # weights to fp32 copies); its consts are then views of these tensors.
        try:
            model = load_chunk(plan, chunk, ckpt, torch.float32, fp16_range=True)
        except ValueError as e:
            raise ConvertError(f"{ckpt.root}: {e}") from None
    lut_cache, paths, skipped = {}, {}, set()
    for i, function in enumerate(tqdm(chunk.functions, desc=f"convert {chunk.name}", unit="fn", disable=not progress)):
        paths[function] = work / f"{chunk.name}.{function}.mlpackage"
        prog = trace_function(model, chunk, function, timer)
        if i == len(chunk.functions) - 1:
            # The program's fp16 weights are its own now; the fp32 chunk (~4 GB for chunk_3 at
            # E2B size) would otherwise sit beside palettization's buffers.
            del model
            gc.collect()
        finish_function(prog, options, lut_cache, timer, skipped, paths[function])
        del prog
    del lut_cache
    gc.collect()  # the programs hold reference cycles: free them before the next chunk loads
    if skipped:
        print(
            f"note: {len(skipped)} weight(s) of {chunk.name} stay fp16: output channels not divisible by "
            f"--group-size {options.group_size} (e.g. {sorted(skipped)[0]})"
        )
    package = out / f"{chunk.name}.mlpackage"
    with timer("merge"), _quiet_coremltools(), _temp_files_in(work):
        merge_functions(paths, package)
    shutil.rmtree(work)
    if not compile_:
        return tree_size(package)
    with timer("compile"):
        compile_package(package, out / f"{chunk.name}.mlmodelc")
        shutil.rmtree(package)
    return tree_size(out / f"{chunk.name}.mlmodelc")


def compile_package(package: Path, dest: Path) -> None:
    """macOS only: .mlpackage -> .mlmodelc with coremltools' documented compile_model, then check
    that the compiled program is the text MIL Core ML expects."""
    from coremltools.models.utils import compile_model

    compiled = Path(compile_model(str(package), str(dest)))
    mil = compiled / "model.mil"
    if not mil.is_file() or b"\x00" in mil.read_bytes()[:4096]:
        raise ConvertError(f"{compiled}: compiled model.mil is missing or not text")

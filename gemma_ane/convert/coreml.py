"""The Core ML toolkit every converter uses (the text chunks, the drafter, the vision model): trace a PyTorch
function into an fp16 ML Program, palettize its linear weights with our k-means LUTs (`palettize.py`), save it,
merge a chunk's functions into one multifunction package, compile on macOS; and the coremltools patches they
need, applied only while converting. Callers reach these through the module (`coreml.trace_function`), so one
replacement (a test's, a profiler's) covers every converter."""

from __future__ import annotations

import gc
import hashlib
import platform
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..bundle import layout
from .options import ConvertError, ConvertOptions, saved_name

WORK = ".work"  # scratch packages inside the partial bundle, removed once merged
LARGE_WEIGHT = 64 << 20  # bytes of fp16: a weight worth a garbage collection once palettized (E2B: the LM head)


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


def _palettize_pass(options: ConvertOptions, cache: dict, skipped: set, kept: set | None = None):
    """A MIL graph pass compressing each linear weight (fp16 const of >= 2048 values, coremltools' default
    threshold) at `options.bits`: `--quant lut` replaces it by `constexpr_lut_to_dense` (a k-means LUT per
    `group_size` output rows), `--quant block` by `constexpr_blockwise_shift_scale` (int4/int8, one scale per
    `group_size` inputs). A weight whose name matches a `--keep` pattern stays fp16 and is named in `kept`; one whose
    rows (lut) or inputs (block) do not divide into groups stays fp16 and is named in `skipped`. `cache` maps weight
    bytes to their compressed form, so the functions of a chunk get bit-identical weights (and the merge can share
    them) without quantizing twice."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass

    from .blockquant import blockwise_weight, quantize_blockwise
    from .palettize import kmeans_lut

    nbits, group_size, block = options.bits, options.group_size, options.quant == "block"
    index_dtype = types.nptype_from_builtin(types.string_to_builtin(f"uint{nbits}"))
    kept = set() if kept is None else kept

    class PalettizeLinearWeights(AbstractGraphPass):
        def apply(self, prog):
            for fn in prog.functions.values():
                with fn:
                    ops = list(fn.operations)
                    for i in range(len(ops)):
                        op, ops[i] = ops[i], None  # a replaced const is then held only by its own cycles
                        if self._maybe_palettize(op) >= LARGE_WEIGHT:
                            # ... which keep its value until a collection: the LM head's 0.8 GB (E2B) would
                            # otherwise stay beside every weight palettized after it
                            del op
                            gc.collect()

        def _maybe_palettize(self, op) -> int:
            """Replace a linear weight by its compressed form; the bytes of the dense weight replaced (0 if kept)."""
            if op.op_type != "const":
                return 0
            var = op.outputs[0]
            val = var.val
            if not isinstance(val, np.ndarray) or val.ndim != 2 or val.size < 2048:
                return 0
            if not var.child_ops or any(c.op_type != "linear" or c.weight is not var for c in var.child_ops):
                return 0
            if options.kept(op.name):
                kept.add(saved_name(op.name))
                return 0
            if val.shape[1 if block else 0] % group_size:
                skipped.add(f"{op.name} {val.shape}")
                return 0
            key = hashlib.sha1(np.ascontiguousarray(val, np.float16).data).hexdigest()  # no copy, unlike tobytes
            if key not in cache:
                cache[key] = quantize_blockwise(val, nbits, group_size) if block else kmeans_lut(val, nbits, group_size)
            if block:
                q, scale = cache[key]
                new = blockwise_weight(q, scale, nbits, before_op=op, name=op.name + "_quantized")
            else:
                lut, indices = cache[key]
                new = mb.constexpr_lut_to_dense(
                    indices=indices.view(index_dtype),  # the uint-n tag coremltools checks, without a copy
                    lut=lut,
                    before_op=op,
                    name=op.name + "_palettized",
                )
            op.enclosing_block.replace_uses_of_var_after_op(anchor_op=op, old_var=var, new_var=new)
            op.enclosing_block.remove_ops([op])
            return val.nbytes

    return PalettizeLinearWeights()


def _tensor_types(io: dict, float_type=np.float16):
    import coremltools as ct

    return [
        ct.TensorType(name=n, shape=t.shape, dtype=np.int32 if t.dtype == "int32" else float_type)
        for n, t in io.items()
    ]


def _validated_once(prog, pass_pipeline) -> None:
    """coremltools 9.0's `PassPipelineManager.apply_pipeline`, validating the program before and after the pipeline
    instead of after each of its ~90 passes as well. Validation only reads (it checks each var's uses both ways),
    but it walks the whole program every time: measured, 38 % of a tiny model's conversion, and ~80 % of a merge,
    whose program holds every function and whose pipeline's passes are all skipped. No debug dump of the program
    either: coremltools formats it whole, twice a pipeline, for a log line that is then dropped."""
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    pass_pipeline.validate()
    prog.validate()
    for name in pass_pipeline.passes:
        graph_pass = PASS_REGISTRY[name]
        graph_pass.set_options(pass_pipeline.get_options(name))
        graph_pass(prog)
    prog.validate()


@contextmanager
def patched_coremltools():
    """coremltools while converting:
    - it draws a progress bar per pass pipeline, a dozen per function, with no option to turn them off; our own
      per-function bar says where the conversion is. So tqdm bars created inside this block start disabled (tqdm
      reads its TQDM_* variables only at import);
    - a pass pipeline validates its program once at each end (`_validated_once`)."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
    from tqdm.std import tqdm

    init, apply_pipeline = tqdm.__init__, PassPipelineManager.__dict__["apply_pipeline"]

    def quiet_init(self, *args, **kwargs):
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    tqdm.__init__ = quiet_init
    PassPipelineManager.apply_pipeline = staticmethod(_validated_once)
    try:
        yield
    finally:
        tqdm.__init__ = init
        PassPipelineManager.apply_pipeline = apply_pipeline


@contextmanager
def temp_files_in(work: Path):
    """save_multifunction writes each merged chunk to a temporary package in $TMPDIR and leaves it to
    an atexit hook: held until the process ends, and left for good if it is killed. Inside this block
    such files go to `work`, in the partial bundle, and are removed with it."""
    saved, tempfile.tempdir = tempfile.tempdir, str(work)
    try:
        yield
    finally:
        tempfile.tempdir = saved


@contextmanager
def _lean_fp16_pass(scratch=None):
    """coremltools 9.0's fp16 pass, without its weight-sized temporaries, while converting:
    - it decides per op whether its fp32 consts fit fp16 with `abs[np.where(abs < 1e38)]`: int64 index arrays twice
      the size of each weight, ~10 GB for the LM head alone, and ~20 s per function at E2B size. Same answer, from
      the const's min and max (load_chunk has already refused weights beyond fp16, so that is where it ends), in
      bounded blocks past them;
    - after casting a const it looks for fp16 underflow only `if len(var.val.flatten()) < 400`: a copy of every
      weight to learn its size (1.6 GB for the LM head, measured as the converter's peak). The size is asked first;
    - with `scratch` (a MappedWeights holding the weights) the fp32 weight a cast has just copied is dropped from
      memory, and so is every page a pass read: the fp32 chunk never sits whole beside its fp16 program."""
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass

    def fp16_overflow(op) -> bool:
        for value in op.inputs.values():
            for var in value if isinstance(value, (list, tuple)) else [value]:
                if var.op is not None and var.op.op_type == "const" and var.is_tensor_or_scalar_of(dtype="fp32"):
                    flat = np.ravel(var.op.val.val)
                    if flat.size and -65504 <= flat.min() and flat.max() <= 65504:
                        continue  # the common answer in two reads and no temporaries
                    for i in range(0, flat.size, 1 << 22):
                        a = np.abs(flat[i : i + (1 << 22)])
                        if np.any((a > 65504) & (a < 1e38)):
                            return True
        return False

    check_underflow = FP16ComputePrecision._check_underflow_to_zero

    def underflow_then_drop(self, new_var, var):
        if var.val is not None and np.size(var.val) < 400:  # the original's own condition, size first
            check_underflow(self, new_var, var)
        if scratch is not None and isinstance(var.val, np.ndarray) and scratch.holds(var.val):
            scratch.drop(var.val)

    run_pass = AbstractGraphPass.__call__

    def run_then_drop(self, prog):
        try:
            return run_pass(self, prog)
        finally:
            scratch.drop()

    originals = (FP16ComputePrecision.__dict__["fp16_overflow"], check_underflow)
    FP16ComputePrecision.fp16_overflow = staticmethod(fp16_overflow)
    FP16ComputePrecision._check_underflow_to_zero = underflow_then_drop
    if scratch is not None:
        AbstractGraphPass.__call__ = run_then_drop
    try:
        yield
    finally:
        FP16ComputePrecision.fp16_overflow, FP16ComputePrecision._check_underflow_to_zero = originals
        AbstractGraphPass.__call__ = run_pass


@contextmanager
def _dropped_after_use(scratch):
    """While tracing a chunk whose weights live in `scratch`: each module's own weights leave memory as soon as its
    forward has run (the trace reads every weight once, layer by layer: the whole fp32 chunk would otherwise be
    resident at its end). The hook reads addresses only, so the traced graph is the same."""
    import torch

    if scratch is None:
        yield
        return

    def drop(module, args, output):
        for p in module.parameters(recurse=False):
            scratch.drop_tensor(p.data_ptr())  # not p.numel(): under a trace that is a traced value

    handle = torch.nn.modules.module.register_module_forward_hook(drop)
    try:
        yield
    finally:
        handle.remove()
        scratch.drop()  # what was read outside a module's forward


def trace_function(model, chunk, function: str, timer, precision: str = "fp16"):
    """Trace one function of one chunk into an fp16 MIL program (states, CONTRACT §3 I/O names); precision="fp32"
    makes an fp32 one (float inputs and outputs too), the reference a test measures fp16's error against."""
    import coremltools as ct
    import torch

    io_float = np.float16 if precision == "fp16" else np.float32

    _register_int_fix()
    model.use_function(function)
    io = chunk.functions[function]
    float_type = next(model.parameters()).dtype
    examples = tuple(
        torch.zeros(t.shape, dtype=torch.int32 if t.dtype == "int32" else float_type) for t in io["inputs"].values()
    )
    scratch = getattr(model, "scratch", None)  # a chunk whose weights live in a mapped file (load_module)
    with timer("trace"), torch.no_grad(), patched_coremltools(), _dropped_after_use(scratch):
        traced = torch.jit.trace(model, examples, strict=False, check_trace=False)
    states = [
        ct.StateType(wrapped_type=ct.TensorType(shape=t.shape, dtype=np.float16), name=n)
        for n, t in io.get("states", chunk.states).items()
    ]
    with timer("convert"), patched_coremltools(), _lean_fp16_pass(scratch):
        return ct.convert(
            traced,
            inputs=_tensor_types(io["inputs"], io_float),
            outputs=[
                ct.TensorType(name=n, dtype=np.int32 if t.dtype == "int32" else io_float)
                for n, t in io["outputs"].items()
            ],
            states=states or None,
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT16 if precision == "fp16" else ct.precision.FLOAT32,
            convert_to="milinternal",
        )


def finish_function(
    prog,
    options: ConvertOptions,
    lut_cache: dict,
    timer,
    skipped: set | None = None,
    package_dir: Path | None = None,
    kept: set | None = None,
):
    """Palettize (or block-quantize) a traced program and serialise it; with `package_dir` the package is written
    there directly (otherwise coremltools keeps a temporary copy until the process exits)."""
    import coremltools as ct

    if options.bits != 16:
        with timer("palettize"):
            _palettize_pass(options, lut_cache, skipped if skipped is not None else set(), kept)(prog)
            # The dense weights the pass replaced are held by the program's reference cycles until a collection:
            # the size of the model again, beside its compressed form, through serialisation.
            gc.collect()
    with timer("convert"), patched_coremltools():
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
    with _equal_before_close():
        save_multifunction(desc, str(out))


@contextmanager
def _equal_before_close():
    """save_multifunction tells the consts two functions share by `np.allclose(a, b, rtol=0, atol=~0)` on each pair
    whose first values hash alike: every weight of every function after the first. allclose widens both to float64
    first (palettized indices are a byte each: E2B's LM head's make 3.2 GB arrays of float64), and a full-size
    merge spent a fifth of its time there (sampled). Equal arrays are close, so np.array_equal answers first and
    allclose only when it says no: the same answer."""
    allclose = np.allclose

    def equal_or_close(a, b, *args, **kwargs):
        return bool(np.array_equal(a, b)) or allclose(a, b, *args, **kwargs)

    np.allclose = equal_or_close
    try:
        yield
    finally:
        np.allclose = allclose


def save_one_function(prog, function: str, name: str, options: ConvertOptions, out: Path, timer, compile_) -> Path:
    """A traced one-function program (the drafter's `draft`, the vision model's `encode`), palettized and saved as
    OUT/NAME.mlpackage with its function so named (merged alone: a plain save would call it `main`), or compiled
    to OUT/NAME.mlmodelc. Returns the path written."""
    return save_functions([(function, prog)], function, name, options, out, timer, compile_)


def save_functions(progs, default: str, name: str, options: ConvertOptions, out: Path, timer, compile_) -> Path:
    """Traced stateless programs, (function, program) pairs taken one at a time (the audio model's buckets: an
    iterator that traces each when asked holds one in memory), palettized with one LUT cache (their weights are the
    same: equal LUTs, stored once by the merge) and saved as one package OUT/NAME.mlpackage whose default function
    is `default`, or compiled to OUT/NAME.mlmodelc. Returns the path written."""
    work = out / WORK
    work.mkdir(exist_ok=True)
    paths, skipped, kept, luts = {}, set(), set(), SpilledCache(work / "luts")
    for function, prog in progs:
        paths[function] = layout.package_path(work, f"{name}.{function}")
        finish_function(prog, options, luts, timer, skipped, paths[function], kept)
        del prog
        gc.collect()  # the saved program's cycles, before the next one is traced
    note_fp16(name, options, skipped, kept)
    final = layout.package_path(out, name)
    with timer("merge"), patched_coremltools(), temp_files_in(work):
        merge_functions(paths, final, default=default)
    shutil.rmtree(work)
    return_freed_memory()
    if not compile_:
        return final
    with timer("compile"):
        compile_package(final, layout.compiled_path(out, name))
        shutil.rmtree(final)
    return layout.compiled_path(out, name)


class SpilledCache:
    """The palettize pass's cache (weight hash -> its compressed arrays) kept in .npy files under `folder`, not in
    memory: a chunk's indices are a byte per weight (~1 GB for E2B's largest chunk), needed again only when the
    chunk's next function meets the same weight, and held meanwhile beside that function's fp32 and fp16 copies."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.parts: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.parts

    def __setitem__(self, key: str, arrays: tuple) -> None:
        for i, a in enumerate(arrays):
            np.save(self.folder / f"{key}.{i}.npy", a, allow_pickle=False)
        self.parts[key] = len(arrays)

    def __getitem__(self, key: str) -> tuple:
        return tuple(np.load(self.folder / f"{key}.{i}.npy", allow_pickle=False) for i in range(self.parts[key]))


@contextmanager
def heap_frozen():
    """While converting, Python's full garbage collections skip every object that existed before (gc.freeze): the
    converter collects after each function to free the program's reference cycles (and coremltools does after each
    save), and each such collection would otherwise walk torch's, coremltools' and the caller's objects too (a
    test process's: pytest's and the oracle's). Measured on a tiny model's conversion: 46 CPU s, 37 frozen.
    Garbage from before is freed first; what is frozen is thawed at the end."""
    import coremltools  # noqa: F401  (imported now, so that their modules' objects are frozen too)
    import torch  # noqa: F401

    return_freed_memory()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def return_freed_memory() -> None:
    """Collect reference cycles now (coremltools' programs are full of them: a merge leaves its functions' loaded
    packages, ~2 GB for E2B's chunk_2, to the next collection, which came while the next chunk was held); from now
    on in this process glibc hands freed blocks of 1 MiB and more straight back to the system, and what the heap
    holds free goes back now. By default glibc's mmap threshold rises to the largest block freed (up
    to 32 MiB), after which a converter's weight-sized arrays come from the heap and stay resident once freed:
    measured, a converted chunk's memory outlived it and the next stage started that much higher. glibc cannot
    restore its adaptive threshold, so the setting stays (a fixed threshold only means more mmap calls).
    Elsewhere (macOS, musl) nothing changes."""
    gc.collect()
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)


def note_fp16(name: str, options: ConvertOptions, skipped: set, kept: set) -> None:
    """Say which linear weights of a model stayed fp16, and why."""
    if skipped:
        axis = "input" if options.quant == "block" else "output"
        print(
            f"note: {len(skipped)} weight(s) of {name} stay fp16: {axis} channels not divisible by "
            f"--group-size {options.group_size} (e.g. {sorted(skipped)[0]})"
        )
    if kept:
        print(f"note: {len(kept)} weight(s) of {name} kept fp16 by --keep: {', '.join(sorted(kept))}")


def compile_package(package: Path, dest: Path) -> None:
    """macOS only: .mlpackage -> .mlmodelc with coremltools' documented compile_model, then check
    that the compiled program is the text MIL Core ML expects."""
    from coremltools.models.utils import compile_model

    compiled = Path(compile_model(str(package), str(dest)))
    mil = compiled / "model.mil"
    if not mil.is_file() or b"\x00" in mil.read_bytes()[:4096]:
        raise ConvertError(f"{compiled}: compiled model.mil is missing or not text")

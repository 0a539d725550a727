"""The text model: the checkpoint's decoder cut into the plan's chunks (each function traced, palettized and merged
into one stateful multifunction package), and the host's tables beside them (CONTRACT §2): int8 embeddings with
their scales, the PLE projection and norm, the RoPE rows, model_config.json and the checkpoint's own files."""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..bundle import layout
from ..bundle.host import quantize_rows, rope_tables
from ..bundle.plan import ChunkPlan
from ..bundle.schema import write_model_config
from ..bundle.spec import FULL, Rope
from ..bundle.tables import save_npy
from ..files import tree_size
from . import coreml
from .checkpoint import Checkpoint
from .options import ConvertError, ConvertOptions

ROW_BLOCK = 8192  # rows of the drafter's head table quantised at a time: bounded memory at any vocab
BLOCK_BYTES = 16 << 20  # float32 bytes of an embedding table quantised at a time, beside a chunk's conversion


def convert_chunk(
    ckpt: Checkpoint, plan: ChunkPlan, chunk, options: ConvertOptions, out: Path, timer, progress: bool, compile_: bool
) -> int:
    """Every function of one chunk, traced, converted, palettized and merged into OUT/chunk_N; its size."""
    import torch
    from tqdm import tqdm

    from .models.text import load_chunk

    work = out / coreml.WORK
    work.mkdir(exist_ok=True)
    with timer("load"):
        # fp32, as coremltools' torch frontend builds the program anyway (it promotes fp16 weights to fp32 copies);
        # its consts are then views of these tensors, which live in a mapped scratch file so that the pages of each
        # weight go back once its fp16 copy exists (scratch.py).
        try:
            model = load_chunk(plan, chunk, ckpt, torch.float32, fp16_range=True, scratch=work / f"{chunk.name}.f32")
        except ValueError as e:
            raise ConvertError(f"{ckpt.root}: {e}") from None
    lut_cache, paths, skipped, kept = coreml.SpilledCache(work / "luts"), {}, set(), set()
    for i, function in enumerate(tqdm(chunk.functions, desc=f"convert {chunk.name}", unit="fn", disable=not progress)):
        paths[function] = layout.package_path(work, f"{chunk.name}.{function}")
        prog = coreml.trace_function(model, chunk, function, timer)
        if i == len(chunk.functions) - 1:
            # The program's fp16 weights are its own now: the scratch file can go.
            del model
            gc.collect()
        coreml.finish_function(prog, options, lut_cache, timer, skipped, paths[function], kept)
        del prog
        # The saved program holds reference cycles: collected now, not beside the next function's fp32 and fp16
        # copies of the chunk.
        gc.collect()
    coreml.note_fp16(chunk.name, options, skipped, kept)
    package = layout.package_path(out, chunk.name)
    with timer("merge"), coreml.patched_coremltools(), coreml.temp_files_in(work):
        coreml.merge_functions(paths, package)
    shutil.rmtree(work)
    coreml.return_freed_memory()  # what the merge held, before the next chunk loads
    if not compile_:
        return tree_size(package)
    with timer("compile"):
        coreml.compile_package(package, layout.compiled_path(out, chunk.name))
        shutil.rmtree(package)
    return tree_size(layout.compiled_path(out, chunk.name))


# -- the host's tables ------------------------------------------------------------------------------------------


def write_rows_int8(ckpt: Checkpoint, name: str, q_path: Path, scale_path: Path, stop=None) -> None:
    """Stream a [V, N] table into int8 rows + fp16 scales (CONTRACT §2), BLOCK_BYTES of float32 rows at a time
    (each row is quantised alone: the block changes no byte); `stop` (a threading.Event) ends it between blocks."""
    rows, cols = ckpt.shape_of(name)
    block = max(1, BLOCK_BYTES // (4 * cols))
    if stop is not None and stop.is_set():  # not even the files: the directory may be on its way out
        return
    with open(q_path, "wb") as fq, open(scale_path, "wb") as fs:
        for start in range(0, rows, block):
            if stop is not None and stop.is_set():
                return
            q, scale = quantize_rows(ckpt.rows(name, start, min(rows, start + block)))
            fq.write(q.tobytes())
            fs.write(scale.astype("<f2").tobytes())


def write_embeddings(ckpt: Checkpoint, out: Path, stop=None) -> None:
    """The two int8 embedding tables and their scales. In a thread of its own (embeddings_beside) on Linux, that
    thread runs at a lower priority: where the chunks' conversion uses both cores (torch's k-means), it gives way
    (measured: the palettizer took 112 s instead of 94 beside it at the same priority)."""
    if sys.platform == "linux" and threading.current_thread() is not threading.main_thread():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only: a Linux task
    write_rows_int8(ckpt, "embed_tokens.weight", out / layout.EMBED_Q8, out / layout.EMBED_SCALES, stop)
    write_rows_int8(ckpt, "embed_tokens_per_layer.weight", out / layout.PLE_Q8, out / layout.PLE_SCALES, stop)


@contextmanager
def embeddings_beside(ckpt: Checkpoint, out: Path):
    """The embedding tables (2.7 GB of int8 for E2B, ~45 s alone) written by a thread while the block converts the
    models; yields its Future, whose result() waits for it and raises its error. Converting is mostly Python, which
    holds the GIL, and the tables are numpy and reads, which let it go: on two cores they cost little wall time,
    and their blocks are small so they add little to the peak. The thread reads through a Checkpoint of its own
    (the caller's keeps its file descriptors unshared). If the block fails, the thread stops at its next block."""
    stop, go = threading.Event(), threading.Event()
    own = Checkpoint(ckpt.root, ckpt.spec)
    pool = ThreadPoolExecutor(1, thread_name_prefix="embeddings")

    def gated():
        # A signal inside submit() (Thread.start waits for the thread) can leave a thread the pool does not know,
        # so shutdown() does not join it: it must not write into a directory the caller is removing. It starts on
        # `go`, which follows `stop` whenever the block fails.
        go.wait()
        if not stop.is_set():
            write_embeddings(own, out, stop)

    try:
        future = pool.submit(gated)
        go.set()
        yield future
    except BaseException:
        stop.set()
        go.set()
        raise
    finally:
        pool.shutdown(wait=True)
        own.close()


def write_sidecars(ckpt: Checkpoint, plan: ChunkPlan, options: ConvertOptions, out: Path, config: dict) -> None:
    """The host's tables but the embeddings (embeddings_beside), `config` as model_config.json, and the
    checkpoint's own files in hf_model/."""
    spec = ckpt.spec
    (out / layout.PLE_PROJECTION).write_bytes(ckpt["per_layer_model_projection.weight"].astype("<f2").tobytes())
    published = options.layout == "published"
    norm = ckpt["per_layer_projection_norm.weight"]
    (out / layout.PLE_NORM).write_bytes(norm.astype("<f4" if published else "<f2").tobytes())
    rows = 8192 if published else max(plan.context, 4096)
    if published:  # the published tables: every full-layer pair rotates (CONTRACT §4)
        full = spec.rope[FULL]
        spec = dataclasses.replace(spec, rope={**spec.rope, FULL: Rope(full.theta, full.dim // 2, full.dim)})
    for layer_type, (cos, sin) in rope_tables(spec, rows).items():
        save_npy(out / layout.rope_table("cos", layer_type), cos.astype(np.float16))
        save_npy(out / layout.rope_table("sin", layer_type), sin.astype(np.float16))
    write_model_config(out, config)
    hf = out / layout.HF_DIR
    hf.mkdir()
    for f in layout.HF_FILES:
        if (ckpt.root / f).is_file():
            shutil.copyfile(ckpt.root / f, hf / f)

"""What a conversion spends besides converting (issues 26 and 30): coremltools validates a program after each of a
pipeline's ~90 passes, and every garbage collection walks all of a process's objects. The converter validates a
program at each end of a pipeline (coreml._validated_once) and freezes the heap it found (coreml.heap_frozen);
test_byte_identity proves the bundles are unchanged by either."""

from __future__ import annotations

import gc
import os
import re
import time
import weakref
from types import SimpleNamespace

import torch

from gemma_ane.bundle.plan import Tensor
from gemma_ane.convert import coreml, driver
from gemma_ane.convert.options import StageTimer


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def use_function(self, name):  # the interface trace_function drives
        pass

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_pass_pipeline_validates_its_program_before_and_after_its_passes_only(monkeypatch):
    """The order of events while converting a toy model: each pipeline validates, runs its passes, validates. With
    coremltools' own loop a validation follows every pass; without the last one a broken pass would go unseen."""
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.program import Program

    events, validate, run = [], Program.validate, AbstractGraphPass.__call__

    def validating(self, *args, **kwargs):
        events.append("v")
        return validate(self, *args, **kwargs)

    def passing(self, prog):
        events.append("p")
        return run(self, prog)

    monkeypatch.setattr(Program, "validate", validating)
    monkeypatch.setattr(AbstractGraphPass, "__call__", passing)
    io = {"inputs": {"x": Tensor((1, 64))}, "outputs": {"y": Tensor((1, 64))}}
    coreml.trace_function(_Two(), SimpleNamespace(functions={"main": io}, states={}), "main", StageTimer())
    order = "".join(events)
    assert len(re.findall("p+", order)) == 2, order  # ct.convert to a MIL program: the frontend's and the main one
    assert re.fullmatch("v*(vp+v)+", order), order  # the frontend validates the program it built once, on its own


def test_a_conversion_runs_with_the_heap_it_found_frozen(monkeypatch):
    """Full collections during a conversion skip the objects that existed before it; they thaw at its end."""
    seen = {}

    def convert(*args):
        seen["frozen"] = gc.get_freeze_count()
        return {}

    monkeypatch.setattr(driver, "_convert", convert)
    before = len(gc.get_objects())
    driver.convert("no-checkpoint", "no-bundle")
    assert seen["frozen"] >= before // 2, (seen["frozen"], before)  # torch's and coremltools' imports come on top
    assert gc.get_freeze_count() == 0


class _Node:
    pass


def test_the_frozen_heap_still_frees_garbage_of_before_and_of_during():
    """What was garbage before is collected before the freeze (frozen, it would stay until the end), and the
    conversion's own reference cycles (a saved program is full of them) are collected as before."""

    def cycle():
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    gc.disable()  # no automatic collection in between: only the ones under test
    try:
        old = cycle()
        with coreml.heap_frozen():
            assert old() is None
            new = cycle()
            gc.collect()
            assert new() is None
    finally:
        gc.enable()


def test_allclose_answers_as_before_without_widening_equal_arrays():
    """save_multifunction's np.allclose on two equal index arrays widened both to float64; under the merge's patch
    equal arrays answer from np.array_equal, and every answer is numpy's own."""
    import tracemalloc

    import numpy as np

    a = np.random.default_rng(0).integers(0, 16, 8 << 20, dtype=np.uint8)  # 8 MiB of indices
    cases = [
        (a, a.copy()),
        (a, np.roll(a, 1)),
        (np.array([1.0, np.nan]), np.array([1.0, np.nan])),
        (np.array([np.inf, 1.0]), np.array([np.inf, 1.0])),
        (np.zeros(3), np.zeros((1, 3))),
        (np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-13])),
    ]
    expected = [np.allclose(x, y, rtol=0.0, atol=1e-12) for x, y in cases]
    with coreml._equal_before_close():
        assert [np.allclose(x, y, rtol=0.0, atol=1e-12) for x, y in cases] == expected
        tracemalloc.start()
        assert np.allclose(a, cases[0][1], rtol=0.0, atol=1e-12)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= a.nbytes + (1 << 20), f"{peak / 2**20:.0f} MiB for {a.nbytes / 2**20:.0f} MiB of indices"


def test_the_fp16_pass_still_keeps_a_const_beyond_fp16_in_fp32():
    """The overflow check's shortcut (min and max within fp16) must not answer for a const that is beyond it: that
    linear stays fp32, as coremltools' own check decides."""
    import numpy as np
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    def weight_dtype(big: float) -> str:
        w = np.full((64, 64), 0.5, np.float32)
        w[7, 9] = big

        @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64))])
        def prog(x):
            return mb.linear(x=x, weight=w)

        with coreml._lean_fp16_pass():
            PASS_REGISTRY["common::add_fp16_cast"](prog)
        [linear] = [op for op in prog.functions["main"].operations if op.op_type == "linear"]
        return types.builtin_to_string(linear.weight.dtype)

    assert weight_dtype(1.0) == "fp16"
    assert weight_dtype(1e5) == weight_dtype(-1e5) == "fp32"


def test_the_embedding_tables_are_written_by_a_thread_beside_the_chunks(tiny_e2b, tmp_path, monkeypatch):
    """While the chunks convert, a thread writes the int8 embedding tables; a conversion that fails stops it and
    leaves no OUT."""
    import threading

    import pytest

    from gemma_ane.convert import ConvertOptions
    from gemma_ane.convert.options import ConvertError

    seen = []

    def priorities():
        return {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()}

    def convert_chunk(*args):
        deadline = time.monotonic() + 10  # the thread sets its priority once it runs: give it the time
        seen.append(priorities())
        while len(set(seen[-1].values())) == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
            seen.append(priorities())
        raise ConvertError("stopped here")

    monkeypatch.setattr(driver, "convert_chunk", convert_chunk)
    with pytest.raises(ConvertError, match="stopped here"):
        driver.convert(str(tiny_e2b), str(tmp_path / "out"), ConvertOptions(context=128, vision=False, audio=False))
    [priority] = [p for name, p in seen[-1].items() if name.startswith("embeddings")]
    assert priority > os.getpriority(os.PRIO_PROCESS, 0), seen  # it gives way to the conversion
    assert not any(t.name.startswith("embeddings") for t in threading.enumerate())
    assert not (tmp_path / "out").exists()


def test_a_signal_while_the_thread_starts_leaves_it_nothing_to_write(tiny_e2b, tmp_path, monkeypatch):
    """Ctrl-C inside submit() (Thread.start waits for the thread it launched) leaves a thread the pool does not
    know, so nothing joins it; it must not write into OUT's partial directory while `building` removes it. The
    CI run of 2026-12-02 left `.out.partial-*` behind this way (test_cli's signal test, 1 run in 25 under load)."""
    import threading

    import pytest

    from gemma_ane.convert import text
    from gemma_ane.convert.checkpoint import Checkpoint

    launched, wrote = [], threading.Event()
    start = threading.Thread.start

    def interrupted_start(thread):
        start(thread)
        launched.append(thread)
        raise KeyboardInterrupt  # as the signal handler raises it, while start() waits

    def write_embeddings(ckpt, out, stop):
        (out / "late").write_bytes(b"")
        wrote.set()

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    monkeypatch.setattr(text, "write_embeddings", write_embeddings)
    ckpt = Checkpoint(tiny_e2b)
    with pytest.raises(KeyboardInterrupt), text.embeddings_beside(ckpt, tmp_path):
        pass
    ckpt.close()
    [thread] = launched
    thread.join(10)
    assert not thread.is_alive() and not wrote.is_set() and list(tmp_path.iterdir()) == []


def test_the_embedding_tables_are_the_whole_tables_quantised_and_the_threads_error_is_raised(
    tiny_e2b, tmp_path, monkeypatch
):
    """Blocks of rows change no byte (each row is quantised alone); an error in the thread comes out of result()."""
    import pytest

    from gemma_ane.bundle import layout
    from gemma_ane.bundle.host import quantize_rows
    from gemma_ane.convert import text
    from gemma_ane.convert.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_e2b)
    rows, cols = ckpt.shape_of("embed_tokens_per_layer.weight")
    monkeypatch.setattr(text, "BLOCK_BYTES", 4 * cols * (rows // 5 + 1))  # five blocks, the last one short
    with text.embeddings_beside(ckpt, tmp_path) as tables:
        tables.result()
    for name, q_file, scale_file in (
        ("embed_tokens.weight", layout.EMBED_Q8, layout.EMBED_SCALES),
        ("embed_tokens_per_layer.weight", layout.PLE_Q8, layout.PLE_SCALES),
    ):
        q, scale = quantize_rows(ckpt[name])
        assert (tmp_path / q_file).read_bytes() == q.tobytes()
        assert (tmp_path / scale_file).read_bytes() == scale.astype("<f2").tobytes()

    def broken(w):
        raise ValueError("no rows today")

    monkeypatch.setattr(text, "quantize_rows", broken)
    with text.embeddings_beside(ckpt, tmp_path) as tables, pytest.raises(ValueError, match="no rows today"):
        tables.result()
    ckpt.close()

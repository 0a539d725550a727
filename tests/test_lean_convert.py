"""Lean conversion (issue 30): a chunk's fp32 weights live in a mapped scratch file whose pages go back once read
(convert/scratch.py), and coremltools' fp16 pass runs without its weight-sized temporaries (coreml._lean_fp16_pass).
Memory is read from the kernel (/proc/self/smaps, VmHWM), so these tests need Linux, as the suite does."""

from __future__ import annotations

import hashlib
import mmap
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gemma_ane.bundle.plan import Tensor
from gemma_ane.convert import coreml
from gemma_ane.convert.options import StageTimer
from gemma_ane.convert.scratch import MappedWeights


def resident(array: np.ndarray) -> int:
    """Bytes of the mapping holding `array` that are resident in this process (smaps' Rss of that mapping)."""
    address = array.__array_interface__["data"][0]
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            found = int(m[1], 16) <= address < int(m[2], 16)
        elif found and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the array")


def test_dropped_pages_leave_memory_but_keep_their_values(tmp_path):
    like = torch.empty(256, 4096)  # 4 MiB
    mapped = MappedWeights(tmp_path / "w", MappedWeights.size_of([like, like]))
    a, b = mapped.take(like), mapped.take(like)
    a.copy_(torch.arange(a.numel(), dtype=torch.float32).view(a.shape))
    b.fill_(2.0)
    assert not list(tmp_path.iterdir()), "the scratch file is unlinked at once: nothing is left behind"
    assert resident(a.numpy()) >= 2 * a.numel() * 4 - mmap.PAGESIZE
    mapped.drop(a.numpy())
    assert resident(a.numpy()) <= b.numel() * 4 + 2 * mmap.PAGESIZE  # b's pages only
    assert torch.equal(a, torch.arange(a.numel(), dtype=torch.float32).view(a.shape))  # read back from the file
    mapped.drop()
    assert resident(a.numpy()) == 0
    assert float(b[-1, -1]) == 2.0
    assert mapped.holds(b.numpy()) and not mapped.holds(np.zeros(4))


def test_tensors_are_laid_out_without_overlap_and_refused_past_the_file(tmp_path):
    shapes = [(3,), (5, 7), (64, 2)]
    likes = [torch.empty(s) for s in shapes]
    mapped = MappedWeights(tmp_path / "w", MappedWeights.size_of(likes))
    taken = [mapped.take(t) for t in likes]
    for i, t in enumerate(taken):
        t.fill_(i + 1)
    assert [float(t.sum()) for t in taken] == [(i + 1) * t.numel() for i, t in enumerate(taken)]
    assert all(t.data_ptr() % 64 == 0 for t in taken)
    with pytest.raises(RuntimeError, match="scratch weights"):
        mapped.take(torch.empty(1))


class Linears(torch.nn.Module):
    """Sixteen 8 MiB fp32 weights (128 MiB, 64 MiB in fp16): large beside the graph's own objects."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, 2 * width, bias=False) for _ in range(16))

    def use_function(self, function):  # trace_function's chunk protocol: one function here
        pass

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


def test_the_fp16_pass_drops_each_fp32_weight_it_has_cast(tmp_path, monkeypatch):
    """What keeps the fp32 chunk from sitting whole beside its fp16 program: when coremltools' fp16 pass ends, the
    scratch file's pages are gone although every fp32 const it read was a view of them."""
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision

    from gemma_ane.convert.models.load import load_module

    torch.manual_seed(0)
    reference = Linears()

    model = load_module(Linears, _Tensors(reference.state_dict(), tmp_path), scratch=tmp_path / "w")
    weights = [layer.weight.detach().numpy() for layer in model.layers]
    assert all(model.scratch.holds(w) for w in weights)
    assert sum(resident(w) for w in weights[:1]) == 0, "load_module drops each tensor once filled"

    seen = {}
    apply = FP16ComputePrecision.apply

    def apply_and_measure(self, prog):
        apply(self, prog)
        seen["resident"] = resident(weights[0])

    monkeypatch.setattr(FP16ComputePrecision, "apply", apply_and_measure)
    io = {"inputs": {"x": Tensor((1, 1024))}, "outputs": {"y": Tensor((1, 2048))}}
    chunk = SimpleNamespace(functions={"main": io}, states={})
    prog = coreml.trace_function(model, chunk, "main", StageTimer())
    assert seen["resident"] < 16 * mmap.PAGESIZE, f"{seen['resident']} bytes of fp32 weights still resident"
    # the weights the program holds are the reference's in fp16: the dropped pages were read back from the file
    stored = {
        hashlib.sha1(op.outputs[0].val.tobytes()).hexdigest()
        for op in prog.functions["main"].operations
        if op.op_type == "const" and np.shape(op.outputs[0].val) == (2048, 1024)
    }
    assert stored == {
        hashlib.sha1(layer.weight.detach().numpy().astype(np.float16).tobytes()).hexdigest()
        for layer in reference.layers
    }


@pytest.mark.filterwarnings("error::torch.jit.TracerWarning")  # the trace's drop hook must touch no traced value
def test_a_conversion_peaks_near_one_copy_of_its_weights(tmp_path):
    """The bound the streamed path keeps at toy widths: loading, tracing and converting 128 MiB of fp32 weights
    (64 MiB once fp16) raises the peak by about one copy of them (measured: 130 MiB; 200-212 MiB with the weights
    in anonymous memory, where the fp32 chunk sits whole beside its fp16 program), and the trace, which reads every
    weight once, holds about one layer's (measured: 9 MiB; 128 MiB without the per-module drop)."""
    from gemma_ane.convert.models.load import load_module

    sources = {width: _Tensors(Linears(width).state_dict(), root=tmp_path) for width in (16, 1024)}  # checkpoints

    def convert(width: int, timer) -> None:
        source = sources[width]
        io = {"inputs": {"x": Tensor((1, width))}, "outputs": {"y": Tensor((1, 2 * width))}}
        with timer("load"):
            model = load_module(lambda: Linears(width), source, scratch=tmp_path / f"w{width}")
        coreml.trace_function(model, SimpleNamespace(functions={"main": io}, states={}), "main", timer)

    convert(16, StageTimer())  # coremltools' imports and first-use caches, which are no weights
    coreml.return_freed_memory()
    before, timer = _rss(), StageTimer()  # each stage's peak is its own high-water mark (VmHWM reset on entry)
    convert(1024, timer)
    fp32, rise = 16 * 2048 * 1024 * 4, {stage: peak - before for stage, peak in timer.peak_rss.items()}
    assert max(rise.values()) < 1.25 * fp32, {k: f"{v / 2**20:.0f} MiB" for k, v in rise.items()}
    assert rise["trace"] < 0.25 * fp32, {k: f"{v / 2**20:.0f} MiB" for k, v in rise.items()}


def test_the_fp16_pass_makes_no_weight_sized_temporaries():
    """coremltools' own fp16 pass allocates int64 indices twice a weight's size to check its range, and a flattened
    copy of it to check for underflow; under _lean_fp16_pass the pass allocates the fp16 copy and bounded blocks."""
    import tracemalloc

    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    w = np.random.default_rng(0).standard_normal((4096, 8192), np.float32)  # 128 MiB

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 8192))])
    def prog(x):
        return mb.linear(x=x, weight=w)

    tracemalloc.start()
    with coreml._lean_fp16_pass():
        PASS_REGISTRY["common::add_fp16_cast"](prog)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < w.nbytes / 2 + 32 * 2**20, f"{peak / 2**20:.0f} MiB allocated for a {w.nbytes / 2**20:.0f} MiB weight"


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class _Tensors(dict):
    """A state dict as the checkpoint interface load_module reads (shape_of, rows, root)."""

    def __init__(self, tensors: dict, root: Path):
        super().__init__(tensors)
        self.root = root

    def shape_of(self, name):
        return tuple(self[name].shape)

    def rows(self, name, start=0, stop=None):
        return self[name].detach().numpy()[start:stop]

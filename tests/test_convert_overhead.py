"""What a conversion spends besides converting (issues 26 and 30): coremltools validates a program after each of a
pipeline's ~90 passes, and every garbage collection walks all of a process's objects. The converter validates a
program at each end of a pipeline (coreml._validated_once) and freezes the heap it found (coreml.heap_frozen);
test_byte_identity proves the bundles are unchanged by either."""

from __future__ import annotations

import gc
import re
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

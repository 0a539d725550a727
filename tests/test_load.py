"""The one loader (convert/models/load.py): a model built on the meta device and filled from the checkpoint by
name, each tensor's shape and values checked, large ones in blocks of rows; and the text chunks, the drafter
and the vision tower all filled by it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from gemma_ane.bundle.plan import ChunkPlan
from gemma_ane.bundle.spec import ModelSpec
from gemma_ane.convert import ConvertError
from gemma_ane.convert.assistant import draft_io, open_assistant
from gemma_ane.convert.models import load
from gemma_ane.convert.models.assistant import load_assistant
from gemma_ane.convert.models.load import load_module
from gemma_ane.convert.models.ops import RMSNorm
from gemma_ane.convert.models.text import load_chunk
from gemma_ane.convert.models.vision import load_vision
from gemma_ane.convert.vision import open_vision


class Tensors:
    """A checkpoint held in a dict, read as Checkpoint is: by rows, float32 out."""

    root = Path("ckpt")

    def __init__(self, **tensors):
        self.tensors, self.reads = tensors, []

    def __contains__(self, name):
        return name in self.tensors

    def shape_of(self, name):
        return self.tensors[name].shape

    def rows(self, name, start=0, stop=None):
        self.reads.append((name, start, stop))
        return self.tensors[name][start:stop].astype(np.float32) if self.tensors[name].ndim else self.tensors[name]


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 5, bias=False)
        self.norm = RMSNorm(3, 1e-6)
        self.register_buffer("bound", torch.zeros(()))
        self.register_buffer("cache", torch.zeros(2, 3))


def weights():
    rng = np.random.default_rng(0)
    return {
        "proj.weight": rng.normal(size=(5, 3)).astype(np.float16),
        "norm.weight": rng.normal(size=3).astype(np.float32),
        "bound": np.float32(np.inf),
    }


def test_fills_every_tensor_by_name_in_blocks_of_rows(monkeypatch):
    monkeypatch.setattr(load, "ROWS", 2)
    devices = []

    def build():
        devices.append(torch.empty(1).device.type)
        return Small()

    ckpt = Tensors(**weights())
    model = load_module(build, ckpt, dtype=torch.float16, skip={"cache"}, any_value=("bound",))
    assert devices == ["meta"]  # laid out without memory or a random initialisation
    assert model.proj.weight.dtype == torch.float16 and model.proj.weight.device.type == "cpu"
    np.testing.assert_array_equal(model.proj.weight.detach().numpy(), ckpt.tensors["proj.weight"])
    np.testing.assert_array_equal(model.norm.weight.detach().numpy(), ckpt.tensors["norm.weight"].astype(np.float16))
    assert model.bound.item() == np.inf and model.norm.sqrt_eps.item() == pytest.approx(1e-3, rel=1e-3)
    assert [r for r in ckpt.reads if r[0] == "proj.weight"] == [("proj.weight", s, s + 2) for s in (0, 2, 4)]


@pytest.mark.parametrize(
    "edit,needle",
    [
        ({"proj.weight": None}, "ckpt: tensor proj.weight missing"),
        ({"proj.weight": np.zeros((3, 5))}, r"ckpt: tensor proj.weight has shape \(3, 5\), expected \(5, 3\)"),
        ({"norm.weight": np.array([1, np.nan, 1])}, "ckpt: norm.weight: values beyond the float16 range"),
        ({"norm.weight": np.array([1, 7e4, 1])}, "ckpt: norm.weight: values beyond the float16 range"),
        ({"norm.weight": np.array([1, -7e4, 1])}, "ckpt: norm.weight: values beyond the float16 range"),
        ({"norm.weight": np.array([1, -np.inf, 1])}, "ckpt: norm.weight: values beyond the float16 range"),
    ],
    ids=["missing", "shape", "nan", "fp16", "-fp16", "-inf"],
)
def test_refuses_a_tensor_by_name(edit, needle):
    tensors = {k: v for k, v in {**weights(), **edit}.items() if v is not None}
    with pytest.raises(ConvertError, match=f"^{needle}$"):
        load_module(Small, Tensors(**tensors), fp16_range=True, skip={"cache"}, any_value=("bound",))


class Reshaped:
    """A real checkpoint in which one tensor claims one row fewer than it has."""

    def __init__(self, ckpt, name):
        self.ckpt, self.name, self.root = ckpt, name, ckpt.root

    def __contains__(self, name):
        return name in self.ckpt

    def shape_of(self, name):
        shape = self.ckpt.shape_of(name)
        return (shape[0] - 1, *shape[1:]) if name == self.name else shape

    def rows(self, name, start=0, stop=None):
        return self.ckpt.rows(name, start, stop)

    def __getitem__(self, name):
        return self.ckpt[name]


def _refused(ckpt, name, fill):
    try:
        shape = ckpt.shape_of(name)
        with pytest.raises(ConvertError, match=rf"tensor {name} has shape \({shape[0] - 1}, "):
            fill(Reshaped(ckpt, name))
    finally:
        ckpt.close()


def test_text_drafter_and_vision_are_filled_by_it(pair):
    from gemma_ane.convert.checkpoint import Checkpoint

    plan = ChunkPlan.build(ModelSpec.from_pretrained(pair[0]), 128, 8, draft_tokens=2)
    chunk = plan.chunks[0]
    _refused(Checkpoint(pair[0]), "layers.0.self_attn.q_proj.weight", lambda c: load_chunk(plan, chunk, c))
    spec, ckpt = open_assistant(pair[1], plan.spec)
    name = "model.layers.0.self_attn.q_proj.weight"
    _refused(ckpt, name, lambda c: load_assistant(c, spec, draft_io(spec, plan)))
    spec, ckpt = open_vision(pair[0], 70)
    name = "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"
    _refused(ckpt, name, lambda c: load_vision(c, spec, 70))

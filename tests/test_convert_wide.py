"""One chunk at E2B's real widths (hidden 1536, head dims 256/512, MLP 12288 in shared layers,
PLE 256, window 512, context 2048): shape assumptions that a 64-wide model hides show here."""

import numpy as np
import pytest
import torch

from gemma_ane.bundle.host import MASK_BLOCKED
from gemma_ane.bundle.plan import ChunkPlan
from gemma_ane.convert import ConvertOptions, StageTimer, convert_function
from gemma_ane.convert.checkpoint import Checkpoint
from gemma_ane.convert.models.text import load_chunk
from gemma_ane.mil.executor import MILModel
from gemma_ane.mil.package import Package

pytestmark = pytest.mark.slow  # every test here converts a bundle or runs a pipeline


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from gemma_ane.oracle.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("wide") / "ckpt", preset="e2b-wide")


def test_full_width_chunk_converts_and_runs(wide, tmp_path):
    ckpt = Checkpoint(wide)
    plan = ChunkPlan.build(ckpt.spec, 2048)
    chunk = plan.chunks[1]  # cache owners of both types plus a KV-shared, double-wide layer
    assert chunk.states["kv_cache_sliding"].shape == (2, 1, 512, 512)  # layer 2 (layer 4 reads it)
    assert chunk.states["kv_cache_full"].shape == (2, 1, 2048, 512)  # layer 3
    model = load_chunk(plan, chunk, ckpt)
    ml = convert_function(model, chunk, "infer", ConvertOptions(bits=4), {}, StageTimer())
    path = tmp_path / "chunk_2.mlpackage"
    ml.save(str(path))

    io = Package.open(path).interface()
    want = chunk.to_json()["functions"]["infer"]
    assert io["inputs"] == want["inputs"] and io["outputs"] == want["outputs"]
    assert io["states"] == {k: v.to_json() for k, v in chunk.states.items()}
    ops = Package.open(path).program().functions["main"].operations
    luts = [op for op in ops if op.op_type == "constexpr_lut_to_dense"]
    linears = [op for op in ops if op.op_type == "linear"]
    assert len(luts) == len(linears)  # at full width every projection is palettized
    assert any(op.outputs[0].shape == (12288, 1536) for op in luts)  # the double-wide MLP

    # The executor runs it at full width and tracks the fp32 graph: 4-bit k-means keeps ~16-20 dB
    # per weight (cosine ~0.99 per projection), compounding over three layers; a wiring error
    # (wrong slot, head or transpose) lands near 0.
    exe = MILModel(path)
    rng = np.random.default_rng(0)
    x = {
        n: (
            np.array([0], np.int32)
            if t["dtype"] == "int32"
            else (rng.standard_normal(t["shape"]) * (0 if "mask" in n else 1)).astype(np.float16)
        )
        for n, t in io["inputs"].items()
    }
    x["causal_mask_full"][..., 1:] = MASK_BLOCKED  # position 0 sees slot 0 only
    x["causal_mask_sliding"][..., 1:] = MASK_BLOCKED
    x["cos_s"][:], x["sin_s"][:], x["cos_f"][:], x["sin_f"][:] = 1, 0, 1, 0
    out = exe.predict(x, state=exe.make_state())
    with torch.no_grad():
        ref = model(
            *[torch.from_numpy(x[n].astype(np.int32 if n.endswith("pos") else np.float32)) for n in want["inputs"]]
        )
    got, expect = out["hidden_states_out"].astype(np.float32).ravel(), ref[0].numpy().ravel()
    cos = got @ expect / (np.linalg.norm(got) * np.linalg.norm(expect))
    assert cos > 0.9, cos  # measured 0.95

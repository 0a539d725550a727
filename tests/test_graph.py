"""The PyTorch chunk graph against transformers' forward pass, driven by the real step driver."""

import numpy as np
import pytest
import torch

from gemma_ane.checkpoint import Checkpoint
from gemma_ane.engine import ContextOverflow, Engine
from gemma_ane.graph import RMSNorm, TorchChunk, build_chunks
from gemma_ane.spec import ChunkPlan
from gemma_ane.verify import (FP16_MIN_COSINE, FP16_MIN_TOP1, compare, host_from_checkpoint, oracle_logits,
                              oracle_model, random_ids, verify_graph)


def make_engine(src, context=128, dtype=torch.float32, prefill_batch=8):
    ckpt = Checkpoint(src)
    plan = ChunkPlan.build(ckpt.spec, context, prefill_batch)
    host = host_from_checkpoint(ckpt, context)
    chunks = [TorchChunk(m) for m in build_chunks(plan, ckpt, dtype)]
    engine = Engine(chunks, host, context=context, window=plan.window, prefill_batch=prefill_batch)
    tables = {k: getattr(host, k) for k in ("embed_q", "embed_scales", "ple_q", "ple_scales")}
    return engine, ckpt, tables


@pytest.fixture(scope="module")
def e2b_setup(tiny_e2b):
    engine, ckpt, tables = make_engine(tiny_e2b)
    return engine, oracle_model(ckpt, tables), ckpt


def feed_segments(engine, ids, cuts):
    """Feed ids in segments (each segment's rows all get logits); returns [N, V]."""
    engine.reset()
    out, start = [], 0
    for end in list(cuts) + [len(ids)]:
        out += engine.feed(ids[start:end], logits="all")
        start = end
    return np.stack(out)


@pytest.mark.parametrize("cuts", [
    [13],          # prompt of 13: one exact batch, then single steps
    [3, 40],       # batches starting at the unaligned position 3, then past the window
    [1, 2, 7, 64],  # many small feeds, a long one crossing the ring four times
])
def test_every_position_matches_transformers_fp32(e2b_setup, cuts):
    engine, oracle, ckpt = e2b_setup
    ids = random_ids(ckpt.spec, 80, seed=len(cuts))  # 80 = 5 windows of 16
    ours = feed_segments(engine, ids, cuts)
    r = compare(ours, oracle_logits(oracle, ids))
    assert r["top1_agreement"] == 1.0 and r["min_cosine"] >= 0.9999, r


def test_gqa_preset_matches_transformers(tiny_gqa):
    r = verify_graph(tiny_gqa, tokens=72, prompt_len=11, precision="fp32")
    assert r["passed"] and r["top1_agreement"] == 1.0 and r["min_cosine"] >= 0.9999, r


def test_bf16_sharded_checkpoint(tiny_bf16_sharded):
    assert len(list(tiny_bf16_sharded.glob("model-*.safetensors"))) == 3
    r = verify_graph(tiny_bf16_sharded, tokens=48, prompt_len=9, precision="fp32")
    assert r["passed"], r


@pytest.mark.parametrize("fixture", ["tiny_e2b", "tiny_gqa"])
def test_fp16_graph_within_documented_tolerance(request, fixture):
    r = verify_graph(request.getfixturevalue(fixture), tokens=80, prompt_len=13, precision="fp16")
    assert r["top1_agreement"] >= FP16_MIN_TOP1 and r["min_cosine"] >= FP16_MIN_COSINE, r
    assert r["passed"]


def test_batched_prefill_equals_token_by_token(e2b_setup):
    engine, _, ckpt = e2b_setup
    ids = random_ids(ckpt.spec, 30, seed=7)
    batched = feed_segments(engine, ids, [5])
    engine.prefill_batch = None
    try:
        single = feed_segments(engine, ids, [5])
    finally:
        engine.prefill_batch = 8
    np.testing.assert_allclose(batched, single, rtol=1e-4, atol=1e-3)  # fp32 summation order only


def test_rmsnorm_survives_fp16_activations():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64) * 40
    x[..., :2] = 300.0  # sum(x^2) > 65504: a naive fp16 RMSNorm returns 0 or nan here
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64) + 0.5
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    naive = x.half() * torch.rsqrt((x.half() * x.half()).mean(-1, keepdim=True) + 1e-6)
    assert not torch.isfinite(x.half().pow(2).sum(-1)).all() or naive.abs().max() < 1e-3
    got = norm.half()(x.half()).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)


# -- the step driver's schedule, observed through a recording backend --------------------------

class Recorder:
    def __init__(self, name, log, outputs):
        self.name, self.log, self.outputs = name, log, outputs

    def reset_state(self):
        self.log.append((self.name, "reset", None, None))

    def predict(self, function, inputs):
        T = inputs["hidden_states"].shape[1]
        self.log.append((self.name, function, int(inputs.get("current_pos", [-1])[0]), T))
        return self.outputs(T)


def recording_engine(window=16, context=64, batch=8):
    log, V, H, PL = [], 10, 4, 6
    outs = {
        "chunk_1": lambda T: {"hidden_states_out": np.zeros((1, T, H)), "per_layer_combined_out": np.zeros((1, T, PL))},
        "chunk_2": lambda T: {"hidden_states_out": np.zeros((1, T, H))},
        "chunk_3": lambda T: {"logits": np.zeros((1, 1, V))},
    }
    chunks = [Recorder(n, log, f) for n, f in outs.items()]

    class Host:
        rope = {}

        def embed(self, ids):
            return np.zeros((1, len(ids), H)), np.zeros((1, len(ids), PL))

    return Engine(chunks, Host(), context=context, window=window, prefill_batch=batch), log


def test_schedule_prefills_only_exact_batches_and_runs_head_once():
    engine, log = recording_engine()
    logits = engine.feed(np.arange(30))
    assert len(logits) == 1
    calls = [(n, f, p) for n, f, p, _ in log if n == "chunk_1"]
    # batches at 0 and 8 stay inside the first ring pass (16); everything after is single steps
    assert calls[:2] == [("chunk_1", "prefill_b8", 0), ("chunk_1", "prefill_b8", 8)]
    assert all(f == "infer" for _, f, _ in calls[2:]) and len(calls) == 2 + 14
    assert [e for e in log if e[0] == "chunk_3"] == [("chunk_3", "infer", 29, 1)]
    # a prompt that ends exactly on a batch boundary still ends with one infer step
    engine.reset(), log.clear()
    engine.feed(np.arange(8))
    assert [(f, p) for n, f, p, _ in log if n == "chunk_1"] == [("infer", p) for p in range(8)]


def test_schedule_from_unaligned_position_and_overflow():
    engine, log = recording_engine()
    engine.feed([1, 2, 3])
    log.clear()
    engine.feed(np.arange(12))
    assert [(f, p) for n, f, p, _ in log if n == "chunk_1"][:1] == [("prefill_b8", 3)]
    with pytest.raises(ContextOverflow, match="exceed the context of 64"):
        engine.feed(np.arange(50))

"""The PyTorch chunk graph against transformers' forward pass, driven by the real step driver."""

import numpy as np
import pytest
import torch
from margins import assert_top1

from gemma_ane.bundle.plan import ChunkPlan
from gemma_ane.convert.checkpoint import Checkpoint
from gemma_ane.convert.models.ops import RMSNorm
from gemma_ane.convert.models.text import TorchChunk, build_chunks
from gemma_ane.oracle.verify import (
    FP16_MIN_COSINE,
    FP16_MIN_TOP1,
    FP32_LOGIT_ERR,
    compare,
    host_from_checkpoint,
    oracle_logits,
    oracle_model,
    random_ids,
    verify_graph,
)
from gemma_ane.runtime.engine import Engine


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


@pytest.mark.slow
@pytest.mark.parametrize(
    "cuts",
    [
        [13],  # prompt of 13: one exact batch, then single steps
        [3, 40],  # batches starting at the unaligned position 3, then past the window
        [1, 2, 7, 64],  # many small feeds, a long one crossing the ring four times
    ],
)
def test_every_position_matches_transformers_fp32(e2b_setup, cuts):
    engine, oracle, ckpt = e2b_setup
    ids = random_ids(ckpt.spec, 80, seed=len(cuts))  # 80 = 5 windows of 16
    ours = feed_segments(engine, ids, cuts)
    r = compare(ours, oracle_logits(oracle, ids))
    assert_top1(r, FP32_LOGIT_ERR, f"cuts {cuts}")
    assert r["min_cosine"] >= 0.9999, r


def test_gqa_preset_matches_transformers(tiny_gqa):
    r = verify_graph(tiny_gqa, tokens=72, prompt_len=11, precision="fp32")
    assert_top1(r, FP32_LOGIT_ERR, "gqa-mini fp32 graph")
    assert r["passed"] and r["min_cosine"] >= 0.9999, r


@pytest.mark.slow
def test_bf16_sharded_checkpoint(tiny_bf16_sharded):
    assert len(list(tiny_bf16_sharded.glob("model-*.safetensors"))) == 3
    r = verify_graph(tiny_bf16_sharded, tokens=48, prompt_len=9, precision="fp32")
    assert r["passed"], r


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_e2b", "tiny_gqa"])
def test_fp16_graph_within_documented_tolerance(request, fixture):
    r = verify_graph(request.getfixturevalue(fixture), tokens=48, prompt_len=13, precision="fp16")  # 3 windows
    assert r["top1_agreement"] >= FP16_MIN_TOP1 and r["min_cosine"] >= FP16_MIN_COSINE, r
    assert r["passed"]


@pytest.mark.slow
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

"""Gemma 4 E4B from the same code (issue 17, part): the real config plans by the same rule as E2B,
and a tiny checkpoint with E4B's structure (`e4b-mini`) matches transformers at every position,
through the graph and through a converted bundle."""

import json
from pathlib import Path

import pytest
from margins import assert_top1

from gemma_ane.bundle.plan import ChunkPlan
from gemma_ane.bundle.spec import ModelSpec
from gemma_ane.oracle.tiny import write_tiny
from gemma_ane.oracle.verify import FP16_MIN_COSINE, FP32_LOGIT_ERR, verify_bundle, verify_graph

# The fp16 bundle's |logit error| against transformers, for argmax checks (margins.assert_top1): measured max |logit
# diff| 0.41 over 96 positions (seed 0)
FP16_LOGIT_ERR = 0.5

E4B = Path(__file__).parent / "fixtures" / "e4b_config.json"


def test_e4b_plans_by_e2bs_rule():
    spec = ModelSpec.from_pretrained(E4B)
    plan = ChunkPlan.build(spec, 2048, 8)
    # half of the 24 cache-owning layers in chunk_1, the rest and half of the 18 shared in chunk_2
    assert [(c.layers[0], c.layers[-1]) for c in plan.chunks] == [(0, 11), (12, 32), (33, 41)]
    one, two, three = plan.chunks
    # two KV heads: the second axis of every state; 10 sliding and 2 full producers per stateful chunk
    assert {k: v.shape for k, v in one.states.items()} == {
        "kv_cache_sliding": (20, 2, 512, 512),
        "kv_cache_full": (4, 2, 2048, 512),
    }
    assert {k: v.shape for k, v in two.states.items()} == {k: v.shape for k, v in one.states.items()}
    assert three.states == {}
    # chunk_2 hands the last producers' K/V (layers 22 and 23) to chunk_3, two heads each
    outs = two.functions["infer"]["outputs"]
    assert {k: v.shape for k, v in outs.items() if k.startswith("kv")} == {
        "kv22_k": (1, 2, 512, 256),
        "kv22_v": (1, 2, 512, 256),
        "kv23_k": (1, 2, 2048, 512),
        "kv23_v": (1, 2, 2048, 512),
    }


@pytest.fixture(scope="module")
def tiny_e4b(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("e4b") / "ckpt"
    write_tiny(out, preset="e4b-mini")
    cfg = json.loads((out / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    assert (cfg["num_key_value_heads"], cfg["use_double_wide_mlp"], cfg["num_kv_shared_layers"]) == (2, False, 5)
    return out


def test_e4b_mini_graph_matches_transformers(tiny_e4b):
    r = verify_graph(tiny_e4b, tokens=72, prompt_len=11, precision="fp32")
    assert_top1(r, FP32_LOGIT_ERR, "e4b-mini fp32 graph")
    assert r["passed"] and r["min_cosine"] >= 0.9999, r


@pytest.mark.slow
def test_e4b_mini_bundle_matches_transformers(tiny_e4b, tmp_path):
    from gemma_ane.convert import ConvertOptions, convert

    convert(str(tiny_e4b), str(tmp_path / "bundle"), ConvertOptions(context=128, bits=16, vision=False), progress=False)
    r = verify_bundle(tiny_e4b, tmp_path / "bundle", tokens=96, precision="fp16", prompt_len=13)
    # measured: top-1 1.0, min cosine 0.99965; the documented fp16 bounds are 0.97 and 0.999
    assert_top1(r, FP16_LOGIT_ERR, "e4b-mini fp16 bundle")
    assert r["passed"] and r["min_cosine"] >= FP16_MIN_COSINE, r

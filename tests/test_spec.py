import copy
import json

import numpy as np
import pytest
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from gemma_ane.bundle.plan import ChunkPlan
from gemma_ane.bundle.spec import FULL, SLIDING, ConfigError, ModelSpec


def hf_text_config(text: dict) -> Gemma4TextConfig:
    return Gemma4TextConfig(**{k: v for k, v in text.items() if k not in ("model_type", "dtype")})


def test_e2b_spec_facts(e2b_config):
    s = ModelSpec.from_config(e2b_config)
    assert s.num_layers == 35 and s.hidden_size == 1536 and s.num_heads == 8
    assert [i for i, t in enumerate(s.layer_types) if t == FULL] == [4, 9, 14, 19, 24, 29, 34]
    assert s.head_dims == tuple(512 if t == FULL else 256 for t in s.layer_types)
    assert s.first_shared_layer == 15 and s.producers == [13, 14]
    assert all(s.kv_source[i] == (14 if s.layer_types[i] == FULL else 13) for i in range(15, 35))
    assert s.intermediate_sizes == (6144,) * 15 + (12288,) * 20
    assert s.rope[FULL].rotated_pairs == 64 and s.rope[SLIDING].rotated_pairs == 128
    assert s.per_layer_total == 8960 and s.final_logit_softcapping == 30.0
    assert s.eos_token_ids == (1,) and s.bos_token_id == 2
    assert abs(s.embed_scale - 39.1918) < 1e-4 and s.per_layer_embed_scale == 16.0


def test_kv_sharing_matches_transformers(e2b_config):
    for text in (e2b_config["text_config"], {**e2b_config["text_config"], "num_kv_shared_layers": 7}):
        s = ModelSpec.from_config({"text_config": text})
        modes = hf_text_config(text).kv_sharing_modes
        assert [m == "reuse" for m in modes] == [not s.owns_cache(i) for i in range(s.num_layers)]
        stores = [i for i, m in enumerate(modes) if m == "store"]
        assert stores == s.producers


def test_rope_matches_transformers_inv_freq(e2b_config):
    text = e2b_config["text_config"]
    rot = Gemma4TextRotaryEmbedding(hf_text_config(text))
    s = ModelSpec.from_config(e2b_config)
    for t in (SLIDING, FULL):
        np.testing.assert_allclose(s.rope[t].inv_freq(), getattr(rot, f"{t}_inv_freq").numpy(), rtol=2e-7, atol=0)


def test_config_forms_agree(e2b_config, tmp_path):
    text = copy.deepcopy(e2b_config["text_config"])
    multimodal = ModelSpec.from_config(e2b_config)
    text_only = ModelSpec.from_config(text)
    # newer transformers write per_layer_config instead of global_head_dim
    plc = {k: v for k, v in text.items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    plc["per_layer_config"] = {f"{i:02d}": {"head_dim": 512} for i in (4, 9, 14, 19, 24, 29, 34)}
    per_layer = ModelSpec.from_config(plc)
    (tmp_path / "config.json").write_text(json.dumps(e2b_config))
    from_dir = ModelSpec.from_pretrained(tmp_path)
    assert multimodal == text_only == per_layer == from_dir


def test_transformers_saved_config_is_read(tiny_e2b):
    saved = json.loads((tiny_e2b / "config.json").read_text())
    assert "per_layer_config" in saved["text_config"]  # what transformers 5.24 writes
    s = ModelSpec.from_pretrained(tiny_e2b)
    hf = hf_text_config(saved["text_config"])
    assert s.head_dims == tuple(hf.per_layer_config[i].head_dim for i in range(s.num_layers))


@pytest.mark.parametrize(
    "change",
    [
        {},  # global_head_dim on the full layers
        {"attention_k_eq_v": True, "num_global_key_value_heads": 2},  # K=V full layers take their own KV heads...
        {"attention_k_eq_v": False, "num_global_key_value_heads": 2},  # ...which only apply with K=V
        {"layer_types": None},  # the default 5:1 pattern
        {"layer_types": ([SLIDING] * 4 + [FULL]) * 6 + [SLIDING] * 5},  # the last layer is forced to full
        "per_layer_config",  # the form transformers writes, K=V heads included
    ],
)
def test_layer_shapes_match_transformers(e2b_config, change):
    text = copy.deepcopy(e2b_config["text_config"])
    if change == "per_layer_config":
        text.update(attention_k_eq_v=True, num_global_key_value_heads=2)
        text = {**hf_text_config(text).to_dict(), "model_type": "gemma4_text"}
        assert "per_layer_config" in text and "global_head_dim" not in text
    else:
        text.update(change)
    s, hf = ModelSpec.from_config(text), hf_text_config(text)
    assert list(s.layer_types) == hf.layer_types
    layers = [hf.per_layer_config[i] for i in range(s.num_layers)]
    assert list(zip(s.head_dims, s.kv_heads)) == [(c.head_dim, c.num_key_value_heads) for c in layers]


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("enable_moe_block", True, "enable_moe_block"),
        ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
        ("hidden_activation", "silu", "hidden_activation"),
        ("hidden_size_per_layer_input", 0, "hidden_size_per_layer_input"),
        ("hidden_size", "big", "hidden_size"),
        ("layer_types", ["sliding_attention"] * 3, "layer_types"),
        ("num_kv_shared_layers", 35, "num_kv_shared_layers"),
        (
            "rope_parameters",
            {"sliding_attention": {"rope_theta": 1e4}, "full_attention": {"rope_type": "yarn", "rope_theta": 1e6}},
            "rope_type",
        ),
        ("num_key_value_heads", 3, "not a multiple of its 3 KV heads"),
        ("layer_types", [[1]] * 35, "layer_types: unsupported attention type"),
        ("eos_token_id", [None], "eos_token_id=None"),
        ("final_logit_softcapping", "x", "final_logit_softcapping='x'"),
        ("per_layer_config", {"04": {"head_dim": None}}, "per_layer_config\\['04'\\].head_dim"),
        (
            "rope_parameters",
            {"sliding_attention": {"rope_theta": None}, "full_attention": {"rope_theta": 1e6}},
            "rope_theta=None",
        ),
        (
            "rope_parameters",
            {
                "sliding_attention": {"rope_theta": 1e4},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": "x", "rope_theta": 1e6},
            },
            "partial_rotary_factor='x'",
        ),
        ("rope_parameters", {SLIDING: {"rope_theta": 1e4, "factor": 8.0}, FULL: {"rope_theta": 1e6}}, "RoPE scaling"),
        ("head_dim", 255, "layer 0: head_dim=255 must be even"),
        ("per_layer_config", {"04": {"head_dim": 512}}, "full_attention have different head dims \\[256, 512\\]"),
        ("per_layer_config", {"x": {}}, "key 'x' is not a layer index"),
        ("per_layer_config", {"04": {"sliding_window": 4}}, "\\['04'\\].sliding_window: per-layer override"),
        (
            "per_layer_config",
            {"34": {"num_key_value_heads": 2}},
            "layer 34: .* head shape differs from its producer 14",
        ),
        ("layer_types", [SLIDING] * 35, "layer 34 \\(full_attention\\) is KV-shared but no earlier layer"),
        ("vocab_size_per_layer_input", 1024, "must equal vocab_size=262144"),
        ("tie_word_embeddings", False, "tie_word_embeddings=false"),
        ("eos_token_id", [], "eos_token_id: empty"),
    ],
)
def test_unsupported_configs_name_the_field(e2b_config, field, value, needle):
    cfg = copy.deepcopy(e2b_config)
    cfg["text_config"][field] = value
    with pytest.raises(ConfigError, match=needle):
        ModelSpec.from_config(cfg)


def test_missing_field_and_bad_files(e2b_config, tmp_path):
    cfg = copy.deepcopy(e2b_config)
    del cfg["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size: missing"):
        ModelSpec.from_config(cfg)
    with pytest.raises(ConfigError, match="no config.json"):
        ModelSpec.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON"):
        ModelSpec.from_pretrained(tmp_path)


def test_attention_k_eq_v_is_supported(e2b_config):
    cfg = copy.deepcopy(e2b_config)
    cfg["text_config"].update(attention_k_eq_v=True, num_global_key_value_heads=1)
    s = ModelSpec.from_config(cfg)
    assert s.k_eq_v == tuple(t == FULL for t in s.layer_types)


# -- the chunk plan ---------------------------------------------------------------------------


def io(plan, chunk, fn):
    return plan.to_json()["chunks"][chunk]["functions"][fn]


def t(shape, dtype="float16"):
    return {"shape": list(shape), "dtype": dtype}


def test_e2b_plan_is_the_published_layout(e2b_config):
    plan = ChunkPlan.build(ModelSpec.from_config(e2b_config))
    j = plan.to_json()
    assert [c["layers"] for c in j["chunks"]] == [list(range(0, 8)), list(range(8, 25)), list(range(25, 35))]
    c1, c2, c3 = j["chunks"]
    assert c1["states"] == {"kv_cache_sliding": t((14, 1, 512, 512)), "kv_cache_full": t((2, 1, 2048, 512))}
    assert c2["states"] == {"kv_cache_sliding": t((10, 1, 512, 512)), "kv_cache_full": t((4, 1, 2048, 512))}
    assert c3["states"] == {}
    assert set(c1["functions"]) == set(c2["functions"]) == {"infer", "prefill_b8"}
    for fn, T in (("infer", 1), ("prefill_b8", 8)):
        host = {
            "hidden_states": t((1, T, 1536)),
            "causal_mask_full": t((1, 1, T, 2048)),
            "causal_mask_sliding": t((1, 1, T, 512)),
        }
        rope = {
            "cos_s": t((1, 1, T, 256)),
            "sin_s": t((1, 1, T, 256)),
            "cos_f": t((1, 1, T, 512)),
            "sin_f": t((1, 1, T, 512)),
        }
        pos = {"current_pos": t((1,), "int32"), "ring_pos": t((1,), "int32")}
        assert io(plan, 0, fn)["inputs"] == {**host, "per_layer_raw": t((1, T, 8960)), **rope, **pos}
        assert io(plan, 0, fn)["outputs"] == {
            "hidden_states_out": t((1, T, 1536)),
            "per_layer_combined_out": t((1, T, 8960)),
        }
        assert io(plan, 1, fn)["inputs"] == {**host, "per_layer_combined": t((1, T, 8960)), **rope, **pos}
        assert io(plan, 1, fn)["outputs"] == {
            "hidden_states_out": t((1, T, 1536)),
            "kv13_k": t((1, 1, 512, 256)),
            "kv13_v": t((1, 1, 512, 256)),
            "kv14_k": t((1, 1, 2048, 512)),
            "kv14_v": t((1, 1, 2048, 512)),
        }
    host1 = {
        "hidden_states": t((1, 1, 1536)),
        "causal_mask_full": t((1, 1, 1, 2048)),
        "causal_mask_sliding": t((1, 1, 1, 512)),
        "per_layer_combined": t((1, 1, 8960)),
        "cos_s": t((1, 1, 1, 256)),
        "sin_s": t((1, 1, 1, 256)),
        "cos_f": t((1, 1, 1, 512)),
        "sin_f": t((1, 1, 1, 512)),
    }
    assert io(plan, 2, "infer")["inputs"] == {
        **host1,
        "kv13_k": t((1, 1, 512, 256)),
        "kv13_v": t((1, 1, 512, 256)),
        "kv14_k": t((1, 1, 2048, 512)),
        "kv14_v": t((1, 1, 2048, 512)),
    }
    assert io(plan, 2, "infer")["outputs"] == {"logits": t((1, 1, 262144))}


def test_plan_options_and_errors(e2b_config):
    spec = ModelSpec.from_config(e2b_config)
    p = ChunkPlan.build(spec, context=1024, prefill_batch=16, split=(6, 20))
    assert [c.layers[0] for c in p.chunks] == [0, 6, 20]
    assert "prefill_b16" in p.chunks[0].functions
    assert p.chunks[0].states["kv_cache_full"].shape == (2, 1, 1024, 512)
    with pytest.raises(ConfigError, match="multiple of 32"):
        ChunkPlan.build(spec, context=1000)
    with pytest.raises(ConfigError, match="at least the sliding window"):
        ChunkPlan.build(spec, context=256)
    with pytest.raises(ConfigError, match="layer 14 is a KV producer and must precede the stateless last chunk"):
        ChunkPlan.build(spec, split=(8, 12))
    with pytest.raises(ConfigError, match="boundary 8 does not come after 25"):
        ChunkPlan.build(spec, split=(25, 8))
    with pytest.raises(ConfigError, match="prefill_batch"):
        ChunkPlan.build(spec, prefill_batch=0)
    with pytest.raises(ConfigError, match="context=2048.0: must be a positive integer"):
        ChunkPlan.build(spec, context=2048.0)
    with pytest.raises(ConfigError, match="kv prefill batch 3: must be an integer >= 2 that divides the window"):
        ChunkPlan.build(spec, kv_batches=(8, 3))
    with pytest.raises(ConfigError, match="head='argmax'"):
        ChunkPlan.build(spec, head="argmax")


def test_e2b_kv_only_prefill_and_argmax_head(e2b_config):
    plan = ChunkPlan.build(ModelSpec.from_config(e2b_config), kv_batches=(8, 16, 8), head="token_id")
    stateful = ["infer", "prefill_b8", "prefill_kv_b16", "prefill_kv_b8"]
    assert [list(c.functions) for c in plan.chunks] == [stateful, stateful, ["infer"]]
    own = 15 * 256  # PLE of the 15 cache-owning layers only
    rope = {
        "cos_s": t((1, 1, 16, 256)),
        "sin_s": t((1, 1, 16, 256)),
        "cos_f": t((1, 1, 16, 512)),
        "sin_f": t((1, 1, 16, 512)),
    }
    host = {
        "hidden_states": t((1, 16, 1536)),
        "causal_mask_full": t((1, 1, 16, 2048)),
        "causal_mask_sliding": t((1, 1, 16, 512 + 16)),  # [ring as it was | the batch]
        **rope,
        "current_pos": t((1,), "int32"),
        "ring_pos": t((1,), "int32"),
    }
    assert io(plan, 0, "prefill_kv_b16") == {
        "inputs": {**host, "per_layer_raw": t((1, 16, own))},
        "outputs": {"hidden_states_out": t((1, 16, 1536)), "per_layer_combined_out": t((1, 16, own))},
    }
    assert io(plan, 1, "prefill_kv_b16") == {
        "inputs": {**host, "per_layer_combined": t((1, 16, own))},
        "outputs": {"hidden_states_out": t((1, 16, 1536))},
    }
    assert plan.chunks[1].functions["prefill_kv_b16"]["kv_only"] and "kv_only" not in plan.chunks[1].functions["infer"]
    assert io(plan, 2, "infer")["outputs"] == {"token_id": t((1,), "int32"), "token_logit": t((1,))}


def test_default_split_for_other_depths(tiny_e2b, tiny_gqa):
    assert ChunkPlan.build(ModelSpec.from_pretrained(tiny_e2b), 128).split == (5, 13)
    plan = ChunkPlan.build(ModelSpec.from_pretrained(tiny_gqa), 128)
    assert plan.split == (4, 10)
    # chunk_1 of gqa-mini holds only sliding layers: it has no full-attention state at all
    assert set(plan.chunks[0].states) == {"kv_cache_sliding"}
    assert plan.chunks[1].states["kv_cache_sliding"].shape == (6, 2, 8, 32)  # 2 KV heads, padded to 32
    assert plan.chunks[1].states["kv_cache_full"].shape == (2, 1, 128, 32)  # K=V full layers: 1 KV head


@pytest.mark.parametrize(
    "text, why",
    [("[" * 100_000 + "]" * 100_000, "nested too deeply"), ("{oops", "Expecting property name"), ("\udcff", "utf-8")],
    ids=["deep", "not-json", "not-utf8"],
)
def test_a_config_file_past_reading_is_one_line(tmp_path, text, why):
    """A checkpoint's (or a bundle's hf_model/) config.json damaged past parsing: a ConfigError naming it, never the
    parser's RecursionError (json recurses once per level)."""
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match=rf"^{path}: not a readable JSON config \(.*{why}"):
        ModelSpec.from_pretrained(tmp_path)

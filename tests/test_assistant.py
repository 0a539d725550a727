"""Gemma 4's drafter on the oracle side: the tiny assistant `gemma-ane tiny --assistant` writes, what transformers'
assisted decoding feeds it (the recipe a converted drafter must reproduce), its centroid head, and which
target/assistant pairings AssistantSpec accepts."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors.numpy import load_file

from gemma_ane.bundle.spec import AssistantSpec, ConfigError, ModelSpec
from gemma_ane.cli import main
from gemma_ane.oracle.tiny import assistant_config, build_assistant, build_model, text_config

FIXTURES = Path(__file__).parent / "fixtures"
W, H = 16, 64  # e2b-mini's window and hidden size
PROMPT, NEW = 24, 56  # 80 positions: the window five times over


@pytest.fixture(scope="module")
def models(pair):
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForConditionalGeneration

    return (
        Gemma4ForConditionalGeneration.from_pretrained(pair[0]).eval(),
        Gemma4AssistantForCausalLM.from_pretrained(pair[1]).eval(),
    )


def prompt(n=PROMPT):
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(1))


def greedy(target, assistant=None):
    with torch.no_grad():
        return target.generate(prompt(), assistant_model=assistant, do_sample=False, max_new_tokens=NEW)


@pytest.fixture(scope="module")
def plain(models):
    out = greedy(models[0])
    assert out.shape[1] == PROMPT + NEW >= 5 * W  # no eos among the first NEW greedy tokens
    return out


@pytest.fixture(scope="module")
def assisted(models):
    """One assisted run as written (4 drafts per round), recording every drafter call and its final-norm output."""
    target, assistant = models
    calls, normed = [], []
    hooks = [
        assistant.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out)), with_kwargs=True),
        assistant.model.norm.register_forward_hook(lambda m, a, out: normed.append(out)),
    ]
    try:
        out = greedy(target, assistant)
    finally:
        for h in hooks:
            h.remove()
    return out, calls, normed


# -- the tiny assistant --------------------------------------------------------------------------


@pytest.mark.parametrize("loader", ["AutoModelForCausalLM", "Gemma4AssistantForCausalLM"])
def test_tiny_assistant_loads_as_built(pair, loader):
    import transformers

    model, info = getattr(transformers, loader).from_pretrained(pair[1], output_loading_info=True)
    assert type(model).__name__ == "Gemma4AssistantForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied to the target's vocabulary
    built = build_assistant("e2b-mini", seed=0).state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == built.keys() and all(torch.equal(loaded[k], built[k]) for k in built)
    order = loaded["masked_embedding.token_ordering"]
    assert torch.equal(order.sort().values, torch.arange(512)) and not torch.equal(order, torch.arange(512))


def test_tiny_assistant_config_is_the_real_one_scaled_down(pair):
    real = json.loads((FIXTURES / "e2b_assistant_config.json").read_text())
    tiny = json.loads((pair[1] / "config.json").read_text())
    for key in ("architectures", "model_type", "use_ordered_embeddings", "tie_word_embeddings"):
        assert tiny[key] == real[key], key
    t = tiny["text_config"]
    assert t["layer_types"] == real["text_config"]["layer_types"]
    assert t["num_kv_shared_layers"] == t["num_hidden_layers"] == 4
    assert t["hidden_size_per_layer_input"] == 0 and t["final_logit_softcapping"] is None
    assert t["hidden_size"] < H and t["num_attention_heads"] < text_config("e2b-mini")["num_attention_heads"]


# -- against transformers' assisted decoding -----------------------------------------------------


def test_assisted_greedy_equals_plain_greedy(plain, assisted):
    out, calls, _ = assisted
    assert torch.equal(out, plain)
    # the drafter ran, 4 drafts per round as its generation config says (a random drafter is nearly always
    # rejected, so nearly every token costs a round)
    assert len(calls) >= 3 * NEW


def test_one_draft_per_round_equals_plain_greedy(pair, models, plain):
    from transformers import Gemma4AssistantForCausalLM

    assistant = Gemma4AssistantForCausalLM.from_pretrained(pair[1]).eval()  # its own copy: K is mutable state
    assistant.generation_config.num_assistant_tokens = 1
    assert torch.equal(greedy(models[0], assistant), plain)


def test_gqa_mini_drafter_equals_plain_greedy():
    """Two KV heads on sliding layers, one (K=V) on full ones: the drafter's layers take each type's shape
    (transformers would run a drafter with the wrong KV head count without complaint: AssistantSpec refuses it)."""
    spec = AssistantSpec.from_config(assistant_config("gqa-mini"), _target("gqa-mini"))
    assert spec.kv_heads == (2, 2, 2, 1) and spec.kv_source == (7, 7, 7, 5)
    target, assistant = build_model("gqa-mini"), build_assistant("gqa-mini")
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = target.generate(ids, do_sample=False, max_new_tokens=28)
        drafted = target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=28)
    assert plain.shape[1] == 40 and torch.equal(drafted, plain)  # window 8, five times over


def test_assistant_reads_the_targets_last_producer_of_each_type(pair, models):
    spec = AssistantSpec.from_pretrained(pair[1], ModelSpec.from_pretrained(pair[0]))
    assert spec.kv_source == (8, 8, 8, 9)  # e2b-mini: layers 10-14 share; 8 and 9 are the last that own a cache
    assert (spec.backbone_hidden_size, spec.head_dims, spec.kv_heads) == (H, (32, 32, 32, 64), (1, 1, 1, 1))
    assert (spec.num_centroids, spec.centroid_top_k, spec.cluster_size) == (32, 4, 16)
    # what transformers hands the drafter is exactly those layers' K/V (the sliding cache keeps the last W-1)
    with torch.no_grad():
        out = models[0](prompt(40), use_cache=True, return_shared_kv_states=True)
    for t, src in (("sliding_attention", 8), ("full_attention", 9)):
        k, v = out.shared_kv_states[t]
        layer = out.cache.layers[src]
        n = layer.keys.shape[2]
        assert torch.equal(k[:, :, -n:], layer.keys) and torch.equal(v[:, :, -n:], layer.values), t


def test_drafter_inputs_are_the_documented_recipe(models, assisted):
    """A burst at position P (the last token's, whose own K/V the target has not computed yet): input
    [target embedding row * sqrt(H); target final-norm output at P-1], then [next draft's row * sqrt(H);
    post_projection output]; sliding layers read target K/V at P-W-1..P-1 (W+1 rows, not W), full layers 0..P-1."""
    target, assistant = models
    out, calls, _ = assisted
    ids = prompt()
    normed = []
    hook = target.model.language_model.norm.register_forward_hook(lambda m, a, o: normed.append(o))
    with torch.no_grad():
        kv = target(ids, return_shared_kv_states=True).shared_kv_states
    hook.remove()
    E = target.model.language_model.embed_tokens.weight
    P = PROMPT

    def draft(token, carry, sliding_rows):
        shared = {
            "sliding_attention": tuple(x[:, :, P - sliding_rows : P] for x in kv["sliding_attention"]),
            "full_attention": tuple(x[:, :, :P] for x in kv["full_attention"]),
        }
        x = torch.cat([E[token][None, None] * math.sqrt(H), carry], dim=-1)
        with torch.no_grad():
            return assistant(inputs_embeds=x, position_ids=torch.tensor([[P]]), shared_kv_states=shared)

    first, second = calls[0][1], calls[1][1]
    mine = draft(int(out[0, P]), normed[0][:, -1:], W + 1)
    assert torch.allclose(mine.logits, first.logits, atol=1e-4)
    assert torch.allclose(mine.last_hidden_state, first.last_hidden_state, atol=1e-5)
    assert not torch.allclose(draft(int(out[0, P]), normed[0][:, -1:], W).logits, first.logits, atol=1e-2)
    assert calls[1][0]["position_ids"].item() == P  # the position stays put within a burst
    mine = draft(int(first.logits.argmax()), first.last_hidden_state, W + 1)
    assert torch.allclose(mine.logits, second.logits, atol=1e-4)


def test_centroid_head_from_the_written_tensors(pair, assisted):
    """Logits = h . E[token] for the tokens of the top-k clusters by h . centroids (cluster c holds the tokens
    token_ordering[c*16:(c+1)*16]); every other token gets (min of those) - 1."""
    _, calls, normed = assisted
    w = load_file(pair[1] / "model.safetensors")
    C, E, order = (
        w["masked_embedding.centroids.weight"],
        w["model.embed_tokens.weight"],
        w["masked_embedding.token_ordering"],
    )
    for (_, out), h in list(zip(calls, normed))[:8]:
        h = h[0, 0].numpy()
        top = np.argsort(-(C @ h))[:4]
        tokens = order.reshape(32, 16)[top].ravel()
        scored = E[tokens] @ h
        expect = np.full(512, scored.min() - 1, np.float32)
        expect[tokens] = scored
        np.testing.assert_allclose(out.logits[0, 0].numpy(), expect, rtol=1e-5, atol=1e-5)


# -- pairings ------------------------------------------------------------------------------------


def test_the_real_e2b_assistant_pairs_with_e2b():
    spec = AssistantSpec.from_pretrained(
        FIXTURES / "e2b_assistant_config.json", ModelSpec.from_pretrained(FIXTURES / "e2b_config.json")
    )
    assert spec.kv_source == (13, 13, 13, 14) and spec.backbone_hidden_size == 1536
    assert (spec.head_dims, spec.num_heads, spec.hidden_size) == ((256, 256, 256, 512), 4, 256)
    assert (spec.num_centroids, spec.centroid_top_k, spec.cluster_size) == (2048, 32, 128)


def _target(preset):
    return ModelSpec.from_config({"text_config": text_config(preset)})


def _edited(**text):
    cfg = assistant_config("e2b-mini")
    top = {k: text.pop(k) for k in list(text) if k in cfg}
    return {**cfg, **top, "text_config": {**cfg["text_config"], **text}}


@pytest.mark.parametrize(
    "assistant, target, needles",
    [
        (assistant_config("e2b-mini"), "gqa-mini", ["backbone_hidden_size=64", "48"]),
        (assistant_config("e2b-mini"), "e2b-wide", ["backbone_hidden_size=64", "1536"]),
        # same hidden size, vocabulary and window, but E4B's two KV heads
        (assistant_config("e2b-mini"), "e4b-mini", ["layer 0", "target layer 6", "32 x 2"]),
        (assistant_config("gqa-mini"), "e2b-mini", ["backbone_hidden_size=48"]),
        (_edited(vocab_size=256, num_centroids=16), "e2b-mini", ["vocab_size=256", "512"]),
        (_edited(sliding_window=8), "e2b-mini", ["sliding_window=8", "16"]),
        (_edited(num_kv_shared_layers=2), "e2b-mini", ["num_kv_shared_layers=2"]),
        (
            _edited(rope_parameters={"sliding_attention": {"rope_theta": 1.0}, "full_attention": {"rope_theta": 1.0}}),
            "e2b-mini",
            ["rope_parameters.full_attention"],
        ),
        (_edited(num_centroids=24), "e2b-mini", ["num_centroids=24"]),
        (_edited(centroid_intermediate_top_k=33), "e2b-mini", ["centroid_intermediate_top_k=33"]),
        (_edited(model_type="gemma4"), "e2b-mini", ["model_type='gemma4'"]),
    ],
)
def test_a_bad_pairing_is_refused_in_one_line(assistant, target, needles):
    with pytest.raises(ConfigError) as e:
        AssistantSpec.from_config(assistant, _target(target))
    assert "\n" not in str(e.value)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_the_real_e2b_assistant_is_refused_for_e4b():
    e4b = ModelSpec.from_pretrained(FIXTURES / "e4b_config.json")
    with pytest.raises(
        ConfigError, match=r"e2b_assistant_config.json: backbone_hidden_size=1536: the target's is 2560"
    ):
        AssistantSpec.from_pretrained(FIXTURES / "e2b_assistant_config.json", e4b)


# -- the command line ----------------------------------------------------------------------------


def test_cli_writes_the_assistant_and_refuses_to_overwrite_it(capsys, tmp_path, pair):
    asst = tmp_path / "asst"
    assert main(["tiny", str(tmp_path / "ckpt"), "--dtype", "bf16", "--assistant", str(asst)]) == 0
    out, err = capsys.readouterr()
    assert str(asst) in out and err == ""
    w = safetensors.torch.load_file(asst / "model.safetensors")
    assert w["pre_projection.weight"].dtype == torch.bfloat16
    ref = load_file(pair[1] / "model.safetensors")["masked_embedding.token_ordering"]
    assert np.array_equal(w["masked_embedding.token_ordering"].numpy(), ref)  # int64, untouched by the cast
    # an existing assistant stops the whole command before anything is written
    assert main(["tiny", str(tmp_path / "other"), "--assistant", str(asst)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        len(err) == 1 and err[0].startswith("gemma-ane tiny: error: ") and str(asst) in err[0] and "--force" in err[0]
    )
    assert not (tmp_path / "other").exists()

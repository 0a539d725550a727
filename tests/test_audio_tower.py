"""The audio tower (audio_tower.py) against transformers' get_audio_features, the soft tokens that replace a clip's
placeholders: the static-shape PyTorch module in fp32, on clips of several lengths through one bucket, the rows
past each clip dropped as transformers drops them."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gemma_ane.convert.models.audio import (
    AudioModel,
    AudioSpec,
    AudioTowerError,
    block_mask,
    bucket_frames,
    load_audio_tower,
    rel_shift,
)
from gemma_ane.oracle.tiny import AUDIO, build_model
from gemma_ane.runtime import audio

FRAMES = 192  # 1.9 s; 48 soft-token rows, four attention blocks
LENGTHS = [161, 1000, 7919, 16000, 23456, 30528]  # 1 .. 48 tokens: one frame, mid-block, a bucket filled exactly


@pytest.fixture(scope="module")
def oracle():
    return build_model("e2b-audio-mini")


@pytest.fixture(scope="module")
def spec(oracle):
    return AudioSpec.from_config(oracle.config.to_dict())


@pytest.fixture(scope="module")
def ours(oracle, spec):
    state = {k: v.numpy() for k, v in oracle.state_dict().items() if "audio" in k}
    return load_audio_tower(state, spec, FRAMES)


def clip(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + n)
    t = np.arange(n) / audio.SAMPLE_RATE
    return (0.4 * np.sin(2 * np.pi * (150 + 400 * t) * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


def reference(oracle, x):
    """transformers' soft tokens for one clip: its features as the extractor makes them, the encoder's output rows
    where its mask is True (Gemma4Model.forward's audio_features[audio_mask])."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    f = Gemma4AudioFeatureExtractor()([x], return_tensors="pt")
    with torch.no_grad():
        out = oracle.model.get_audio_features(f["input_features"], f["input_features_mask"])
    return out.pooler_output[out.attention_mask].numpy()


def run(model, x):
    p = audio.preprocess(x, frames=model.frames)
    with torch.no_grad():
        (out,) = model(torch.from_numpy(p.features)[None], torch.from_numpy(p.mask.astype(np.float32))[None])
    return out[0].numpy(), p.soft_tokens


@pytest.mark.parametrize("n", LENGTHS)
def test_tower_equals_transformers_fp32(oracle, ours, n):
    want = reference(oracle, clip(n))
    got, tokens = run(ours, clip(n))
    assert got.shape == (FRAMES // 4, 64)
    assert tokens == len(want)
    err = np.abs(got[:tokens] - want).max() / np.abs(want).max()
    assert err < 1e-5, err


def test_padding_after_the_clip_changes_nothing(ours):
    """The rows of a clip are the same whatever follows it in the bucket: with its own mask, the frames past it
    may hold anything."""
    x = clip(7919)
    p = audio.preprocess(x, frames=FRAMES)
    noisy = p.features.copy()
    noisy[~p.mask] = np.random.default_rng(0).normal(0, 5, (int((~p.mask).sum()), 128))
    mask = torch.from_numpy(p.mask.astype(np.float32))[None]
    with torch.no_grad():
        (a,) = ours(torch.from_numpy(p.features)[None], mask)
        (b,) = ours(torch.from_numpy(noisy)[None], mask)
    assert torch.equal(a[0, : p.soft_tokens], b[0, : p.soft_tokens])


def test_the_mask_reaches_the_subsampling(oracle, ours):
    """The last frames of a clip ending mid-bucket read the masked frames after it through the convolutions: with
    an all-ones mask (the masked frames' zeros taken as audio) the last row differs from transformers'."""
    x = clip(23456)
    want = reference(oracle, x)
    p = audio.preprocess(x, frames=FRAMES)
    noisy = p.features.copy()
    noisy[~p.mask] = 3.0
    with torch.no_grad():
        (out,) = ours(torch.from_numpy(noisy)[None], torch.from_numpy(p.mask.astype(np.float32))[None])
        (unmasked,) = ours(torch.from_numpy(noisy)[None], torch.ones(1, FRAMES))
    assert np.abs(out[0, : p.soft_tokens].numpy() - want).max() < 1e-4
    assert np.abs(unmasked[0, p.soft_tokens - 1].numpy() - want[-1]).max() > 1e-2


def test_relative_keys_shift_as_transformers_shifts_logits(oracle, ours):
    """freeze()'s keys, dotted with a block's queries, give transformers' shifted position logits exactly."""
    ta = oracle.model.audio_tower.layers[0].self_attn
    mine = ours.audio_tower.layers[0].self_attn
    s = mine.spec
    pos = oracle.model.audio_tower.rel_pos_enc(torch.zeros(1, 1, s.hidden_size))
    rel = ta.relative_k_proj(pos).view(-1, s.num_heads, s.head_dim)
    q = torch.randn(1, s.num_heads, 3, s.chunk, s.head_dim, dtype=torch.float64)
    bd = (q.reshape(1, s.num_heads, -1, s.head_dim) @ rel.double().permute(1, 2, 0)).reshape(
        1, s.num_heads, 3, s.chunk, -1
    )
    want = ta._rel_shift(bd)[0]
    got = torch.matmul(q[0].permute(0, 2, 1, 3), mine.relative_keys.double()).permute(0, 2, 1, 3)
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.equal(rel_shift(bd, s.context), ta._rel_shift(bd))


def test_block_mask_is_the_sliding_window(oracle, spec):
    """Our constant mask equals transformers' blocked mask for a clip that fills the bucket."""
    T = FRAMES // 4
    from transformers.masking_utils import create_bidirectional_mask
    from transformers.models.gemma4.modeling_gemma4 import sliding_window_mask_function

    tower = oracle.model.audio_tower
    m4 = create_bidirectional_mask(
        config=tower.config,
        inputs_embeds=torch.zeros(1, T, spec.hidden_size),
        attention_mask=torch.ones(1, T, dtype=torch.bool),
        and_mask_function=sliding_window_mask_function((spec.context_left - 1, 0)),
    )
    blocked = tower._convert_4d_mask_to_blocked_5d(m4)[0, 0]  # 0 allowed, finfo.min blocked
    assert torch.equal(block_mask(spec, T)[0] == 0, blocked == 0)


def test_spec_refusals():
    base = {"audio_config": dict(AUDIO, rms_norm_eps=1e-6), "text_config": {"hidden_size": 64}}

    def with_(**kw):
        return {**base, "audio_config": {**base["audio_config"], **kw}}

    assert AudioSpec.from_config({"text_config": {}}) is None
    cases = {
        "attention_context_right = 2": with_(attention_context_right=2),
        "attention_context_left = 7": with_(attention_context_left=7),
        "attention_context_left = 1": with_(attention_context_left=1),
        "hidden_act = 'gelu'": with_(hidden_act="gelu"),
        r"subsampling_conv_channels = \[8, 4\]": with_(subsampling_conv_channels=[8, 4]),
    }
    for match, cfg in cases.items():
        with pytest.raises(AudioTowerError, match=rf"^config.json: audio_config.{match} is not supported$"):
            AudioSpec.from_config(cfg)
    spec = AudioSpec.from_config(base)
    with pytest.raises(AudioTowerError, match=r"^frames 100: must be a positive multiple of 48 \(4 x chunk\)$"):
        AudioModel(spec, 100)


def test_load_refuses_a_missing_or_misshapen_tensor(oracle, spec):
    state = {k: v.numpy() for k, v in oracle.state_dict().items() if "audio" in k}
    name = "model.audio_tower.layers.1.lconv1d.depthwise_conv1d.weight"
    with pytest.raises(AudioTowerError, match=rf"^tensor {name} missing$"):
        load_audio_tower({k: v for k, v in state.items() if k != name}, spec, 48)
    with pytest.raises(AudioTowerError, match=rf"^tensor {name} has shape \(32, 1, 4\), expected \(32, 1, 5\)$"):
        load_audio_tower({**state, name: state[name][..., :4]}, spec, 48)


def test_bucket_frames():
    assert bucket_frames(audio.num_frames(30 * audio.SAMPLE_RATE)) == 3024
    assert [bucket_frames(n) for n in (0, 1, 48, 49)] == [48, 48, 48, 96]


def test_e2b_widths():
    """E2B's audio geometry (config.json's audio_config: hidden 1024, 8 heads of 128, subsampling channels 128 and
    32, output 1536, text width 1536) with one conformer layer, against transformers: the shapes only the real
    widths have (a 32 x 32 projection input, 1536-wide soft tokens)."""
    from transformers import Gemma4AudioConfig, Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder

    config = json.loads((Path(__file__).parent / "fixtures" / "e2b_config.json").read_text())
    a = {k: v for k, v in config["audio_config"].items() if k != "model_type"}
    a["num_hidden_layers"] = 1
    torch.manual_seed(0)
    tower = Gemma4AudioModel(Gemma4AudioConfig(**a)).eval()
    embed = Gemma4MultimodalEmbedder(Gemma4AudioConfig(**a), Gemma4TextConfig(hidden_size=1536)).eval()
    with torch.no_grad():
        for name, t in tower.named_parameters():
            if name.endswith("norm.weight"):
                t.uniform_(0.5, 2.0)
            elif name.endswith("per_dim_scale"):
                t.normal_()
            elif t.dim() > 1:
                t.normal_(0, 1 / np.sqrt(t[0].numel()))
    state = {"model.audio_tower." + k: v.numpy() for k, v in tower.state_dict().items()}
    state |= {"model.embed_audio." + k: v.numpy() for k, v in embed.state_dict().items()}
    spec = AudioSpec.from_config({**config, "audio_config": a})
    ours = load_audio_tower(state, spec, 96)
    x = clip(12000)
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    f = Gemma4AudioFeatureExtractor()([x], return_tensors="pt")
    with torch.no_grad():
        out = tower(f["input_features"], f["input_features_mask"])
        want = embed(out.last_hidden_state)[out.attention_mask].numpy()
    got, tokens = run(ours, x)
    assert got.shape == (24, 1536) and tokens == len(want) == 19
    assert np.abs(got[:tokens] - want).max() / np.abs(want).max() < 1e-5

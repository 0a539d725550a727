"""Random tiny Gemma 4 checkpoints, built and saved by transformers itself.

They exist so every test can compare against transformers' forward pass. The weights are chosen
so that a wrong formula cannot hide: norm weights far from 1, layer scalars far from 1, and a
residual stream large enough that a naive fp16 RMSNorm would overflow. Each preset also has a
matched drafter (Gemma4AssistantForCausalLM) for speculative decoding.

One preset is not random: `demo` was trained for a few CPU minutes on a small chat corpus (tiny_train.py,
demo_corpus.py) so that the demo answers checkably; its trained weights ship with the package (`--train` trains
anew).
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

from ..errors import InputError
from ..files import building, is_within
from .tokenizer_files import TINY_AUDIO_TOKENS, TINY_MEDIA_TOKENS, write_tokenizer_files

S, F = "sliding_attention", "full_attention"

PRESETS = {
    # E2B's structure scaled down: 4:1 sliding/full, one KV head, sliding 32 vs full 64 head dims
    # with proportional 1/4 RoPE, KV sharing with a producer of each type, double-wide MLP in the
    # shared layers, PLE, softcap 30, and a window of 16 so tests cross the ring many times.
    "e2b-mini": dict(
        vocab_size=512,
        hidden_size=64,
        hidden_size_per_layer_input=16,
        intermediate_size=128,
        num_hidden_layers=15,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        num_kv_shared_layers=5,
        use_double_wide_mlp=True,
        sliding_window=16,
        layer_types=[S, S, S, S, F] * 3,
    ),
    # A different shape of the family: 5:1 pattern, grouped-query attention (2 KV heads), K=V full
    # layers with their own KV head count, a chunk_1 with no full layer, window 8.
    "gqa-mini": dict(
        vocab_size=512,
        hidden_size=48,
        hidden_size_per_layer_input=8,
        intermediate_size=96,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_kv_shared_layers=4,
        use_double_wide_mlp=False,
        sliding_window=8,
        layer_types=[S, S, S, S, S, F] * 2,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),
    # E4B's structure scaled down: 5:1 sliding/full, two KV heads in every layer (no K=V, no
    # separate full-layer KV head count), no double-wide MLP, the last layers KV-shared with the
    # last producer of each type (E4B: 18 of 42 shared, producers 22 and 23; here 5 of 12, 5 and 6).
    "e4b-mini": dict(
        vocab_size=512,
        hidden_size=64,
        hidden_size_per_layer_input=16,
        intermediate_size=128,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_kv_shared_layers=5,
        use_double_wide_mlp=False,
        sliding_window=16,
        layer_types=[S, S, S, S, S, F] * 2,
    ),
    # E2B's real widths (hidden 1536, 8 query heads, head dims 256/512, MLP 6144 / 12288, PLE 256,
    # window 512) with only 6 layers and a small vocabulary: catches shape assumptions that only
    # show at full width, at a size a test can convert.
    "e2b-wide": dict(
        vocab_size=1024,
        hidden_size=1536,
        hidden_size_per_layer_input=256,
        intermediate_size=6144,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        sliding_window=512,
        layer_types=[S, S, S, F, S, F],
    ),
    # E2B's real geometry at a narrow width: all 35 layers (full at 4, 9, ..., 34), the last 20
    # KV-shared and double-wide, window 512. Converted at context 2048 it runs the ring and the
    # masks where a real model does: prefill past the window, wrap, decode past 1024.
    "e2b-narrow": dict(
        vocab_size=512,
        hidden_size=64,
        hidden_size_per_layer_input=8,
        intermediate_size=64,
        num_hidden_layers=35,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        num_kv_shared_layers=20,
        use_double_wide_mlp=True,
        sliding_window=512,
        layer_types=[S, S, S, S, F] * 7,
    ),
    # Not random: trained on demo_corpus (tiny_train.py) so the demo answers. e2b-wide's 6-layer pattern at a
    # width that learns the corpus in a few CPU minutes; a vocabulary whose merges come from the corpus (short
    # prompts: a tool declaration is ~40 tokens; 768 ids hold all its ~360 merges); a window of 128, which holds
    # every training conversation whole (a bundle's context, 512 for the demo, must be >= the window).
    # Head dims and the per-layer width are E2B's minimum for the Neural Engine audit (a last axis of 64 bytes:
    # RoPE's half of a 32-wide head is 16 fp16 values, too narrow), so `inspect --ane` passes on the demo bundle.
    "demo": dict(
        vocab_size=768,
        hidden_size=128,
        hidden_size_per_layer_input=32,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        global_head_dim=128,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        sliding_window=128,
        layer_types=[S, S, S, F, S, F],
    ),
}
# e2b-mini with an audio tower that runs (AUDIO): the other presets keep the small one they have always had, whose
# subsampling width (8 channels) cannot take 128 mel bins, so that their checkpoints stay byte-identical.
PRESETS["e2b-audio-mini"] = PRESETS["e2b-mini"]

# Presets whose text weights are trained (tiny_train.train) from transformers' own initialisation, not drawn.
TRAINED = {"demo"}
# seeds torch takes: seed + 2 (the audio tower's) must stay below 2**64
MAX_SEED = 2**63

# Rescaled draws for presets that need conditioning (the same random stream, so the others keep their
# weights). 35 random layers are chaotic: each adds three post-normed terms at full size, so fp16
# rounding in early layers moves the logits of late ones. Halving those terms and doubling the tied
# embedding keeps the token's own signal in the residual and spreads the logits (e2b-narrow's fp16
# bundle vs transformers over 1100 positions: min cosine 0.96 -> 0.9995, top-1 0.985 -> 1.0).
CONDITIONING = {"e2b-narrow": dict(post_norm=0.5, embed=2.0)}
POST_NORMS = tuple(
    f"{n}.weight" for n in ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")
)


def text_config(preset: str) -> dict:
    if preset not in PRESETS:
        raise InputError(f"--preset {preset!r}: choose one of {', '.join(PRESETS)}")
    cfg = dict(
        model_type="gemma4_text",
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        max_position_embeddings=4096,
    )
    cfg.update(PRESETS[preset])
    cfg["vocab_size_per_layer_input"] = cfg["vocab_size"]
    return cfg


# The drafter of every preset, shaped like E2B's (4 layers S,S,S,F, narrower than its target, fewer query
# heads), with the attention geometry of its target: every layer reads the K/V of the target's last cache-owning
# layer of its type, so head dims, KV heads, window and RoPE must be the target's. Its head keeps the real one's
# structure at the tiny vocabulary: clusters of 16 tokens, the best 1/8 of them scored in full (E2B: 2048
# clusters of 128 tokens, the best 32 scored).
ASSISTANT = dict(hidden_size=32, intermediate_size=128, num_attention_heads=2, cluster_size=16, top_fraction=8)
FROM_TARGET = (
    "vocab_size",
    "head_dim",
    "global_head_dim",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "attention_k_eq_v",
    "sliding_window",
    "rms_norm_eps",
    "max_position_embeddings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)


def assistant_config(preset: str) -> dict:
    """The config.json of `preset`'s tiny drafter (model_type gemma4_assistant)."""
    target = text_config(preset)
    text = {k: target[k] for k in FROM_TARGET if k in target}
    text.update(
        model_type="gemma4_text",
        hidden_size=ASSISTANT["hidden_size"],
        intermediate_size=ASSISTANT["intermediate_size"],
        num_attention_heads=ASSISTANT["num_attention_heads"],
        num_hidden_layers=4,
        num_kv_shared_layers=4,
        layer_types=[S, S, S, F],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
        final_logit_softcapping=None,
        tie_word_embeddings=True,
    )
    clusters = target["vocab_size"] // ASSISTANT["cluster_size"]
    return dict(
        model_type="gemma4_assistant",
        text_config=text,
        backbone_hidden_size=target["hidden_size"],
        use_ordered_embeddings=True,
        num_centroids=clusters,
        centroid_intermediate_top_k=clusters // ASSISTANT["top_fraction"],
        tie_word_embeddings=True,
    )


def _randomize(model, seed: int, post_norm: float = 1.0, embed: float = 1.0) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    lm = model.model.language_model
    for name, p in lm.named_parameters():
        shape = p.shape
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            # Attention scale is 1.0, so these set the softmax temperature: keep it smooth enough
            # that fp16 rounding does not flip which key wins.
            value = uniform(shape, 0.25, 0.75)
        elif name == "norm.weight":
            # The head reads the final norm: keep logits mostly below the softcap (tanh saturation
            # makes near-ties), and keep the massive channels from dominating every logit.
            value = uniform(shape, 0.2, 0.6)
            value[:2] *= 0.05
        elif name.endswith("norm.weight"):
            value = uniform(shape, 0.5, 2.0) * (post_norm if name.endswith(POST_NORMS) else 1.0)
            if name.endswith("post_feedforward_layernorm.weight"):
                # Two "massive activation" channels, as trained LLMs grow: the residual stream
                # reaches ~200, so sum(x^2) overflows fp16 unless RMSNorm is written for it.
                value[:2] *= 20.0
        elif name == "embed_tokens.weight":
            value = torch.randn(shape, generator=g) * 2.0 * embed
        elif name == "embed_tokens_per_layer.weight":
            value = torch.randn(shape, generator=g)
        else:  # projections: unit-scale outputs
            value = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        p.data.copy_(value)
    for layer in lm.layers:
        layer.layer_scalar.copy_(uniform(1, 0.4, 1.6))


# The vision tower: E2B's shape (clipped linears, kv heads = heads, head dim a multiple of 4, 3 x 3 pooling) at a
# width whose weights palettize (>= 2048 values, output channels in groups of 32), with a position table covering
# every image up to 280 soft tokens (840 patches a side) and 4-pixel patches, so small images make many tokens.
VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    global_head_dim=16,
    position_embedding_size=1024,
    patch_size=4,
    use_clipped_linears=True,
)
# The demo's tower: VISION with heads of 32, so that `inspect --ane` passes on the bundle the demo makes (a 16-wide
# head is a last axis of 32 bytes in fp16, half the Neural Engine's 64). Not E2B's 64: this random tower's attention
# is unscaled, and 64-wide heads sharpen it until fp16 moves the demo's text after a picture past the bounds
# (`verify --image`: min cosine 0.9927; 0.99990 at 32). The tower stays random.
VISION_OF = {"demo": dict(VISION, head_dim=32, global_head_dim=32)}
# config.json's ids of the image tokens: the tiny tokenizer's (tokenizer_files.TINY_MEDIA_TOKENS)
MEDIA_TOKEN_IDS = {i: name for i, name in zip(TINY_MEDIA_TOKENS, ("boi_token_id", "image_token_id", "eoi_token_id"))}


def _randomize_vision(model, seed: int = 0) -> None:
    """Well-conditioned random weights for the vision tower (_randomize's rules): projections to unit scale, norm
    weights far from 1, q/k norms well below 1 (attention is not scaled), a random position table, and clip bounds
    that bite (activations are ~unit scale), except the last layer's output bounds: -inf as transformers
    initialises them, and 1e30 (beyond fp16: the converter must leave both out)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    last = f"layers.{VISION['num_hidden_layers'] - 1}."
    text_width = model.config.text_config.hidden_size
    for module in (model.model.vision_tower, model.model.embed_vision):
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if "rotary_emb" in name or (last in name and "output_min" in name):
                continue
            if name == "embedding_projection.weight":
                # soft tokens twice as wide as the scaled token embeddings (~4 sqrt(H) a coordinate). A text
                # position's logits are spread by its own token's row of the tied head; an image position has no
                # such row, so narrower soft tokens leave its logits close together, where the fp16 rounding of a
                # soft token flips them (two images, min cosine at image positions: 0.9985 at 2 sqrt(H), 0.9995 here)
                value = torch.randn(t.shape, generator=g) * 4 * math.sqrt(text_width) / math.sqrt(t.shape[-1])
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                value = uniform(t.shape, 0.25, 0.75)
            elif name.endswith("norm.weight"):
                value = uniform(t.shape, 0.5, 2.0)
            elif name.endswith("position_embedding_table"):
                value = torch.randn(t.shape, generator=g)
            elif name.endswith("_min"):
                value = -uniform((), 1.0, 3.0)
            elif last in name and name.endswith("output_max"):
                value = torch.tensor(1e30)
            elif name.endswith("_max"):
                value = uniform((), 1.0, 3.0)
            else:
                value = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
            t.data.copy_(value)


# The audio tower: E2B's structure (12-frame attention blocks reaching 12 frames back, no right context, clipped
# linears, softcap 50, kernel-5 light convolution, 128 subsampling channels: transformers' projection width needs
# 128 there) at a small width, with a projection into the text model wider than the tower as E2B's (1536 > 1024).
AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    subsampling_conv_channels=[128, 8],
    conv_kernel_size=5,
    output_proj_dims=48,
    attention_chunk_size=12,
    attention_context_left=13,
    attention_context_right=0,
    use_clipped_linears=True,
)
AUDIO_PRESETS = ("e2b-audio-mini",)
# and of the audio tokens, for AUDIO_PRESETS (whose tokenizer has them: tokenizer_files.TINY_AUDIO_TOKENS)
AUDIO_TOKEN_IDS = dict(zip(("boa_token_id", "audio_token_id", "eoa_token_index"), TINY_AUDIO_TOKENS))


def _randomize_audio(model, seed: int = 0, layers: int = AUDIO["num_hidden_layers"]) -> None:
    """Well-conditioned random weights for the audio tower and its embedder (_randomize's rules): projections and
    convolutions to unit scale, norm weights far from 1, a per-dimension query scale around softplus(0), an
    output bias, and clip bounds that bite (activations are ~unit scale), except the last layer's: -inf as
    transformers initialises them, and 1e30 (beyond fp16: the converter must leave both out)."""
    import torch

    g = torch.Generator().manual_seed(seed + 2)

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    last = f"layers.{layers - 1}."
    for module in (model.model.audio_tower, model.model.embed_audio):
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith(("inv_timescales", "softcap")) or (last in name and "output_min" in name):
                continue  # derived constants, and the bound left at -inf
            if name.endswith("norm.weight"):
                value = uniform(t.shape, 0.5, 2.0)
            elif name.endswith("per_dim_scale"):
                value = torch.randn(t.shape, generator=g)
            elif name.endswith("_min"):
                value = -uniform((), 1.0, 3.0)
            elif last in name and name.endswith("output_max"):
                value = torch.tensor(1e30)
            elif name.endswith("_max"):
                value = uniform((), 1.0, 3.0)
            elif name.endswith("bias"):
                value = torch.randn(t.shape, generator=g) * 0.5
            else:  # projections and convolutions: fan-in over every axis but the first
                value = torch.randn(t.shape, generator=g) / math.sqrt(t[0].numel())
            t.data.copy_(value)


def build_model(preset: str, seed: int = 0, shape: dict | None = None):
    """A Gemma4ForConditionalGeneration with random weights, a small vision tower and an audio one: AUDIO for
    AUDIO_PRESETS, a tiny one (random initial weights, too narrow to run) for the others. `shape`: a shape no
    preset has, for the tests' matrices: {"audio": AUDIO's fields to change (a tower that runs, whatever the
    preset), "text": the text config's, "token_ids": config.json's media token ids}."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    audio = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[8, 4],
        output_proj_dims=16,
        conv_kernel_size=3,
    )
    shape = shape or {}
    runs = preset in AUDIO_PRESETS or "audio" in shape  # a tower that runs, and the audio tokens
    if runs:
        audio = {**AUDIO, **shape.get("audio", {})}

    def config(vision: dict):
        return Gemma4Config(
            text_config={**text_config(preset), **shape.get("text", {})},
            vision_config=vision,
            audio_config=audio,
            eos_token_id=[1, 106],
            tie_word_embeddings=True,
            **{
                **{name: i for i, name in MEDIA_TOKEN_IDS.items()},
                **(AUDIO_TOKEN_IDS if runs else {}),
                **shape.get("token_ids", {}),
            },
        )

    model = Gemma4ForConditionalGeneration(config(VISION)).eval()
    if preset in VISION_OF:
        # transformers draws the vision tower's initial weights before the text model's: drawn beside VISION, the
        # text model starts (and the demo trains) from the same weights whatever the tower's width; the tower's
        # own weights are _randomize_vision's
        drawn = model.state_dict()
        model = Gemma4ForConditionalGeneration(config(VISION_OF[preset])).eval()
        tower = ("model.vision_tower.", "model.embed_vision.")
        model.load_state_dict({k: v for k, v in drawn.items() if not k.startswith(tower)}, strict=False)
    with torch.no_grad():
        if preset not in TRAINED:
            _randomize(model, seed, **CONDITIONING.get(preset, {}))
        _randomize_vision(model, seed)
        if runs:
            _randomize_audio(model, seed, audio["num_hidden_layers"])
    return model


def _randomize_assistant(model, seed: int, embed: float) -> None:
    """The target's rules (see _randomize), plus: each half of the drafter's input [scaled embedding; post-norm
    hidden] is brought to unit scale by pre_projection, so a drafter fed the unscaled embedding or a zero
    hidden state is visibly wrong; centroids as wide as the tied embedding, so the top clusters are far apart."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    B = model.backbone_hidden_size
    # the target's input halves: embedding rows randn * 2 * embed, times sqrt(B); its final norm weights ~0.4
    half_scale = (2.0 * embed * math.sqrt(B), 0.4)
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("q_norm.weight"):
            value = uniform(shape, 0.25, 0.75)
        elif name == "model.norm.weight":
            value = uniform(shape, 0.2, 0.6)
        elif name.endswith("norm.weight"):
            value = uniform(shape, 0.5, 2.0)
        elif name in ("model.embed_tokens.weight", "masked_embedding.centroids.weight"):
            value = torch.randn(shape, generator=g) * 2.0
        elif name == "pre_projection.weight":
            value = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            value[:, :B] /= half_scale[0]
            value[:, B:] /= half_scale[1]
        else:
            value = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        p.data.copy_(value)
    for layer in model.model.layers:
        layer.layer_scalar.copy_(uniform(1, 0.4, 1.6))
    vocab = model.masked_embedding.token_ordering.numel()
    model.masked_embedding.token_ordering.copy_(torch.randperm(vocab, generator=g))


def build_assistant(preset: str, seed: int = 0):
    """A Gemma4AssistantForCausalLM with random weights, matched to build_model(preset)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    cfg = assistant_config(preset)
    del cfg["model_type"]
    config = Gemma4AssistantConfig(**{**cfg, "text_config": Gemma4TextConfig(**cfg["text_config"])})
    model = Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        _randomize_assistant(model, seed, CONDITIONING.get(preset, {}).get("embed", 1.0))
    # transformers' assisted generate takes the draft length from the drafter's generation config, with no default
    model.generation_config.num_assistant_tokens = 4
    model.generation_config.num_assistant_tokens_schedule = "constant"
    return model


def _write_shards(state: dict, out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(state)
    if shards <= 1:
        save_file({n: state[n].contiguous() for n in names}, out / "model.safetensors", metadata={"format": "pt"})
        return
    total = sum(state[n].numel() * state[n].element_size() for n in names)
    per, groups, size = total / shards, [[] for _ in range(shards)], 0
    for n in names:  # contiguous runs of names, cut at equal byte counts
        idx = min(int(size // per), shards - 1)
        groups[idx].append(n)
        size += state[n].numel() * state[n].element_size()
    groups = [g for g in groups if g]
    weight_map = {}
    for k, group in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n].contiguous() for n in group}, out / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


GENERATION_CONFIG = {
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
}


@contextmanager
def checkpoint_dir(out: Path, vocab_size: int, corpus: str | None = None, audio: bool = False):
    """Yield a hidden sibling of OUT to fill with weights and config.json; then add the generation
    config and tokenizer files (merges from `corpus`, else the default one; the audio tokens with `audio`) and
    rename it into place. A failure leaves no OUT."""
    with building(out) as tmp:
        yield tmp
        (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
        write_tokenizer_files(tmp, vocab_size, *([corpus] if corpus is not None else []), audio=audio)


def write_tiny(
    out: str | os.PathLike,
    preset: str = "e2b-mini",
    seed: int = 0,
    dtype: str = "fp32",
    shards: int = 1,
    force: bool = False,
    assistant: str | os.PathLike | None = None,
    train: bool = False,
    shape: dict | None = None,
) -> Path:
    """Write a tiny checkpoint directory (HF multimodal layout) atomically; return its path. With `assistant`,
    also write its drafter there (Gemma4AssistantForCausalLM, HF layout, one safetensors file). A TRAINED preset
    gets its shipped weights (trained from seed 0), or with `train` is trained now from `seed` (minutes)."""
    import torch

    if not 0 <= seed < MAX_SEED:
        raise InputError(f"--seed {seed}: must be in [0, 2**63)")
    if preset in TRAINED and seed != 0 and not train:
        raise InputError(f"--seed {seed}: the shipped {preset} weights were trained from seed 0; add --train to train")
    if train and preset not in TRAINED:
        raise InputError(f"--train: only {', '.join(sorted(TRAINED))} is trained; --preset {preset} is drawn at random")
    if dtype not in ("fp32", "bf16"):
        raise InputError(f"--dtype {dtype!r}: choose fp32 or bf16")
    if shards < 1:
        raise InputError(f"--shards {shards}: must be >= 1")
    out = Path(out)
    if assistant is not None and _overlaps(out, assistant):
        raise InputError(f"--assistant {assistant}: is, holds or lies inside OUT {out}; give it a directory of its own")
    for path in (out, assistant):
        if path is not None and Path(path).exists() and not force:
            raise InputError(f"{path}: already exists (use --force to replace it)")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = build_model(preset, seed, shape)
    vocab_size, corpus = model.config.text_config.vocab_size, None
    if preset in TRAINED:
        from . import tiny_train

        if train:
            tiny_train.train(model, vocab_size)
        else:
            tiny_train.load_trained(model)
        corpus = tiny_train.tokenizer_corpus()
    with checkpoint_dir(out, vocab_size, corpus, audio=preset in AUDIO_PRESETS or "audio" in (shape or {})) as tmp:
        _save(model, tmp, torch_dtype, shards)
    if assistant is not None:
        drafter = build_assistant(preset, seed)
        with building(assistant) as tmp:
            _save(drafter, tmp, torch_dtype, 1)
            drafter.generation_config.save_pretrained(tmp)
    return out


def _overlaps(a, b) -> bool:
    """`a` and `b` are one directory, or one lies inside the other: writing either would replace or nest in the
    other. By resolved name, since neither need exist yet, and by identity (is_within) where they do."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra in rb.parents or rb in ra.parents or is_within(a, b) or is_within(b, a)


def _save(model, tmp: Path, torch_dtype, shards: int) -> None:
    """Weights (the tied head left out, integer buffers such as token_ordering kept) and config.json."""
    state = {
        k: v.detach().to(torch_dtype) if v.is_floating_point() else v.detach()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    _write_shards(state, tmp, shards)
    model.config.dtype = str(torch_dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]  # as the Hub's configs name it
    model.config.save_pretrained(tmp)


if __name__ == "__main__":  # the demo's shipped weights (tiny_train.WEIGHTS) anew: minutes; another CPU, other bytes
    from . import tiny_train

    demo = build_model("demo")
    tiny_train.train(demo, text_config("demo")["vocab_size"])
    tiny_train.save_trained(demo)

"""Proof against the oracle: our chunks' logits vs transformers' forward pass, at every position.

transformers is imported here (and in `tiny`) only: it is the reference, never a runtime dependency.
The embedding tables reach our chunks through the int8 sidecar path, so the oracle is fed the same
dequantised tables (its LM head keeps the original, tied weights, as our chunk_3 does). How far the
int8 tables alone move the logits is reported beside it as `int8_tables_vs_original`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..bundle import layout
from ..bundle.host import dequantize_rows, quantize_rows, rope_tables
from ..bundle.plan import ChunkPlan
from ..bundle.spec import ModelSpec
from ..bundle.tables import HostTables
from ..convert.checkpoint import Checkpoint
from ..errors import InputError
from ..files import sha256_file
from ..runtime.engine import Engine
from ..runtime.images import MAX_PIXELS

FP32_MIN_COSINE = 0.9999
# fp16 runs (graph or bundle): the chunks compute in fp16 and transformers in fp32; measured on the
# tiny presets (see README) and bounded with margin.
FP16_MIN_TOP1, FP16_MIN_COSINE = 0.97, 0.999
# An fp32 top-1 miss is a near-tie, not a failure, when the reference's top logit is at most 2 x this above its
# logit for our token (with every logit within this of the reference's, no wider miss can happen): the fp32 graph's
# max |logit diff| on the tiny presets is 0.004 (README), and the tests hold it below this.
FP32_LOGIT_ERR = 1e-2


def compare(ours: np.ndarray, ref: np.ndarray, first: int = 0) -> dict:
    """Per-position agreement of two [N, V] logit arrays. Each top-1 miss is listed with the reference's gap
    between its top token and ours (`ref_gap`, >= 0; a near-tie when small), `position` counting from `first`
    (the position of row 0); `max_miss_gap` is the widest (0.0 without misses)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    cos = (ours * ref).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1) + 1e-30)
    mine, theirs = ours.argmax(-1), ref.argmax(-1)
    misses = [
        {
            "position": first + int(i),
            "ours": int(mine[i]),
            "ref": int(theirs[i]),
            "ref_gap": float(ref[i, theirs[i]] - ref[i, mine[i]]),
        }
        for i in np.flatnonzero(mine != theirs)
    ]
    return {
        "top1_agreement": float((mine == theirs).mean()),
        "min_cosine": float(cos.min()),
        "mean_cosine": float(cos.mean()),
        "max_abs_logit_diff": float(np.abs(ours - ref).max()),
        "top1_misses": misses,
        "max_miss_gap": max((m["ref_gap"] for m in misses), default=0.0),
    }


def int8_tables(ckpt: Checkpoint) -> dict:
    q, s = quantize_rows(ckpt["embed_tokens.weight"])
    pq, ps = quantize_rows(ckpt["embed_tokens_per_layer.weight"])
    return {"embed_q": q, "embed_scales": s, "ple_q": pq, "ple_scales": ps}


def host_from_checkpoint(ckpt: Checkpoint, rows: int) -> HostTables:
    spec = ckpt.spec
    return HostTables(
        **int8_tables(ckpt),
        embed_scale=spec.embed_scale,
        per_layer_embed_scale=spec.per_layer_embed_scale,
        rope=rope_tables(spec, rows),
    )


def oracle_model(ckpt: Checkpoint, tables: dict | None = None):
    """transformers' Gemma4ForCausalLM in fp32 with the checkpoint's text weights.

    With `tables`, the two embedding tables are replaced by their int8 round trip and the LM head is
    untied so it keeps the original weights, exactly what the bundle computes."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    src = ckpt.spec.source
    text = dict(src.get("text_config", src))
    text.pop("model_type", None)
    config = Gemma4TextConfig(
        **{k: v for k, v in text.items() if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
    )
    config._attn_implementation = "eager"
    model = Gemma4ForCausalLM(config)
    state = {}
    for name in model.state_dict():
        if name == "lm_head.weight" or not name.startswith("model."):
            continue
        rel = name[len("model.") :]
        if rel in ckpt:
            state[name] = torch.from_numpy(np.array(ckpt[rel]))
    head = state["model.embed_tokens.weight"].clone()
    if tables is not None:
        state["model.embed_tokens.weight"] = torch.from_numpy(
            dequantize_rows(tables["embed_q"], tables["embed_scales"], 1.0)
        )
        state["model.embed_tokens_per_layer.weight"] = torch.from_numpy(
            dequantize_rows(tables["ple_q"], tables["ple_scales"], 1.0)
        )
    missing = set(model.model.state_dict()) - {k[len("model.") :] for k in state}
    # What the checkpoint does not hold must be a non-persistent buffer transformers computes itself.
    assert all("inv_freq" in k or k.endswith("embed_scale") for k in missing), sorted(missing)
    model.load_state_dict(state, strict=False)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    return model.float().eval()


def oracle_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(ids, np.int64))[None], use_cache=False)
    return out.logits[0].float().numpy()


def random_ids(spec: ModelSpec, n: int, seed: int, avoid=()) -> np.ndarray:
    """n ids past the control tokens (so the sequence looks like text to the embedding table), none in `avoid`."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(low=min(107, spec.vocab_size - 1), high=spec.vocab_size, size=n)
    while np.isin(ids, avoid).any():
        bad = np.isin(ids, avoid)
        ids[bad] = rng.integers(low=min(107, spec.vocab_size - 1), high=spec.vocab_size, size=int(bad.sum()))
    return ids


def placeholder_ids(root) -> tuple[int, ...]:
    """The ids Gemma4ForConditionalGeneration takes for media placeholders wherever they stand (image, video,
    audio: get_placeholder_mask), embedding the pad token there. Random text must not draw one: transformers
    would read a text token as a placeholder with no media behind it, so the prompt compared would not be the
    bundle's (the text rows after it differ, cosine below 0, whatever the audio or image path does)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root)
    return tuple(getattr(config, f"{kind}_token_id") for kind in ("image", "video", "audio"))


def run_engine(engine: Engine, ids: np.ndarray, prompt_len: int, prompt_logits: str = "all") -> np.ndarray:
    """Prompt through the prefill path (logits at every prompt row; with "last", as generation runs it: KV-only
    batches where they fit, the last row's logits only), then teacher-forced decoding."""
    engine.reset()
    logits = engine.feed(ids[:prompt_len], logits=prompt_logits)
    for t in ids[prompt_len:]:
        logits += engine.feed([t], logits="last")
    return np.stack(logits)


def context_for(spec: ModelSpec, tokens: int) -> int:
    return max(32 * math.ceil(tokens / 32), 32 * math.ceil(spec.sliding_window / 32))


def verify_graph(
    src,
    tokens: int = 64,
    precision: str = "fp32",
    seed: int = 0,
    prompt_len: int | None = None,
    context: int | None = None,
    prefill_batch: int = 8,
    split: tuple[int, ...] | None = None,
) -> dict:
    import torch

    from ..convert.models.text import TorchChunk, build_chunks

    if precision not in ("fp32", "fp16"):
        raise InputError(f"--precision {precision!r}: choose fp32 or fp16")
    _check_seed(seed)
    ckpt = Checkpoint(src)
    ckpt.validate()
    spec = ckpt.spec
    plan = ChunkPlan.build(spec, context or context_for(spec, tokens), prefill_batch, split)
    if tokens < 2 or tokens > plan.context:
        raise InputError(f"--tokens {tokens}: must be in [2, context={plan.context}]")
    prompt_len = _prompt_len(prompt_len, tokens)
    ids = random_ids(spec, tokens, seed)
    host = host_from_checkpoint(ckpt, plan.context)
    dtype = torch.float32 if precision == "fp32" else torch.float16
    engine = Engine.from_chunks([TorchChunk(m) for m in build_chunks(plan, ckpt, dtype)], host, window=plan.window)
    ours = run_engine(engine, ids, prompt_len)
    tables = {k: getattr(host, k) for k in ("embed_q", "embed_scales", "ple_q", "ple_scales")}
    ref = oracle_logits(oracle_model(ckpt, tables), ids)
    orig = oracle_logits(oracle_model(ckpt), ids)
    report = {
        "mode": "graph",
        "precision": precision,
        "positions": tokens,
        "prompt_tokens": prompt_len,
        "context": plan.context,
        "window": plan.window,
        "seed": seed,
        **compare(ours, ref),
    }
    report["int8_tables_vs_original"] = compare(ref, orig)
    report["passed"] = passed(report)
    return report


def verify_bundle(
    src,
    bundle,
    tokens: int = 64,
    precision: str = "fp16",
    seed: int = 0,
    prompt_len: int | None = None,
    images: list = (),
    prompt_path: str = "all",
    max_image_pixels: int = MAX_PIXELS,
    audio: list = (),
) -> dict:
    """The saved bundle, run by the MIL executor with the runtime's scheduling and the bundle's own
    sidecars, against transformers fed the same dequantised tables. With `images` (paths, bytes or PIL
    images), the prompt holds them too, spread through its text: their soft tokens come from the bundle's
    vision model, and the oracle is Gemma4ForConditionalGeneration fed the same images through transformers'
    processor. `tokens` counts the text positions; every image adds its own, each of at most `max_image_pixels`
    (checked before ours or transformers' decodes it). With `audio` (paths or file bytes) instead, the prompt holds
    those clips: their soft tokens from the bundle's audio model, the oracle fed transformers' own log-mel features
    of the decoded samples (Gemma4AudioFeatureExtractor); one kind of media a run.

    `prompt_path="generate"` runs the prompt as generation does (KV-only prefill, which has no logits but the last
    row's) and compares from the prompt's last position on: the rows after it read the caches those batches
    wrote; the report then names the functions the prompt ran."""
    from ..bundle import open_bundle
    from ..runtime.backend import open_engine
    from ..runtime.device import Device

    if images and audio:
        raise InputError("--image and --audio: verify one kind of media a run")
    if precision not in ("fp32", "fp16"):
        raise InputError(f"--precision {precision!r}: choose fp32 or fp16")
    if prompt_path not in ("all", "generate"):
        raise InputError(f"prompt_path={prompt_path!r}: choose 'all' or 'generate'")
    if tokens < 2:  # before _prompt_len, which would blame --prompt-tokens
        raise InputError(f"--tokens {tokens}: must be >= 2")
    _check_seed(seed)
    ckpt = Checkpoint(src)
    ckpt.validate()
    opened = open_bundle(bundle, check=False)
    check_pair(ckpt, Path(bundle), opened.config.raw)  # another checkpoint's bundle: torch's size mismatch
    device = Device.of("mil", precision, "cpu_only")
    engine = open_engine(opened, device)
    encoder = _media_encoder(opened, device, images, audio, max_image_pixels)
    prompt_len = _prompt_len(prompt_len, tokens)
    avoid = (*encoder.token_ids, *placeholder_ids(ckpt.root)) if encoder else ()
    ids = random_ids(ckpt.spec, tokens, seed, avoid=avoid)
    media = images or audio
    soft = [encoder.encode(item, f"{encoder.kind} {i + 1}") for i, item in enumerate(media)]
    ids, prompt_len = _with_images(ids, prompt_len, soft, encoder)
    if not 2 <= len(ids) <= engine.context:
        raise InputError(f"--tokens {tokens}: {len(ids)} positions with the media; must be in [2, {engine.context}]")
    engine.soft_tokens = {k: row for image in soft for k, row in zip(image.keys, image.rows)}
    functions = sorted({f for f, _ in engine.plan(0, prompt_len)}) if prompt_path == "generate" else None
    ours = run_engine(engine, np.asarray(ids), prompt_len, "all" if prompt_path == "all" else "last")
    host = engine.host
    tables = {k: np.asarray(getattr(host, k)) for k in ("embed_q", "embed_scales", "ple_q", "ple_scales")}
    if images:
        ref = _oracle_with_images(ckpt, tables, ids, images, encoder)
    elif audio:
        ref = _oracle_with_audio(ckpt, tables, ids, audio, encoder)
    else:
        ref = oracle_logits(oracle_model(ckpt, tables), ids)
    first = 0 if prompt_path == "all" else prompt_len - 1  # the rows `ours` holds
    full, ref, ids = ids, ref[first:], ids[first:]
    report = {
        "mode": "bundle",
        "precision": precision,
        "positions": len(ids),
        "prompt_tokens": prompt_len,
        "context": engine.context,
        "window": engine.window,
        "seed": seed,
        **compare(ours, ref, first),
    }
    if media:  # what generation reads: the rows of text (an image or clip row's logits feed nothing)
        report[f"{encoder.kind}_tokens"] = sum(len(item.keys) for item in soft)
        text = np.asarray(ids) >= 0
        report["text_positions"] = compare(ours[text], ref[text])
    else:
        report["int8_tables_vs_original"] = compare(ref, oracle_logits(oracle_model(ckpt), full)[first:])
    if prompt_path == "generate":
        report["prompt_functions"] = functions
    if engine.crossings:  # a context ladder's rungs, climbed as the positions grew
        report["crossings"] = [c.describe() for c in engine.crossings]
    # a clip's own rows' logits are never read: its K/V are, by every text row after it, so audio prompts are
    # judged on the text rows (their logits at the clip's rows have margins under fp16's error on the tiny presets)
    report["passed"] = passed({"precision": precision, **report["text_positions"]} if audio else report)
    return report


def _media_encoder(bundle, device, images, audio, max_image_pixels: int):
    """The (opened) bundle's encoder for the run's media, on `device`; None for a text run. A bundle without the
    model the media need is refused in one line."""
    from ..runtime.encoder import open_audio_encoder, open_image_encoder

    if images:
        encoder = open_image_encoder(bundle, device, max_image_pixels)
        if encoder is None:
            raise InputError(f"--image: {bundle.root} has no vision model (converted with --no-vision, or text-only)")
        return encoder
    if audio:
        encoder = open_audio_encoder(bundle, device)
        if encoder is None:
            raise InputError(
                f"--audio: {bundle.root} has no audio model (converted with --no-audio, or without a tower)"
            )
        return encoder
    return None


def _with_images(ids: np.ndarray, prompt_len: int, soft: list, encoder) -> tuple[list[int], int]:
    """The prompt's text with each image or clip (begin, its soft-token keys, end) placed at evenly spaced points;
    the decoded text follows. Returns (ids, the new prompt length)."""
    ids = [int(t) for t in ids]
    if not soft:
        return ids, prompt_len
    boi, _, eoi = encoder.token_ids
    cuts = [round(prompt_len * (i + 1) / (len(soft) + 1)) for i in range(len(soft))]
    out, start = [], 0
    for cut, image in zip(cuts, soft):
        out += ids[start:cut] + [boi, *image.keys, eoi]
        start = cut
    return out + ids[start:], prompt_len + sum(len(image.keys) + 2 for image in soft)


def _oracle_with_images(ckpt: Checkpoint, tables: dict, ids: list[int], images: list, encoder) -> np.ndarray:
    """transformers' Gemma4ForConditionalGeneration (fp32) over the same prompt: each soft-token key becomes the
    image placeholder id, and the images arrive as transformers' own processor makes their pixels (from the files
    as its load_image opens them), so nothing of ours stands between a picture and the oracle. Embedding tables as
    oracle_model's: their int8 round trip, the head untied."""
    import torch

    model = _oracle_conditional(ckpt, tables)
    pixels = _oracle_pixels(images, encoder.entry)
    placeholder = encoder.token_ids[1]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([[t if t >= 0 else placeholder for t in ids]]),
            pixel_values=torch.from_numpy(pixels["pixel_values"]),
            image_position_ids=torch.from_numpy(pixels["image_position_ids"]).long(),
            use_cache=False,
        )
    return out.logits[0].float().numpy()


def _oracle_with_audio(ckpt: Checkpoint, tables: dict, ids: list[int], clips: list, encoder) -> np.ndarray:
    """_oracle_with_images for clips: each soft-token key becomes the audio placeholder id, and the clips arrive as
    transformers' feature extractor makes them from the decoded samples (decoded by soundfile directly, resampled
    by soxr as librosa does by default), batched as its processor batches them."""
    import torch
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    model = _oracle_conditional(ckpt, tables)
    features = Gemma4AudioFeatureExtractor()([_oracle_samples(c) for c in clips], return_tensors="pt")
    placeholder = encoder.token_ids[1]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([[t if t >= 0 else placeholder for t in ids]]),
            input_features=features["input_features"],
            input_features_mask=features["input_features_mask"],
            use_cache=False,
        )
    return out.logits[0].float().numpy()


def _oracle_samples(clip) -> np.ndarray:
    """A file's samples at 16 kHz, mono float32, as librosa.load(sr=16000) reads them."""
    import io
    import os

    import soundfile
    import soxr

    src = os.fspath(clip) if isinstance(clip, (str, os.PathLike)) else io.BytesIO(bytes(clip))
    x, rate = soundfile.read(src, dtype="float32", always_2d=True)
    x = x.mean(axis=1, dtype=np.float32)
    return x if rate == 16_000 else soxr.resample(x, rate, 16_000, quality="HQ").astype(np.float32)


def _oracle_conditional(ckpt: Checkpoint, tables: dict):
    """transformers' Gemma4ForConditionalGeneration (fp32, eager) from the checkpoint, its embedding tables as
    oracle_model's: their int8 round trip, the head untied."""
    import torch
    from transformers import Gemma4ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Loading weights" bar would sit among verify's one-line report
    try:
        model = Gemma4ForConditionalGeneration.from_pretrained(
            ckpt.root, dtype=torch.float32, attn_implementation="eager"
        )
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    lm = model.model.language_model
    head = lm.embed_tokens.weight.detach().clone()
    with torch.no_grad():
        for name, q, s in (
            ("embed_tokens", "embed_q", "embed_scales"),
            ("embed_tokens_per_layer", "ple_q", "ple_scales"),
        ):
            getattr(lm, name).weight.copy_(torch.from_numpy(dequantize_rows(tables[q], tables[s], 1.0)))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    return model.eval()


def _oracle_pixels(images: list, entry: dict) -> dict:
    """transformers' Gemma 4 image processor (PIL backend) on `images` (paths, bytes or PIL images) at the bundle's
    budget and patch geometry."""
    import io
    import os

    from PIL import Image
    from transformers.image_utils import load_image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    def opened(src):
        if isinstance(src, (str, os.PathLike)):
            return load_image(os.fspath(src))
        return Image.open(io.BytesIO(src)) if isinstance(src, (bytes, bytearray, memoryview)) else src

    processor = Gemma4ImageProcessorPil(
        max_soft_tokens=entry["image_tokens"],
        patch_size=entry["patch_size"],
        pooling_kernel_size=entry["pooling_kernel_size"],
    )
    return processor([opened(i) for i in images], return_tensors="np")


def check_pair(ckpt: Checkpoint, bundle: Path, config: dict) -> None:
    """Refuse a bundle that was not converted from a checkpoint of this shape and vocabulary: what its
    model_config.json records of the source config against the checkpoint's, and the two tokenizers."""
    spec = ckpt.spec
    expected = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "per_layer_dim": spec.per_layer_dim,
        "layer_types": list(spec.layer_types),
        "num_kv_shared_layers": spec.num_kv_shared_layers,
        "num_attention_heads": spec.num_heads,
        "embed_scale": spec.embed_scale,
        "per_layer_embed_scale": spec.per_layer_embed_scale,
        "final_logit_softcapping": spec.final_logit_softcapping,
    }
    for name, want in expected.items():
        if name not in config:
            continue  # a published bundle records fewer fields; those it has are checked
        have = config[name]
        same = math.isclose(have, want, rel_tol=1e-6) if isinstance(want, float) else have == want
        if not same:
            raise InputError(
                f"{bundle / layout.MODEL_CONFIG}: {name}={have!r} but {ckpt.root / 'config.json'} has {want!r}: "
                "the bundle is not of this checkpoint"
            )
    ours, theirs = bundle / layout.HF_TOKENIZER, ckpt.root / Path(layout.HF_TOKENIZER).name
    if ours.is_file() and theirs.is_file() and sha256_file(ours) != sha256_file(theirs):
        raise InputError(f"{ours}: differs from {theirs}: the bundle is not of this checkpoint")


def _check_seed(seed: int) -> None:
    """numpy's generator takes no negative seed, and says so without naming the flag."""
    if seed < 0:
        raise InputError(f"--seed {seed}: must be >= 0")


def _prompt_len(prompt_len, tokens):
    prompt_len = prompt_len if prompt_len is not None else max(1, tokens // 4)
    if not 1 <= prompt_len <= tokens:
        raise InputError(f"--prompt-tokens {prompt_len}: must be in [1, --tokens={tokens}]")
    return prompt_len


def passed(report: dict) -> bool:
    """fp32: every position's top-1 agrees but for near-ties (the reference's top two within 2 x FP32_LOGIT_ERR),
    cosine >= 0.9999; fp16: top-1 >= 0.97 (misses counted, ties or not), cosine >= 0.999."""
    if report["precision"] == "fp32":
        return report["max_miss_gap"] <= 2 * FP32_LOGIT_ERR and report["min_cosine"] >= FP32_MIN_COSINE
    return report["top1_agreement"] >= FP16_MIN_TOP1 and report["min_cosine"] >= FP16_MIN_COSINE

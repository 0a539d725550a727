"""`gemma-ane convert`: a Hugging Face Gemma 4 checkpoint -> the stateful 3-chunk Core ML bundle.

The driver runs the components it finds: the text model always (text.py: every chunk, then the host's tables),
the drafter when asked for (`--assistant`, assistant.py), and the vision and audio models when the checkpoint has
their towers and the options want them (vision.py, audio.py). Each component is checked before anything is
written (a bad pairing, budget or config costs nothing) and states its model_config.json entry, which
bundle.schema checks with the rules `load` applies; then each converts with the Core ML toolkit (coreml.py).
Everything is built in a temporary sibling directory and renamed into place at the end, so a failed run leaves no
OUT.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import warnings
from pathlib import Path

from .. import __version__
from ..bundle import BundleError, layout, schema
from ..bundle.check import write_manifest
from ..bundle.plan import ChunkPlan, default_kv_batches
from ..bundle.spec import ConfigError
from ..files import FileFormatError, building, is_within
from ..runtime.audit import BLOCK_WHY
from . import coreml
from .assistant import AssistantComponent
from .audio import AudioComponent
from .checkpoint import Checkpoint
from .options import ConvertError, ConvertOptions, StageTimer
from .text import convert_chunk, embeddings_beside, write_sidecars
from .vision import VisionComponent

ASSISTANT, VISION, AUDIO = schema.ASSISTANT, schema.VISION, schema.AUDIO


def resolve_source(src: str) -> Path:
    path = Path(src)
    if path.exists():
        return path
    if src.count("/") == 1 and not src.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ConvertError(
                f"{src}: not a local directory, and huggingface_hub is not installed to fetch it"
            ) from None
        try:
            return Path(snapshot_download(src, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
        except Exception as e:  # offline or unknown repo: one line, not a traceback
            raise ConvertError(
                f"{src}: could not fetch from the Hugging Face Hub ({type(e).__name__}); "
                "pass a local checkpoint directory"
            ) from None
    raise ConvertError(f"{src}: no such checkpoint directory")


def convert(
    src: str,
    out: str,
    options: ConvertOptions = ConvertOptions(),
    progress: bool = True,
    timer: StageTimer | None = None,
) -> dict:
    """Convert SRC into the bundle directory OUT; returns {stage: seconds} (`timer` also holds
    each stage's peak resident memory). OUT appears whole, or not at all."""
    options.check()
    with coreml.heap_frozen():
        return _convert(src, out, options, progress, timer or StageTimer())


def _convert(src: str, out: str, options: ConvertOptions, progress: bool, timer: StageTimer) -> dict:
    out = Path(out)
    if out.exists() and not options.force:
        raise ConvertError(f"{out}: already exists (use --force to replace it)")
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory; refusing to replace it")
    with timer("load"):
        root, ckpt, plan = open_source(src, options)
    if options.quant == "block" and options.bits != 16:
        # said before the long work, when the user can still choose: the QAT result is exact, but not on the ANE
        warnings.warn(
            f"--quant block: {BLOCK_WHY} For the Neural Engine convert with --quant lut (the default); "
            "`gemma-ane inspect OUT --ane` fails these weights",
            UserWarning,
            stacklevel=3,
        )
    compile_ = options.compile if options.compile is not None else platform.system() == "Darwin"
    try:
        if is_within(out, root) or is_within(root, out):  # replacing OUT would delete or litter the checkpoint
            raise ConvertError(f"{out}: OUT must not be, hold or lie inside the checkpoint {root}; choose another OUT")
        # before anything is written: a bad pairing, budget or model config costs nothing
        found = (
            AssistantComponent.find(options, plan),
            VisionComponent.find(options, root),
            AudioComponent.find(options, root),
        )
        components = [c for c in found if c]
        name = ckpt.spec.source.get("_name_or_path") or (src if not Path(src).exists() else root.name)
        config = model_config(root, plan, options, name, components)
        with building(out) as tmp:
            if not compile_ and options.compile is None:
                print("note: not on macOS, so chunks stay .mlpackage (Core ML compiles them on first load)")
            with embeddings_beside(ckpt, tmp) as embeddings:
                sizes = {
                    chunk.name: convert_chunk(ckpt, plan, chunk, options, tmp, timer, progress, compile_)
                    for chunk in plan.chunks
                }
                for component in components:
                    if progress:  # a one-function model has no bar of its own; at E2B's size it takes minutes
                        print(f"convert {component.name} ...", file=sys.stderr, flush=True)
                    sizes[component.name] = component.convert(tmp, timer, compile_)
                with timer("sidecars"):  # what is left of the embeddings' time, and the other tables
                    embeddings.result()
                    write_sidecars(ckpt, plan, options, tmp, config)
                (tmp / layout.MODEL_CARD).write_text(model_card(name, root, options, plan, sizes))
                if options.layout == "ours":
                    write_manifest(tmp, manifest_header(root, options, plan, components))
    except FileFormatError as e:
        raise ConvertError(str(e)) from None
    finally:
        ckpt.close()
    return timer.seconds


def model_config(root: Path, plan: ChunkPlan, options: ConvertOptions, name: str, components: list) -> dict:
    """The bundle's model_config.json, checked by the rules `load` reads it with: a checkpoint whose config would
    make a bundle `load` refuses is refused here, naming the field, before anything is converted."""
    text = schema.TextConfig.of(plan.spec, plan, options.bits, options.layout, name, weights_record(options))
    config = schema.model_config(text, **{c.name: c.config_entry() for c in components})
    try:
        schema.check_model_config(config, f"{root / 'config.json'}: the bundle's {layout.MODEL_CONFIG}")
    except BundleError as e:
        hint = next((f" ({c.without})" for c in components if f": {c.name}." in str(e)), "")
        raise ConvertError(f"{e}{hint}") from None
    return config


def weights_record(options: ConvertOptions) -> dict | None:
    """model_config.json's record of a compression other than the default (k-means LUT, nothing kept)."""
    if options.quant == "lut" and not options.keep:
        return None
    axis = {"lut": "output", "block": "input"}[options.quant]
    return schema.WeightsConfig(options.quant, options.bits, options.group_size, axis, list(options.keep)).to_json()


def manifest_header(src: Path, options: ConvertOptions, plan: ChunkPlan, components: list) -> dict:
    """What the manifest states besides its files: the converter's versions, the source, the options, the plan,
    and the one-function packages' interfaces, as the plan states the chunks' (a compiled one cannot be read
    back)."""
    import coremltools as ct
    import torch

    config_bytes = (src / "config.json").read_bytes()
    return {
        "format": "gemma-ane-bundle",
        "format_version": 1,
        "converter": {"gemma_ane": __version__, "coremltools": ct.__version__, "torch": torch.__version__},
        "source": {"path": str(src), "config_sha256": hashlib.sha256(config_bytes).hexdigest()},
        "options": {**options.record(), "split": list(plan.split)},
        "plan": plan.to_json(),
        **{c.name: c.manifest_entry() for c in components},
    }


def open_source(src: str, options: ConvertOptions) -> tuple[Path, Checkpoint, ChunkPlan]:
    """The checkpoint directory, the validated checkpoint, and the chunk plan for these options."""
    root = resolve_source(src)
    ckpt = Checkpoint(root)
    ckpt.validate()
    options.check_group_size(ckpt.spec)
    kv = options.kv_prefill_batches
    if kv is None:
        kv = default_kv_batches(ckpt.spec)
    if options.layout == "published":
        kv = ()  # the published build knows only infer and prefill_b8
    try:
        plan = ChunkPlan.build(
            ckpt.spec,
            options.contexts[-1] if options.contexts else options.context,
            options.prefill_batch,
            options.split,
            head="token_id" if options.layout == "published" else "logits",
            kv_batches=kv,
            draft_tokens=options.draft_tokens if options.assistant else 0,
            functions=options.carried,
            contexts=options.contexts,
        )
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    return root, ckpt, plan


def model_card(name: str, src: Path, options: ConvertOptions, plan: ChunkPlan, sizes: dict) -> str:
    quant = (
        "fp16 weights (no palettization)"
        if options.bits == 16
        else f"int{options.bits} block-wise linear quantization, one scale per {options.group_size} input channels"
        if options.quant == "block"
        else f"{options.bits}-bit k-means LUT palettization, one LUT per {options.group_size} output channels"
    )
    if options.keep and options.bits != 16:
        quant += f" (weights matching {', '.join(f'`{k}`' for k in options.keep)} kept fp16)"
    chunks = "\n".join(
        f"| `{c.name}` | {c.layers[0]}-{c.layers[-1]} | {', '.join(c.functions)} "
        f"| {sizes.get(c.name, 0) / 1e6:.1f} MB |"
        for c in plan.chunks
    )
    if options.assistant:
        chunks += f"\n| `assistant` | drafter | draft | {sizes.get(ASSISTANT, 0) / 1e6:.1f} MB |"
    drafter = (
        f"\n- speculative decoding: Gemma 4's drafter (`{Path(options.assistant).name}`) as `assistant`, "
        f"{plan.draft_tokens} drafts checked per `verify_b{plan.draft_tokens + 1}` call"
        if options.assistant
        else ""
    )
    if VISION in sizes:
        bits = options.vision_options.bits
        chunks += f"\n| `vision` | vision tower | encode | {sizes[VISION] / 1e6:.1f} MB |"
        drafter += f"\n- image input: the vision tower as `vision`, {options.image_tokens} soft tokens per image, " + (
            "fp16 weights" if bits == 16 else f"{bits}-bit weights"
        )
    if AUDIO in sizes:
        bits = options.audio_options.bits
        chunks += f"\n| `audio` | audio tower | encode per clip length | {sizes[AUDIO] / 1e6:.1f} MB |"
        drafter += "\n- audio input: the audio tower as `audio`, buckets of up to " + (
            ", ".join(f"{s:g}" for s in sorted(options.audio_seconds))
            + " s, "
            + ("fp16 weights" if bits == 16 else f"{bits}-bit weights")
        )
    return f"""---
license: gemma
base_model: {name}
library_name: coreml
pipeline_tag: {"any-to-any" if AUDIO in sizes else "image-text-to-text" if VISION in sizes else "text-generation"}
tags:
- coreml
- apple-neural-engine
- gemma4
- stateful
---

# {name} for the Apple Neural Engine (gemma-ane)

Converted from `{src.name}` by gemma-ane {__version__}: the stateful 3-chunk Core ML layout, with
KV caches as Core ML states and chunk_3 returning full logits (sample with any temperature, top-k,
top-p or seed).

- weights: {quant}; token and per-layer embeddings as int8 sidecars
- context {plan.context}, sliding window {plan.window}, prefill batch {plan.prefill_batch}
- iOS 18 / macOS 15 ML Programs, fp16 compute{drafter}

| chunk | layers | functions | size |
|---|---|---|---|
{chunks}

## Run it

```bash
pip install gemma-ane
gemma-ane inspect .          # functions, I/O, states, costs; sizes and sha256 against {layout.MANIFEST}
```

`{layout.MANIFEST}` lists every file with its size and sha256, the converter versions and the options
used.
"""

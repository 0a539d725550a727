"""The vision model's conversion (the tower itself: models/vision.py): the checkpoint's vision spec, the `encode`
package and its position-table sidecar, and its model_config.json entry."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..bundle import layout, schema
from ..bundle.spec import VisionSpec
from ..bundle.tables import save_npy
from ..files import tree_size
from ..runtime.images import SOFT_TOKEN_BUDGETS
from . import coreml
from .checkpoint import Checkpoint
from .models.load import checked_tensor
from .models.vision import FUNCTION, encode_io, load_vision
from .options import ConvertError, ConvertOptions


def read_spec(root: str | Path) -> VisionSpec | None:
    return VisionSpec.from_config(json.loads((Path(root) / "config.json").read_text()))


# -- the checkpoint and the conversion ---------------------------------------------------------------------------


def open_vision(root: str | Path, image_tokens: int) -> tuple[VisionSpec, Checkpoint]:
    """The vision spec and the checkpoint (names from the top: `model.vision_tower.*`), with the budget checked."""
    if image_tokens not in SOFT_TOKEN_BUDGETS:
        raise ConvertError(f"--image-tokens {image_tokens}: choose one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}")
    try:
        spec = read_spec(root)
        ckpt = Checkpoint(root) if spec else None
    except (OSError, ValueError) as e:  # ValueError: a bad config.json, CheckpointError, ConfigError
        raise ConvertError(str(e).splitlines()[0]) from None
    if spec is None:
        raise ConvertError(f"{root}: config.json has no vision_config (no vision tower to convert)")
    ckpt.prefix = ""
    need = spec.max_position(image_tokens)
    if need > spec.position_embedding_size:
        ckpt.close()
        raise ConvertError(
            f"--image-tokens {image_tokens}: an image can be {need} patches wide, but the position table has "
            f"{spec.position_embedding_size} rows"
        )
    return spec, ckpt


def position_table(ckpt: Checkpoint, spec: VisionSpec, image_tokens: int) -> np.ndarray:
    """The rows of the position table this budget can reach, as the host's sidecar holds them (fp16)."""
    name = "model.vision_tower.patch_embedder.position_embedding_table"
    table = checked_tensor(ckpt, name, (2, spec.position_embedding_size, spec.hidden_size), fp16_range=True)
    return table[:, : spec.max_position(image_tokens)].astype(np.float16)


def config_entry(spec: VisionSpec, image_tokens: int) -> schema.VisionConfig:
    """model_config.json's `vision` (bundle.schema's): what the host needs to preprocess an image and build
    `encode`'s inputs."""
    return schema.VisionConfig.of(spec, image_tokens)


# -- conversion -------------------------------------------------------------------------------------------------


def convert_vision(
    ckpt_root: str | Path,
    options: ConvertOptions,
    out_dir: Path,
    timer,
    image_tokens: int = 280,
    compile_: bool = False,
) -> Path:
    """OUT/vision.mlpackage (function `encode`, fp16 compute, palettized at options.bits) and its position-table
    sidecar; returns the package's path (the .mlmodelc with compile_)."""
    out = Path(out_dir)
    with timer("load"):
        spec, ckpt = open_vision(ckpt_root, image_tokens)
    try:
        with timer("load"):
            model = load_vision(ckpt, spec, image_tokens, fp16_range=True)
        with timer("sidecars"):
            save_npy(out / layout.VISION_POSITION_TABLE, position_table(ckpt, spec, image_tokens))
    finally:
        ckpt.close()
    prog = coreml.trace_function(model, model.chunk, FUNCTION, timer)
    del model  # the program holds its own fp16 weights now
    return coreml.save_one_function(prog, FUNCTION, "vision", options, out, timer, compile_)


@dataclass
class VisionComponent:
    """The vision tower, when the checkpoint has one and the options want it (the published layout is
    text-only)."""

    root: Path
    options: ConvertOptions
    spec: VisionSpec
    name = schema.VISION
    without = "--no-vision converts text only"

    @classmethod
    def find(cls, options: ConvertOptions, root: Path) -> VisionComponent | None:
        if not options.vision or options.layout == "published":
            return None
        try:
            found = read_spec(root)
        except (OSError, ValueError) as e:
            raise ConvertError(f"{root / 'config.json'}: {e}") from None
        if found is None:
            return None
        spec, ckpt = open_vision(root, options.image_tokens)
        has_tower = "model.vision_tower.patch_embedder.input_proj.weight" in ckpt
        ckpt.close()
        if not has_tower:  # a text-only export that kept the multimodal config.json
            print(f"note: {root}: config.json states a vision tower but the weights hold none; converting text only")
            return None
        return cls(root, options, spec)

    def config_entry(self) -> dict:
        return config_entry(self.spec, self.options.image_tokens)

    def manifest_entry(self) -> dict:
        return encode_io(self.spec, self.options.image_tokens).to_json()

    def convert(self, out: Path, timer, compile_: bool) -> int:
        tokens, vision = self.options.image_tokens, self.options.vision_options
        return tree_size(convert_vision(self.root, vision, out, timer, tokens, compile_))

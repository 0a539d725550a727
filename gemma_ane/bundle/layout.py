"""Where everything lives in a bundle directory (CONTRACT §2): the one place a bundle's file names are spelled.
The converter writes these paths and the runtime reads them; neither spells a name of its own."""

from __future__ import annotations

from pathlib import Path

from .errors import BundleError

MANIFEST = "manifest.json"
MODEL_CONFIG = "model_config.json"
MODEL_CARD = "README.md"
HF_DIR = "hf_model"  # the checkpoint's own config, generation config and tokenizer files
HF_CONFIG = f"{HF_DIR}/config.json"
HF_GENERATION_CONFIG = f"{HF_DIR}/generation_config.json"
HF_TOKENIZER = f"{HF_DIR}/tokenizer.json"
HF_FILES = (  # copied from the checkpoint into HF_DIR, when it has them
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
)

# the host's tables: int8 rows with one fp16 scale per row, the PLE projection and its norm, RoPE rows
EMBED_Q8 = "embed_tokens_q8.bin"
EMBED_SCALES = "embed_tokens_scales.bin"
PLE_Q8 = "embed_tokens_per_layer_q8.bin"
PLE_SCALES = "embed_tokens_per_layer_scales.bin"
PLE_PROJECTION = "per_layer_projection.bin"
PLE_NORM = "per_layer_norm_weight.bin"
ROPE_SHORT = {"sliding_attention": "sliding", "full_attention": "full"}  # layer type -> its tables' suffix

# the drafter's centroid head, in cluster order
ASSISTANT_EMBED_Q8 = "assistant_embed_q8.bin"
ASSISTANT_EMBED_SCALES = "assistant_embed_scales.bin"
ASSISTANT_TOKEN_ORDERING = "assistant_token_ordering.bin"
ASSISTANT_SIDECARS = (ASSISTANT_EMBED_Q8, ASSISTANT_EMBED_SCALES, ASSISTANT_TOKEN_ORDERING)

VISION_POSITION_TABLE = "vision_position_embeddings.npy"  # (2, budget * k, hidden) fp16: x rows, then y rows

# files a bundle cannot run without (the chunks are found by chunk_paths)
REQUIRED = (MODEL_CONFIG, EMBED_Q8, EMBED_SCALES, PLE_Q8, PLE_SCALES, HF_TOKENIZER)

# beside the chunks: name -> its function (the audio model's holds one function per bucket of clip length, `encode`
# the largest: schema.audio_function)
ONE_FUNCTION_MODELS = {"assistant": "draft", "vision": "encode", "audio": "encode"}
PACKAGE, COMPILED = ".mlpackage", ".mlmodelc"
MAX_CHUNKS = 9


def rope_table(kind: str, layer_type: str) -> str:
    """`kind` ("cos" or "sin") of `layer_type`'s RoPE rows: cos_sliding.npy, sin_full.npy, ..."""
    return f"{kind}_{ROPE_SHORT[layer_type]}.npy"


def chunk_name(index: int) -> str:
    """The name of chunk `index` (0-based): chunk_1, chunk_2, ..."""
    return f"chunk_{index + 1}"


def package_path(root: Path, name: str) -> Path:
    """ROOT/NAME.mlpackage, as the converter writes it before any compilation."""
    return Path(root) / f"{name}{PACKAGE}"


def compiled_path(root: Path, name: str) -> Path:
    return Path(root) / f"{name}{COMPILED}"


def model_paths(root: Path, name: str) -> list[Path]:
    """The model NAME's package or compiled model, whichever ROOT holds (package first)."""
    return [p for p in (package_path(root, name), compiled_path(root, name)) if p.exists()]


def model_name(path: Path) -> str:
    """chunk_1.mlpackage -> chunk_1."""
    return Path(path).name.split(".")[0]


def not_a_checkpoint(root: Path) -> None:
    """A common slip, named as such: a Hugging Face checkpoint (config.json and safetensors weights at its top, no
    model_config.json) given where its bundle is meant."""
    if (root / "config.json").is_file() and not (root / MODEL_CONFIG).exists() and any(root.glob("*.safetensors")):
        raise BundleError(f"{root}: a Hugging Face checkpoint, not a bundle: run `gemma-ane convert {root} OUT` first")


def chunk_paths(root: Path) -> list[Path]:
    """chunk_1..chunk_N, as .mlpackage or compiled .mlmodelc."""
    root = Path(root)
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    not_a_checkpoint(root)
    found = []
    for i in range(MAX_CHUNKS):
        paths = model_paths(root, chunk_name(i))
        if not paths:
            break
        found.append(paths[0])
    if not found:
        raise BundleError(f"{root}: no {chunk_name(0)}{PACKAGE} or {chunk_name(0)}{COMPILED}")
    return found


def bundle_files(root: Path) -> list[Path]:
    """Every file of a bundle but its manifest, sorted: chunk packages, sidecars, hf_model/. Hidden files (Finder's
    .DS_Store) are left out: nothing reads them. The manifest lists exactly these."""
    root = Path(root)
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p != root / MANIFEST and not any(s.startswith(".") for s in p.relative_to(root).parts)
    )

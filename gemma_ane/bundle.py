"""A converted bundle on disk: its files and manifest, `gemma-ane inspect`, its sidecars, and
`open_engine` (the one way a bundle is opened to run: runtime, verify and benchmarks).

Everything here is read from the files themselves (the model descriptions and programs), so it
describes bundles converted elsewhere too; the manifest is only trusted for sizes and hashes.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from .engine import Engine, HostTables
from .files import FileFormatError, read_json, sha256_file, tree_size
from .host import rope_tables, rotated_pairs
from .images import SOFT_TOKEN_BUDGETS
from .package import Package, PackageError, macs, weight_bytes
from .spec import FULL, MAX_DRAFT_TOKENS, SLIDING, ModelSpec


class BundleError(ValueError):
    """A bundle that is missing or damaged; the message names the file."""


def chunk_paths(root: Path) -> list[Path]:
    """chunk_1..chunk_N, as .mlpackage or compiled .mlmodelc."""
    root = Path(root)
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    found = []
    for i in range(1, 10):
        for suffix in (".mlpackage", ".mlmodelc"):
            p = root / f"chunk_{i}{suffix}"
            if p.exists():
                found.append(p)
                break
        else:
            break
    if not found:
        raise BundleError(f"{root}: no chunk_1.mlpackage or chunk_1.mlmodelc")
    return found


def check_manifest(root: Path, sha256: bool = True) -> list[str]:
    """Problems found against manifest.json, one line each (empty: the bundle verifies). Sizes
    always; sha256=True verifies: hashes too, and that the manifest lists every file the bundle
    holds (an unlisted file would go unchecked)."""
    root = Path(root)
    path = root / "manifest.json"
    if not path.is_file():
        return [f"{path}: missing"]
    try:
        files = read_json(path)["files"]
        items = list(files.items())
    except (FileFormatError, KeyError, TypeError, AttributeError) as e:
        return [f"{path}: unreadable ({e})"]
    problems = []
    for rel, entry in items:
        p = root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            problems.append(f"{path}: refuses file entry {rel!r} outside the bundle")
            continue
        size = entry.get("size") if isinstance(entry, dict) else None
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != size:
            problems.append(f"{p}: size {p.stat().st_size}, manifest says {size}")
        elif sha256 and sha256_file(p) != entry.get("sha256"):
            problems.append(f"{p}: sha256 differs from the manifest")
    if sha256:
        listed = {Path(rel) for rel, _ in items}
        problems += [
            f"{p}: not listed in the manifest" for p in _bundle_files(root) if p.relative_to(root) not in listed
        ]
    return problems


def _bundle_files(root: Path) -> list[Path]:
    """Every file of a bundle but its manifest: chunk packages, sidecars, hf_model/. Hidden files
    (Finder's .DS_Store) are left out: nothing reads them."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p != root / "manifest.json" and not any(s.startswith(".") for s in p.relative_to(root).parts)
    )


def prompt_paths(chunks: list[dict]) -> dict:
    """Cost per prompt token of each way a prompt can be processed: chunk_1 + chunk_2 run the
    prompt (chunk_3 only for its last token). Weight bytes per prompt token = bytes of the
    weights the functions read, divided by the tokens per call."""
    stateful = [c for c in chunks if c["functions"].get("infer", {}).get("inputs", {}).get("current_pos")]
    paths = {}
    for fname in stateful[0]["functions"] if stateful else []:
        if fname.startswith("verify_b"):
            continue  # decoding's speculative step, never a prompt's (CONTRACT §3)
        fns = [c["functions"][fname] for c in stateful if fname in c["functions"]]
        if any(f["macs_per_token"] is None for f in fns):
            continue  # a compiled chunk: costs unknown
        T = fns[0]["tokens_per_call"]
        paths[fname] = {
            "tokens_per_call": T,
            "macs_per_prompt_token": sum(f["macs_per_token"] for f in fns),
            "weight_bytes_per_prompt_token": sum(f["weight_bytes"] for f in fns) / T,
        }
    return paths


ONE_FUNCTION_MODELS = {"assistant": "draft", "vision": "encode"}  # beside the chunks: name -> its function


def inspect_bundle(root: str | Path, sha256: bool = True) -> dict:
    root = Path(root)
    manifest = read_json(root / "manifest.json") if (root / "manifest.json").is_file() else None
    planned = {c["name"]: c for c in (manifest or {}).get("plan", {}).get("chunks", [])}
    chunks = []
    for path in chunk_paths(root):
        entry = _inspect_package(path) if path.suffix == ".mlpackage" else _inspect_compiled(path)
        if entry["name"] in planned:
            entry["layers"] = planned[entry["name"]]["layers"]
        chunks.append(entry)
    report = {"bundle": str(root), "chunks": chunks, "prompt_paths": prompt_paths(chunks)}
    # the one-function models, costed as the chunks' functions: what a draft step or an image pays
    for name, function in ONE_FUNCTION_MODELS.items():
        path = next((p for p in (root / f"{name}.mlpackage", root / f"{name}.mlmodelc") if p.exists()), None)
        if path is not None:
            report[name] = _inspect_package(path) if path.suffix == ".mlpackage" else _inspect_compiled(path, function)
    problems = check_manifest(root, sha256) if manifest is not None else ["manifest.json: missing"]
    report["manifest"] = {"present": manifest is not None, "verified": not problems, "problems": problems}
    return report


def _tokens_per_call(io: dict) -> int:
    return io["inputs"]["hidden_states"]["shape"][1] if "hidden_states" in io["inputs"] else 1


def _inspect_package(path: Path) -> dict:
    """Interfaces, weight bytes and MACs, read off the saved program."""
    pkg = Package.open(path)
    program = pkg.program()
    entry = {"name": path.name.split(".")[0], "path": path.name, "size_bytes": pkg.size_bytes(), "functions": {}}
    for fname in pkg.function_names:
        io = pkg.interface(fname)
        entry.setdefault("states", io["states"])
        fn, T = program.functions[fname], _tokens_per_call(io)
        entry["functions"][fname] = {
            "inputs": io["inputs"],
            "outputs": io["outputs"],
            "tokens_per_call": T,
            "weight_bytes": weight_bytes(fn),
            "macs_per_token": macs(fn) // T,
        }
    return entry


def _inspect_compiled(path: Path, function: str | None = None) -> dict:
    """A compiled chunk (or one-function model) cannot be read back: its interfaces as the bundle states them, no
    costs."""
    from .backend import one_function_interfaces, read_interfaces  # here: backend.py imports this module

    name = path.name.split(".")[0]
    interfaces = one_function_interfaces(path, name, function) if function else read_interfaces(path)
    entry = {"name": name, "path": path.name, "size_bytes": tree_size(path), "functions": {}}
    entry["states"] = next(iter(interfaces.values()))["states"]
    for fname, io in interfaces.items():
        entry["functions"][fname] = {
            "inputs": io["inputs"],
            "outputs": io["outputs"],
            "tokens_per_call": _tokens_per_call(io),
            "weight_bytes": None,  # unknown: the program is compiled
            "macs_per_token": None,
        }
    return entry


# -- the host's tables: int8 sidecars read by row, RoPE tables ---------------------------------


def _check_size(path: Path, dtype, shape) -> None:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not path.is_file():
        raise BundleError(f"{path}: missing")
    if path.stat().st_size != expected:
        raise BundleError(
            f"{path}: {path.stat().st_size} bytes, expected {expected} for {tuple(shape)} {np.dtype(dtype).name}"
        )


class RowTable:
    """A [rows, cols] int8 sidecar read a row at a time with pread.

    Not mmap: on Linux a fault on a file mapping brings in a whole large folio (~2 MB here) per
    touched row, so resident memory would climb toward the 2.3 GB table as tokens vary. pread
    copies exactly the bytes of the rows a token uses, and nothing else stays resident."""

    def __init__(self, path: Path, dtype, shape):
        _check_size(path, dtype, shape)
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.row_bytes = self.shape[1] * self.dtype.itemsize
        self.fd = os.open(path, os.O_RDONLY)

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.atleast_1d(np.asarray(ids, np.int64))
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise BundleError(f"{self.path}: token id out of range [0, {self.shape[0]})")
        data = b"".join(os.pread(self.fd, self.row_bytes, int(i) * self.row_bytes) for i in ids)
        return np.frombuffer(data, self.dtype).reshape(len(ids), self.shape[1])

    def __array__(self, dtype=None, copy=None):  # the whole table (verification only)
        a = np.fromfile(self.path, self.dtype).reshape(self.shape)
        return a if dtype is None else a.astype(dtype)

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


def _small(path: Path, dtype, shape) -> np.ndarray:
    _check_size(path, dtype, shape)
    return np.fromfile(path, dtype).reshape(shape)


def _load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise BundleError(f"{path}: missing")
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise BundleError(f"{path}: not a valid .npy file ({e})") from None


def load_host(root: Path, config: dict) -> HostTables:
    """int8 tables read row by row (only the rows a token uses), their scales, RoPE tables."""
    root = Path(root)
    V, H = config["vocab_size"], config["hidden_size"]
    PL = config["num_hidden_layers"] * config["per_layer_dim"]
    rope = {}
    for layer_type, short in (("sliding_attention", "sliding"), ("full_attention", "full")):
        if (root / f"cos_{short}.npy").exists() or layer_type in config.get("layer_types", []):
            rope[layer_type] = (_load_npy(root / f"cos_{short}.npy"), _load_npy(root / f"sin_{short}.npy"))
    return HostTables(
        embed_q=RowTable(root / "embed_tokens_q8.bin", np.int8, (V, H)),
        embed_scales=_small(root / "embed_tokens_scales.bin", "<f2", (V,)),
        ple_q=RowTable(root / "embed_tokens_per_layer_q8.bin", np.int8, (V, PL)),
        ple_scales=_small(root / "embed_tokens_per_layer_scales.bin", "<f2", (V,)),
        embed_scale=float(config["embed_scale"]),
        per_layer_embed_scale=float(config["per_layer_embed_scale"]),
        rope=rope,
    )


def _check_rope(root: Path, host: HostTables, context: int, exact: bool) -> None:
    """The published full-layer tables rotate all pairs, transformers only partial_rotary_factor
    of them (CONTRACT §4): detect it, warn once, and use tables computed from the config."""
    cfg_path = root / "hf_model" / "config.json"
    if not cfg_path.is_file():
        return
    spec = ModelSpec.from_pretrained(cfg_path)
    for layer_type, (cos, sin) in list(host.rope.items()):
        allowed = spec.rope[layer_type].rotated_pairs
        if cos.shape[0] < context:
            raise BundleError(
                f"{root}: RoPE table for {layer_type} has {cos.shape[0]} rows, fewer than the context {context}"
            )
        probe = [1, min(1000, cos.shape[0] - 1)]  # row 0 is position 0: nothing rotates there
        found = rotated_pairs(np.asarray(cos[probe]), np.asarray(sin[probe]))
        if found > allowed:
            warnings.warn(
                f"{root}: {layer_type} RoPE tables rotate {found} pairs but the config allows {allowed} "
                f"(partial_rotary_factor); "
                + ("using exact tables computed from the config" if exact else "using them as they are"),
                stacklevel=4,
            )
            if exact:
                host.rope[layer_type] = rope_tables(spec, context)[layer_type]


# -- opening a bundle -----------------------------------------------------------------------------

REQUIRED = (
    "model_config.json",
    "embed_tokens_q8.bin",
    "embed_tokens_scales.bin",
    "embed_tokens_per_layer_q8.bin",
    "embed_tokens_per_layer_scales.bin",
    "hf_model/tokenizer.json",
)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(v) -> bool:
    return _integer(v) and v > 0


def _token(v) -> bool:
    return _integer(v) and v >= 0


def _scale(v) -> bool:  # the host scales the int8 tables in fp32
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= np.finfo(np.float32).max


# CONTRACT §2: the model_config.json fields the runtime reads: name -> (required, what it must be, test)
MODEL_CONFIG = {
    "vocab_size": (True, "a positive integer", _positive),
    "hidden_size": (True, "a positive integer", _positive),
    "num_hidden_layers": (True, "a positive integer", _positive),
    "per_layer_dim": (True, "a positive integer", _positive),
    "embed_scale": (True, "a positive fp32 number", _scale),
    "per_layer_embed_scale": (True, "a positive fp32 number", _scale),
    "bos_token_id": (False, "a token id", _token),
    "eos_token_id": (False, "a token id", _token),
    "layer_types": (False, "a list of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)),
    "sliding_window": (False, "a positive integer", _positive),  # the ring may be wider (spec.ring_slots)
    "context_length": (False, "a positive integer", _positive),  # these four: the published plan's
    "prefill_batch": (False, "a positive integer", _positive),
    "split": (False, "two layer indices", lambda v: isinstance(v, list) and len(v) == 2 and all(map(_positive, v))),
    "head": (False, '"logits" or "token_id"', lambda v: v in ("logits", "token_id")),
}

# model_config.json's `assistant` (a bundle with a drafter, assistant.config_entry): name -> (what it must be, test
# of the value given the entry so far and the whole config); every field is required
ASSISTANT_CONFIG = {
    "draft_tokens": (
        f"an integer in [1, {MAX_DRAFT_TOKENS}]",
        lambda v, a, c: _integer(v) and 1 <= v <= MAX_DRAFT_TOKENS,
    ),
    "hidden_size": ("a positive integer", lambda v, a, c: _positive(v)),
    "backbone_hidden_size": ("the hidden_size", lambda v, a, c: _positive(v) and v == c["hidden_size"]),
    "num_centroids": (
        "0 (a plain head) or a divisor of vocab_size",
        lambda v, a, c: _integer(v) and (v == 0 or v > 0 and c["vocab_size"] % v == 0),
    ),
    "centroid_top_k": (
        "an integer in [1, num_centroids] (0 without centroids)",
        lambda v, a, c: _integer(v) and (1 <= v <= a["num_centroids"] if a["num_centroids"] else v == 0),
    ),
    "producers": (
        "layer indices by layer type, full_attention among them",
        lambda v, a, c: (
            isinstance(v, dict)
            and FULL in v
            and all(t in (SLIDING, FULL) and _token(i) and i < c["num_hidden_layers"] for t, i in v.items())
        ),
    ),
}
# model_config.json's `vision` (a bundle with a vision model, vision.config_entry), as ASSISTANT_CONFIG
VISION_CONFIG = {
    "image_tokens": (
        "one of " + ", ".join(map(str, SOFT_TOKEN_BUDGETS)),
        lambda v, e, c: _integer(v) and v in SOFT_TOKEN_BUDGETS,
    ),
    "patch_size": ("a positive integer", lambda v, e, c: _positive(v)),
    "pooling_kernel_size": ("a positive integer", lambda v, e, c: _positive(v)),
    "head_dim": ("a positive multiple of 4", lambda v, e, c: _positive(v) and v % 4 == 0),
    "rope_theta": ("a positive fp32 number", lambda v, e, c: _scale(v)),
    "position_table": (
        "a file name in the bundle",
        lambda v, e, c: isinstance(v, str) and v == Path(v).name and v not in ("", ".", ".."),
    ),
    **{
        name: ("a token id below vocab_size", lambda v, e, c: _token(v) and v < c["vocab_size"])
        for name in ("boi_token_id", "image_token_id", "eoi_token_id")
    },
}
ASSISTANT_SIDECARS = ("assistant_embed_q8.bin", "assistant_embed_scales.bin", "assistant_token_ordering.bin")


def read_model_config(root: Path) -> dict:
    """model_config.json, checked field by field: a BundleError naming the field and its value."""
    path = Path(root) / "model_config.json"
    if not path.is_file():
        raise BundleError(f"{path}: missing")
    try:
        config = read_json(path)
    except FileFormatError as e:
        raise BundleError(str(e)) from None
    if not isinstance(config, dict):
        raise BundleError(f"{path}: expected a JSON object, found {type(config).__name__}")
    for name, (required, what, ok) in MODEL_CONFIG.items():
        if name not in config:
            if required:
                raise BundleError(f"{path}: {name}: missing")
        elif not ok(config[name]) or name.endswith("_token_id") and config[name] >= config["vocab_size"]:
            value = repr(config[name])
            value = value if len(value) <= 40 else value[:37] + "..."
            what += f" below vocab_size {config['vocab_size']}" if name.endswith("_token_id") else ""
            raise BundleError(f"{path}: {name}={value}: expected {what}")
    for key, fields in (("assistant", ASSISTANT_CONFIG), ("vision", VISION_CONFIG)):
        if key in config:
            _check_entry(path, config, key, fields)
    if "assistant" in config and SLIDING in config["assistant"]["producers"] and "sliding_window" not in config:
        raise BundleError(f"{path}: sliding_window: missing (the assistant's sliding layers need it)")
    return config


def _check_entry(path: Path, config: dict, key: str, fields: dict) -> None:
    """config[key], an object whose every field is required and must pass its test."""
    entry = config[key]
    if not isinstance(entry, dict):
        raise BundleError(f"{path}: {key}: expected a JSON object, found {type(entry).__name__}")
    for name, (what, ok) in fields.items():
        if name not in entry:
            raise BundleError(f"{path}: {key}.{name}: missing")
        if not ok(entry[name], entry, config):
            value = repr(entry[name])
            raise BundleError(
                f"{path}: {key}.{name}={value if len(value) <= 40 else value[:37] + '...'}: expected {what}"
            )


def check_bundle(root: Path, sha256: bool = True) -> list[str]:
    """Every problem with a bundle, one line each: files missing or damaged, a model_config.json
    the runtime cannot use. sha256=True verifies (`check`, `load(verify=True)`): hashes, every file
    listed in the manifest, and a manifest at all, which only the published layout may lack
    (`is_published`); sha256=False checks what `load` needs: presence and the manifest's sizes."""
    root = Path(root)
    problems = [f"{root / f}: missing" for f in REQUIRED if not (root / f).is_file()]
    if (root / "manifest.json").exists():
        problems += check_manifest(root, sha256)
    for check in (chunk_paths, read_model_config):
        try:
            check(root)
        except BundleError as e:
            problems.append(str(e))
    problems += _one_function_problems(root)
    if sha256 and not (root / "manifest.json").exists() and not problems:
        try:
            if not is_published(root):
                missing = "missing (gemma-ane convert writes one; without it nothing can be verified)"
                problems.append(f"{root / 'manifest.json'}: {missing}")
        except BundleError as e:
            problems.append(str(e))
    return list(dict.fromkeys(problems))  # a file both required and in the manifest: report it once


def _one_function_problems(root: Path) -> list[str]:
    """A bundle whose model_config.json states an assistant or a vision model must hold its package and its
    sidecars (the drafter's head, the vision model's position table)."""
    try:
        config = read_model_config(root)
    except BundleError:
        return []  # check_bundle has reported it
    missing = [
        f"{name}.mlpackage"
        for name in ONE_FUNCTION_MODELS
        if name in config and not any((root / f"{name}{s}").exists() for s in (".mlpackage", ".mlmodelc"))
    ]
    if config.get("assistant", {}).get("num_centroids"):
        missing += [f for f in ASSISTANT_SIDECARS if not (root / f).is_file()]
    if "vision" in config and not (root / config["vision"]["position_table"]).is_file():
        missing.append(config["vision"]["position_table"])
    return [f"{root / f}: missing" for f in missing]  # as check_manifest words it: reported once


def is_published(root: Path) -> bool:
    """The published layout (CONTRACT §2, §4): no manifest, and chunk_3 is the argmax head. Our
    converter's default layout always writes a manifest and a logits head, so a bundle of ours whose
    manifest is gone is not mistaken for it."""
    root = Path(root)
    if (root / "manifest.json").exists():
        return False
    last = chunk_paths(root)[-1]
    if last.suffix == ".mlmodelc":  # a compiled chunk states nothing: the model config says (as published_plan)
        return read_model_config(root).get("head", "token_id") == "token_id"
    try:
        return "logits" not in Package.open(last).interface("infer")["outputs"]
    except PackageError as e:
        raise BundleError(str(e)) from None


def open_engine(
    root: str | Path,
    backend: str = "mil",
    precision: str = "fp16",
    compute_units: str = "cpu_and_ne",
    logits_dtype=np.float32,
    exact_rope: bool = True,
) -> Engine:
    """The step driver over a bundle: its chunks run by `backend` ("mil", "coreml" or "auto"), its
    sidecars read by the host. Everything about the chunks (context, window, prompt paths, head) is
    read off the models themselves, so bundles converted elsewhere open too."""
    from .backend import open_chunks, pick_backend

    root = Path(root)
    config = read_model_config(root)
    _check_norm_sidecar(root, config)
    chunks = open_chunks(chunk_paths(root), pick_backend(backend), precision, compute_units)
    if len(chunks) != 3:
        raise BundleError(f"{root}: expected chunk_1..chunk_3, found {len(chunks)} chunks")
    # a ring padded for verify batches is wider than the window, which only the config states
    engine = Engine.from_chunks(chunks, load_host(root, config), logits_dtype, window=config.get("sliding_window"))
    _check_rope(root, engine.host, engine.context, exact_rope)
    return engine


def _check_norm_sidecar(root: Path, config: dict) -> None:
    norm, P = root / "per_layer_norm_weight.bin", config["per_layer_dim"]
    if norm.is_file() and norm.stat().st_size not in (2 * P, 4 * P):
        # published builds store it as fp16 or fp32: tell the two apart by size, refuse anything else
        raise BundleError(f"{norm}: {norm.stat().st_size} bytes, expected {P} fp16 or fp32 values")

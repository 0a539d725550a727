"""Every model's interfaces (CONTRACT §2-3): read off a package's own model description, or, for a compiled
.mlmodelc (whose program cannot be read back), from the metadata.json Apple's compiler writes into it; a compiled
model without one, as its bundle states it: the chunk plan recorded in manifest.json, the plan the published
layout's configs imply, a one-function model's manifest entry."""

from __future__ import annotations

import json
from pathlib import Path

from ..files import FileFormatError, read_json
from ..mil.package import Package
from . import layout
from .errors import BundleError
from .plan import ChunkPlan
from .spec import ConfigError, ModelSpec

# An interface: {"inputs": {...}, "outputs": {...}, "states": {...}}, each name -> {"shape": [..], "dtype": "float16"}
Interface = dict


METADATA = "metadata.json"  # inside a .mlmodelc: what Apple's compiler states of the model's functions
MAX_METADATA_BYTES = 16 << 20  # a chunk's is a few kB (every function's features and op histogram)
# metadata.json's dataType -> the numpy dtype the model descriptions of packages give
DATA_TYPES = {"Float16": "float16", "Float32": "float32", "Double": "float64", "Int32": "int32"}
SCHEMAS = {"inputs": "inputSchema", "outputs": "outputSchema", "states": "stateSchema"}


def read_interfaces(path: Path) -> dict[str, Interface]:
    """Every function's interface, default first, from the package's own model description. A
    compiled .mlmodelc: from its metadata.json, checked against model_config.json; without one, from
    what the bundle states."""
    path = Path(path)
    if path.suffix == layout.COMPILED:
        if not (path / METADATA).is_file():
            return stated_interfaces(path)
        interfaces = metadata_interfaces(path)
        check_against_config(path, interfaces)
        return interfaces
    package = Package.open(path)
    names = [package.default_function] + [f for f in package.function_names if f != package.default_function]
    return {f: package.interface(f) for f in names}


def metadata_interfaces(path: Path, single: str = "main") -> dict[str, Interface]:
    """A compiled model's interfaces as its metadata.json states them: a list of one model entry whose
    `functions` (a multifunction model) each carry `inputSchema`, `outputSchema` and `stateSchema`, the default
    (`defaultFunctionName`) first; a one-function model states them at the top, as its function `single`."""
    file = path / METADATA
    if file.stat().st_size > MAX_METADATA_BYTES:
        raise BundleError(f"{file}: {file.stat().st_size} bytes, more than a compiler writes ({MAX_METADATA_BYTES})")
    try:
        entries = read_json(file)
    except FileFormatError as e:
        raise BundleError(str(e)) from None
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        raise BundleError(f"{file}: expected a list of one model entry, as Apple's compiler writes it")
    entry = entries[0]
    functions = entry.get("functions")
    if functions is None:
        return {single: _schemas(file, single, entry)}
    if not isinstance(functions, list) or not functions or not all(isinstance(f, dict) for f in functions):
        raise BundleError(f"{file}: functions: expected a list of function entries")
    out = {}
    for i, f in enumerate(functions):
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise BundleError(f"{file}: functions[{i}].name: expected a function name")
        out[f["name"]] = _schemas(file, f["name"], f)
    default = entry.get("defaultFunctionName", next(iter(out)))
    if default not in out:
        raise BundleError(f"{file}: defaultFunctionName {default!r}: no such function (has {', '.join(out)})")
    return {default: out[default], **{n: io for n, io in out.items() if n != default}}


def _schemas(file: Path, function: str, entry: dict) -> Interface:
    """One function's {"inputs", "outputs", "states"} from its three schemas (a stateless one may omit
    stateSchema)."""
    interface = {}
    for kind, key in SCHEMAS.items():
        features = entry.get(key, [] if kind == "states" else None)
        if not isinstance(features, list):
            raise BundleError(f"{file}: {function}: {key}: expected a list of features")
        interface[kind] = dict(_feature(file, f"{function}: {key}[{i}]", f) for i, f in enumerate(features))
    return interface


def _feature(file: Path, where: str, feature) -> tuple[str, dict]:
    """(name, {"shape", "dtype"}) of one feature entry: `dataType` "Float16", `shape` "[1, 1, 64]" (a string)."""
    if not isinstance(feature, dict) or not isinstance(feature.get("name"), str):
        raise BundleError(f"{file}: {where}: expected a feature with a name")
    dtype = DATA_TYPES.get(feature.get("dataType"))
    if dtype is None:
        raise BundleError(
            f"{file}: {where}.dataType: {feature.get('dataType')!r}, expected one of {', '.join(DATA_TYPES)}"
        )
    try:
        shape = json.loads(feature.get("shape"))
    except (TypeError, ValueError, RecursionError):
        shape = None
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise BundleError(f"{file}: {where}.shape: {feature.get('shape')!r}, expected a list of positive sizes")
    return feature["name"], {"shape": shape, "dtype": dtype}


def check_against_config(path: Path, interfaces: dict[str, Interface]) -> None:
    """A compiled chunk's metadata against what model_config.json states of it: the last chunk's head (`head`,
    when the config has the key: CoreML-LLM's has none) and every stateful chunk's context (`context_length`, the
    width of its full-attention mask). One line naming both files and fields."""
    root, file = path.parent, path / METADATA
    config_path = root / layout.MODEL_CONFIG
    try:
        config = read_json(config_path) if config_path.is_file() else {}
    except FileFormatError:
        config = None
    if not isinstance(config, dict) or "infer" not in interfaces:
        return  # the config's own check and the engine's (no infer function) say so
    infer = interfaces["infer"]
    if "head" in config and path == layout.chunk_paths(root)[-1] and not infer["states"]:
        head = "logits" if "logits" in infer["outputs"] else "token_id"
        if head != config["head"]:
            raise BundleError(
                f"{file}: outputSchema of infer returns {', '.join(infer['outputs'])} (head {head}), but "
                f"{config_path} head is {config['head']!r}"
            )
    mask = infer["inputs"].get("causal_mask_full")
    if mask and "context_length" in config and mask["shape"][-1] != config["context_length"]:
        raise BundleError(
            f"{file}: inputSchema of infer: causal_mask_full {mask['shape']} (a context of {mask['shape'][-1]}), "
            f"but {config_path} context_length is {config['context_length']!r}"
        )


def stated_interfaces(path: Path) -> dict[str, Interface]:
    """A compiled chunk's interfaces as its bundle states them (CONTRACT §2-3): the plan recorded in
    manifest.json at conversion, or, for the published layout (no manifest), the plan its configs imply."""
    root, name = path.parent, layout.model_name(path)
    if (root / layout.MANIFEST).is_file():
        chunks = read_json(root / layout.MANIFEST).get("plan", {}).get("chunks", [])
        where = f"{layout.MANIFEST} plan"
    else:
        chunks = published_plan(root).to_json()["chunks"]
        where = f"the published layout's plan ({layout.HF_CONFIG}, {layout.MODEL_CONFIG})"
    chunk = next((c for c in chunks if isinstance(c, dict) and c.get("name") == name), None)
    if chunk is None or not isinstance(chunk.get("functions"), dict) or "infer" not in chunk["functions"]:
        raise BundleError(f"{path}: {where} states no interface with an infer function for {name}")
    states = chunk.get("states", {})
    # a context ladder's smaller rungs (bundle.ladder) state their own states
    return {
        f: {"inputs": io["inputs"], "outputs": io["outputs"], "states": io.get("states", states)}
        for f, io in chunk["functions"].items()
    }


def published_plan(root: Path) -> ChunkPlan:
    """The chunk plan of a published-layout bundle: its model config's context, the default split
    and prefill batch, the argmax head, no KV-only prefill."""
    try:
        spec = ModelSpec.from_pretrained(root / layout.HF_CONFIG)
        config = read_json(root / layout.MODEL_CONFIG)
        split = tuple(config["split"]) if "split" in config else None
        return ChunkPlan.build(
            spec,
            int(config["context_length"]),
            int(config.get("prefill_batch", 8)),
            split,
            head=config.get("head", "token_id"),
            kv_batches=(),
        )
    except (ConfigError, KeyError, TypeError, ValueError, OSError) as e:
        raise BundleError(f"{root}: cannot derive the compiled chunks' interfaces ({e})") from None


def one_function_interfaces(path: Path, name: str, function: str) -> dict[str, Interface]:
    """A package states its interface; a compiled one in its metadata.json, or else manifest.json's entry `name`
    states it (stateless)."""
    if path.suffix == layout.PACKAGE:
        return read_interfaces(path)
    if (path / METADATA).is_file():
        return metadata_interfaces(path, function)
    manifest = path.parent / layout.MANIFEST
    functions = (read_json(manifest) if manifest.is_file() else {}).get(name, {}).get("functions")
    if not isinstance(functions, dict) or function not in functions:
        raise BundleError(f"{path}: compiled, and {layout.MANIFEST} states no interface for its {function!r} function")
    return {f: {**io, "states": {}} for f, io in functions.items()}

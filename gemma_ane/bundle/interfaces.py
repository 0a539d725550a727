"""Every model's interfaces (CONTRACT §2-3): read off a package's own model description, or, for a compiled
.mlmodelc (which cannot be read back), as its bundle states them: the chunk plan recorded in manifest.json, the
plan the published layout's configs imply, a one-function model's manifest entry."""

from __future__ import annotations

from pathlib import Path

from ..files import read_json
from ..mil.package import Package
from . import layout
from .errors import BundleError
from .plan import ChunkPlan
from .spec import ConfigError, ModelSpec

# An interface: {"inputs": {...}, "outputs": {...}, "states": {...}}, each name -> {"shape": [..], "dtype": "float16"}
Interface = dict


def read_interfaces(path: Path) -> dict[str, Interface]:
    """Every function's interface, default first, from the package's own model description. A
    compiled .mlmodelc cannot be read back, so its interfaces come from what the bundle states."""
    path = Path(path)
    if path.suffix == layout.COMPILED:
        return stated_interfaces(path)
    package = Package.open(path)
    names = [package.default_function] + [f for f in package.function_names if f != package.default_function]
    return {f: package.interface(f) for f in names}


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
    """A package states its interface; a compiled one cannot be read back: manifest.json's entry `name` states
    it (stateless)."""
    if path.suffix == layout.PACKAGE:
        return read_interfaces(path)
    manifest = path.parent / layout.MANIFEST
    functions = (read_json(manifest) if manifest.is_file() else {}).get(name, {}).get("functions")
    if not isinstance(functions, dict) or function not in functions:
        raise BundleError(f"{path}: compiled, and {layout.MANIFEST} states no interface for its {function!r} function")
    return {f: {**io, "states": {}} for f, io in functions.items()}

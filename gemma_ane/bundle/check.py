"""A converted bundle on disk, checked and described: its files against the manifest (`gemma-ane check`), its
models' interfaces and costs (`gemma-ane inspect`), the published layout told apart from ours.

Everything here is read from the files themselves (the model descriptions and programs), so it
describes bundles converted elsewhere too; the manifest is only trusted for sizes and hashes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..files import FileFormatError, is_within, read_json_object, sha256_file, tree_size
from ..mil.package import Package, PackageError, macs, weight_bytes, weight_formats
from ..mil.program import ProgramError
from .errors import BundleError
from .interfaces import METADATA, one_function_interfaces, read_interfaces
from .ladder import rung_function, rungs_of, split_rung
from .layout import (
    ASSISTANT_SIDECARS,
    COMPILED,
    MANIFEST,
    ONE_FUNCTION_MODELS,
    PACKAGE,
    REQUIRED,
    bundle_files,
    chunk_paths,
    model_name,
    model_paths,
    not_a_checkpoint,
    package_path,
)
from .plan import WIRED_PER_WEIGHT_BYTE, device_cost
from .schema import ASSISTANT, VISION, read_bundle_json, read_model_config


def check_manifest(root: Path, sha256: bool = True) -> list[str]:
    """Problems found against manifest.json, one line each (empty: the bundle verifies). Sizes
    always; sha256=True verifies: hashes too, and that the manifest lists every file the bundle
    holds (an unlisted file would go unchecked)."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        return [f"{path}: missing"]
    try:
        files = read_json_object(path).get("files")
    except FileFormatError as e:
        return [str(e)]
    if not isinstance(files, dict):
        found = "missing" if files is None else f"expected an object of file entries, found {type(files).__name__}"
        return [f"{path}: files: {found}"]
    items = list(files.items())
    problems = []
    for rel, entry in items:
        p = root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            problems.append(f"{path}: refuses file entry {rel!r} outside the bundle")
            continue
        size = entry.get("size") if isinstance(entry, dict) else None
        if not is_within(p, root):  # a symbolic link out: its bytes are not the bundle's
            problems.append(f"{p}: lies outside the bundle ({os.path.realpath(p)})")
        elif not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != size:
            problems.append(f"{p}: size {p.stat().st_size}, manifest says {size}")
        elif sha256 and sha256_file(p) != entry.get("sha256"):
            problems.append(f"{p}: sha256 differs from the manifest")
    if sha256:
        listed = {Path(rel) for rel, _ in items}
        problems += [
            f"{p}: not listed in the manifest" for p in bundle_files(root) if p.relative_to(root) not in listed
        ]
    return problems


def write_manifest(root: Path, header: dict) -> dict:
    """ROOT/manifest.json: `header` (what the converter states: versions, source, options, plan), then every file
    of the bundle (bundle_files) with its size and sha256, as check_manifest verifies them."""
    root = Path(root)
    files = {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in bundle_files(root)}
    manifest = {**header, "files": files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def prompt_paths(chunks: list[dict]) -> dict:
    """Cost per prompt token of each way a prompt can be processed: chunk_1 + chunk_2 run the
    prompt (chunk_3 only for its last token). Weight bytes per prompt token = bytes of the
    weights the functions read, divided by the tokens per call."""
    stateful = [c for c in chunks if c["functions"].get("infer", {}).get("inputs", {}).get("current_pos")]
    paths = {}
    for fname in stateful[0]["functions"] if stateful else []:
        if split_rung(fname)[1].startswith("verify_b"):
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


def inspect_bundle(root: str | Path, sha256: bool = True) -> dict:
    root = Path(root)
    manifest = read_bundle_json(root / MANIFEST) if (root / MANIFEST).is_file() else None
    planned = _planned_layers(manifest or {})
    chunks = []
    for path in chunk_paths(root):
        entry = _inspect_package(path) if path.suffix == PACKAGE else _inspect_compiled(path)
        if entry["name"] in planned:
            entry["layers"] = planned[entry["name"]]
        chunks.append(entry)
    report = {"bundle": str(root), "chunks": chunks, "prompt_paths": prompt_paths(chunks)}
    report["device_cost"] = device_cost(_chunk_weights(c) for c in chunks)
    if chunks and len(rungs_of(chunks[0]["functions"])) > 1:
        report["rungs"] = rung_report(chunks)
    # the one-function models, costed as the chunks' functions: what a draft step or an image pays
    for name, function in ONE_FUNCTION_MODELS.items():
        path = next(iter(model_paths(root, name)), None)
        if path is not None:
            report[name] = _inspect_package(path) if path.suffix == PACKAGE else _inspect_compiled(path, function)
    problems = check_manifest(root, sha256) if manifest is not None else [f"{MANIFEST}: missing"]
    report["manifest"] = {"present": manifest is not None, "verified": not problems, "problems": problems}
    return report


def rung_report(chunks: list[dict]) -> list[dict]:
    """Per rung of a context ladder (bundle.ladder), from the saved programs: the bytes one decoded token reads
    (every chunk's infer weights; its KV states, each read at least once; the caches handed to later chunks), the
    state memory, and what the rung's functions wire with only that rung loaded. None where a compiled chunk
    cannot be read back."""
    rungs = rungs_of(chunks[0]["functions"])
    report = []
    for context in rungs:
        mine = [
            {f: io for f, io in c["functions"].items() if (split_rung(f)[0] or rungs[-1]) == context} for c in chunks
        ]
        infer = [m[rung_function("infer", context, rungs[-1])] for m in mine]
        states = sum(_bytes(t) for c, io in zip(chunks, infer) for t in io.get("states", c["states"]).values())
        hand_off = sum(_bytes(t) for io in infer for n, t in io["outputs"].items() if n.startswith("kv"))
        known = all(io["weight_bytes"] is not None for m in mine for io in m.values())
        weights = sum(io["weight_bytes"] for io in infer) if known else None
        wired = sum(io["weight_bytes"] for m in mine for io in m.values()) * WIRED_PER_WEIGHT_BYTE if known else None
        report.append(
            {
                "context": context,
                "weight_bytes": weights,
                "kv_bytes": states,
                "hand_off_bytes": hand_off,
                "bytes_per_token": weights + states + hand_off if known else None,
                "state_bytes": states,
                "wired_bytes": round(wired) if known else None,
            }
        )
    return report


def _bytes(t: dict) -> int:
    n = {"float16": 2, "float32": 4, "int32": 4}.get(t["dtype"], 2)
    for d in t["shape"]:
        n *= d
    return n


def _planned_layers(manifest: dict) -> dict:
    """{chunk name: its layers} as the manifest's plan states them; a plan damaged past reading states none (the
    report describes the chunks from their own files, and check_manifest reports the damage)."""
    plan = manifest.get("plan")
    chunks = plan.get("chunks") if isinstance(plan, dict) else None
    if not isinstance(chunks, list):
        return {}
    return {
        c["name"]: c["layers"]
        for c in chunks
        if isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("layers"), list) and c["layers"]
    }


def _chunk_weights(chunk: dict) -> tuple[str, int, dict]:
    """(name, its program's weight bytes, {function: weight bytes it reads}) for `device_cost`. A compiled chunk
    cannot be read back: its size on disk stands for its weights, read whole by every function."""
    functions = chunk["functions"]
    if any(f["weight_bytes"] is None for f in functions.values()):
        return chunk["name"], chunk["size_bytes"], dict.fromkeys(functions, chunk["size_bytes"])
    read = {name: f["weight_bytes"] for name, f in functions.items()}
    return chunk["name"], max(read.values()), read


def _tokens_per_call(io: dict) -> int:
    return io["inputs"]["hidden_states"]["shape"][1] if "hidden_states" in io["inputs"] else 1


def _inspect_package(path: Path) -> dict:
    """Interfaces, weight bytes and MACs, read off the saved program."""
    pkg = Package.open(path)
    program = pkg.program()
    entry = {"name": model_name(path), "path": path.name, "size_bytes": pkg.size_bytes(), "functions": {}}
    entry["weights"] = weight_formats(program.functions[pkg.default_function])  # functions share their weights
    for fname in pkg.function_names:
        io = pkg.interface(fname)
        entry.setdefault("states", io["states"])
        fn, T = program.functions[fname], _tokens_per_call(io)
        entry["functions"][fname] = {
            "inputs": io["inputs"],
            "outputs": io["outputs"],
            "tokens_per_call": T,
            "weight_bytes": weight_bytes(fn),
            "macs_per_token": _macs(pkg, fname, fn) // T,
        }
        if io["states"] != entry["states"]:  # a context ladder's smaller rung (bundle.ladder): its own states
            entry["functions"][fname]["states"] = io["states"]
    return entry


def _macs(pkg: Package, fname: str, fn) -> int:
    try:
        return macs(fn)
    except ProgramError as e:  # a shape the count cannot multiply: the package's fault, named with it
        raise PackageError(f"{pkg.path}: model.mlmodel, function {fname!r}, {e}") from None


def _inspect_compiled(path: Path, function: str | None = None) -> dict:
    """A compiled chunk (or one-function model) cannot be read back: its interfaces as the bundle states them, no
    costs."""
    name = model_name(path)
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
        if io["states"] != entry["states"]:
            entry["functions"][fname]["states"] = io["states"]
    return entry


def check_bundle(root: Path, sha256: bool = True) -> list[str]:
    """Every problem with a bundle, one line each: files missing or damaged, a model_config.json
    the runtime cannot use. sha256=True verifies (`check`, `load(verify=True)`): hashes, every file
    listed in the manifest, and a manifest at all, which only a bundle converted elsewhere may lack
    (`converted_elsewhere`); sha256=False checks what `load` needs: presence and the manifest's sizes."""
    return checked_bundle(root, sha256)[0]


def checked_bundle(root: Path, sha256: bool = True) -> tuple[list[str], dict | None]:
    """(check_bundle's problems, model_config.json as read_model_config read it, or None when it is unusable):
    the file parsed once for both, as bundle.open needs them."""
    root = Path(root)
    if not root.is_dir():  # one line, as load and inspect say it, not a "missing" line for every required file
        raise BundleError(f"{root}: not a bundle directory")
    not_a_checkpoint(root)
    problems = [f"{root / f}: missing" for f in REQUIRED if not (root / f).is_file()]
    if (root / MANIFEST).exists():
        problems += check_manifest(root, sha256)
    config = None
    try:
        chunk_paths(root)
    except BundleError as e:
        problems.append(str(e))
    try:
        config = read_model_config(root)
    except BundleError as e:
        problems.append(str(e))
    problems += _one_function_problems(root, config) if config is not None else []
    for package in sorted(root.glob(f"*{PACKAGE}")):  # the files each package names, as a load reads them
        try:
            Package.open(package).check_files()
        except PackageError as e:
            problems.append(str(e))
    problems += _compiled_problems(root)
    if sha256 and not (root / MANIFEST).exists() and not problems:
        try:
            if not converted_elsewhere(root):
                missing = "missing (gemma-ane convert writes one; without it nothing can be verified)"
                problems.append(f"{root / MANIFEST}: {missing}")
        except BundleError as e:
            problems.append(str(e))
    return list(dict.fromkeys(problems)), config  # a file both required and in the manifest: report it once


def _compiled_problems(root: Path) -> list[str]:
    """A compiled chunk whose metadata.json cannot be read, or contradicts model_config.json (one without one
    states nothing to check)."""
    try:
        paths = chunk_paths(root)
    except BundleError:
        return []  # check_bundle has reported it
    problems = []
    for path in paths:
        if path.suffix == COMPILED and (path / METADATA).is_file():
            try:
                read_interfaces(path)
            except BundleError as e:
                problems.append(str(e))
    return problems


def _one_function_problems(root: Path, config: dict) -> list[str]:
    """A bundle whose model_config.json states an assistant or a vision model must hold its package and its
    sidecars (the drafter's head, the vision model's position table)."""
    missing = [
        package_path(root, name).name for name in ONE_FUNCTION_MODELS if name in config and not model_paths(root, name)
    ]
    if config.get(ASSISTANT, {}).get("num_centroids"):
        missing += [f for f in ASSISTANT_SIDECARS if not (root / f).is_file()]
    if VISION in config and not (root / config[VISION]["position_table"]).is_file():
        missing.append(config[VISION]["position_table"])
    return [f"{root / f}: missing" for f in missing]  # as check_manifest words it: reported once


def is_published(root: Path) -> bool:
    """The published layout (CONTRACT §2, §4): no manifest, and the last chunk is the argmax head (as its package
    or its compiled metadata.json states it; a compiled chunk without one, as the model config says). Our
    converter's default layout always writes a manifest and a logits head, so a bundle of ours whose manifest is
    gone is not mistaken for it."""
    root = Path(root)
    if (root / MANIFEST).exists():
        return False
    try:
        return "logits" not in read_interfaces(chunk_paths(root)[-1])["infer"]["outputs"]
    except PackageError as e:
        raise BundleError(str(e)) from None
    except KeyError:
        raise BundleError(f"{chunk_paths(root)[-1]}: no infer function") from None


def converted_elsewhere(root: Path) -> bool:
    """A bundle that may lack a manifest: the published layout, or one assembled from CoreML-LLM's files (its
    model_config.json has no `head`, a key our converter always writes), such as the seed's own bundle: its
    argmax-era chunks with a logits head."""
    root = Path(root)
    return not (root / MANIFEST).exists() and ("head" not in read_model_config(root) or is_published(root))

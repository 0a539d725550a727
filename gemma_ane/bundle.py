"""A converted bundle on disk: its manifest check and `gemma-ane inspect`.

Everything here is read from the files themselves (the model descriptions and programs), so it
describes bundles converted elsewhere too; the manifest is only trusted for sizes and hashes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .mil import Package, PackageError, macs, read_json, weight_bytes


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_manifest(root: Path, sha256: bool = True) -> list[str]:
    """Problems found against manifest.json, one line each (empty: the bundle verifies)."""
    root = Path(root)
    path = root / "manifest.json"
    if not path.is_file():
        return [f"{path}: missing"]
    try:
        files = read_json(path)["files"]
        items = list(files.items())
    except (PackageError, KeyError, TypeError, AttributeError) as e:
        return [f"{path}: unreadable ({e})"]
    problems = []
    for rel, entry in items:
        p = root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            problems.append(f"{path}: refuses file entry {rel!r} outside the bundle")
            continue
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != entry.get("size"):
            problems.append(f"{p}: size {p.stat().st_size}, manifest says {entry.get('size')}")
        elif sha256 and _sha256(p) != entry.get("sha256"):
            problems.append(f"{p}: sha256 differs from the manifest")
    return problems


def inspect_bundle(root: str | Path, sha256: bool = True) -> dict:
    root = Path(root)
    manifest = read_json(root / "manifest.json") if (root / "manifest.json").is_file() else None
    planned = {c["name"]: c for c in (manifest or {}).get("plan", {}).get("chunks", [])}
    chunks = []
    for path in chunk_paths(root):
        name = path.name.split(".")[0]
        pkg = Package.open(path)
        program = pkg.program()
        entry = {"name": name, "path": path.name, "size_bytes": pkg.size_bytes(), "functions": {}}
        if name in planned:
            entry["layers"] = planned[name]["layers"]
        for fname in pkg.function_names:
            io = pkg.interface(fname)
            entry.setdefault("states", io["states"])
            fn = program.functions[fname]
            T = io["inputs"]["hidden_states"]["shape"][1] if "hidden_states" in io["inputs"] else 1
            entry["functions"][fname] = {
                "inputs": io["inputs"], "outputs": io["outputs"], "tokens_per_call": T,
                "weight_bytes": weight_bytes(fn), "macs_per_token": macs(fn) // T,
            }
        chunks.append(entry)
    problems = check_manifest(root, sha256) if manifest is not None else ["manifest.json: missing"]
    return {"bundle": str(root), "chunks": chunks,
            "manifest": {"present": manifest is not None, "verified": not problems, "problems": problems}}

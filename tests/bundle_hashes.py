"""The bytes of every bundle the tiny presets convert to, as sha256 per file: a refactor of the converter or of
the bundle format must leave them unchanged (tests/test_byte_identity.py). `python tests/bundle_hashes.py DIR
[CASE ...]` converts the cases into DIR and prints their table, as tests/fixtures/bundle_hashes.json holds it."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "bundle_hashes.json"

# each preset with its drafter and its vision model, at 4 and 16 bits, at a context that holds an image of the
# smallest budget and text (as the vision_bundle fixture's); and the published layout (text only, no drafter)
FULL = dict(context=256, vision=True, image_tokens=70)
PRESETS = ("e2b-mini", "gqa-mini", "e4b-mini", "e2b-narrow", "e2b-wide")
CASES = {
    **{f"{p}-{bits}bit": (p, True, dict(FULL, bits=bits)) for p in PRESETS for bits in (4, 16)},
    "e2b-mini-published": ("e2b-mini", False, dict(context=128, bits=16, vision=False, layout="published")),
}


def file_hashes(bundle: Path, sources: dict[str, Path]) -> dict[str, str]:
    """sha256 of every file under `bundle`; in the text files that name a source directory (the manifest, the
    model card, model_config.json), its path and then its name (the model's name when its config has none) are
    replaced by placeholders first: the bytes must not depend on where the checkpoint sat."""
    out = {}
    for p in sorted(q for q in bundle.rglob("*") if q.is_file()):
        data = canonical(p, bundle)
        if p.suffix in (".json", ".md"):
            for tag, path in sources.items():
                data = data.replace(str(path).encode(), tag.encode())
                name = re.escape(Path(path).name.encode())
                data = re.sub(rb"(?<![\w.-])" + name + rb"(?![\w.-])", tag.encode() + b"name", data)
        out[str(p.relative_to(bundle))] = hashlib.sha256(data).hexdigest()
    return out


def canonical(path: Path, bundle: Path) -> bytes:
    """A file's bytes, with what coremltools leaves to chance put in one order. Saving a package draws a random
    UUID per item of its Manifest.json, and serialises the model's protobuf maps (functions, op attributes) in
    the order of Python's per-process string hashing: two conversions of one checkpoint differ there, and only
    there. So a package's Manifest.json is read as {item path: item} and its root item's path, a model.mlmodel
    is re-serialised with sorted maps (protobuf's deterministic mode), and the bundle's manifest.json keeps the
    names of the files it lists but not their sizes and hashes (each file is compared itself, and the model card
    and model_config.json name the source)."""
    data = path.read_bytes()
    rel = path.relative_to(bundle)
    in_package = rel.parts[0].endswith(".mlpackage")
    if in_package and path.name == "Manifest.json":
        m = json.loads(data)
        items = m["itemInfoEntries"]
        canon = {"root": items[m["rootModelIdentifier"]]["path"], "items": sorted(items.values(), key=str)}
        return json.dumps({**m, "itemInfoEntries": canon, "rootModelIdentifier": None}, sort_keys=True).encode()
    if in_package and path.name == "model.mlmodel":
        from coremltools.proto import Model_pb2

        model = Model_pb2.Model()
        model.ParseFromString(data)
        return model.SerializeToString(deterministic=True)
    if rel == Path("manifest.json"):
        m = json.loads(data)
        m["files"] = sorted(m["files"])
        return (json.dumps(m, indent=2) + "\n").encode()
    return data


def sources(root: Path, preset: str) -> dict[str, Path]:
    return {"<CKPT>": root / f"{preset}.ckpt", "<ASSISTANT>": root / f"{preset}.asst"}


def convert_case(root: Path, case: str) -> dict[str, str]:
    from gemma_ane.convert import ConvertOptions, convert
    from gemma_ane.oracle.tiny import write_tiny

    preset, drafter, options = CASES[case]
    paths = sources(root, preset)
    ckpt, asst = paths["<CKPT>"], paths["<ASSISTANT>"]
    if not ckpt.exists():
        write_tiny(ckpt, preset=preset, assistant=asst)
    out = root / case
    options = dict(options, assistant=str(asst)) if drafter else options
    convert(str(ckpt), str(out), ConvertOptions(force=True, **options), progress=False)
    return file_hashes(out, paths)


if __name__ == "__main__":
    import time

    root = Path(sys.argv[1])
    root.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[2:] or CASES:
        t = time.time()
        table = {case: convert_case(root, case)}
        (root / f"{case}.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"{case}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)

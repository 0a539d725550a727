"""A converted bundle on disk: its manifest check and `gemma-ane inspect`.

Everything here is read from the files themselves (the model descriptions and programs), so it
describes bundles converted elsewhere too; the manifest is only trusted for sizes and hashes.
"""

from __future__ import annotations

import gc
import hashlib
import os
from pathlib import Path

import numpy as np

from .engine import Engine, HostTables
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


def sha256_file(path: Path) -> str:
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
        elif sha256 and sha256_file(p) != entry.get("sha256"):
            problems.append(f"{p}: sha256 differs from the manifest")
    return problems


def prompt_paths(chunks: list[dict]) -> dict:
    """Cost per prompt token of each way a prompt can be processed: chunk_1 + chunk_2 run the
    prompt (chunk_3 only for its last token). Weight bytes per prompt token = bytes of the
    weights the functions read, divided by the tokens per call."""
    stateful = [c for c in chunks if c["functions"].get("infer", {}).get("inputs", {}).get("current_pos")]
    paths = {}
    for fname in stateful[0]["functions"] if stateful else []:
        fns = [c["functions"][fname] for c in stateful if fname in c["functions"]]
        T = fns[0]["tokens_per_call"]
        paths[fname] = {"tokens_per_call": T,
                        "macs_per_prompt_token": sum(f["macs_per_token"] for f in fns),
                        "weight_bytes_per_prompt_token": sum(f["weight_bytes"] for f in fns) / T}
    return paths


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
    return {"bundle": str(root), "chunks": chunks, "prompt_paths": prompt_paths(chunks),
            "manifest": {"present": manifest is not None, "verified": not problems, "problems": problems}}


# -- running a bundle with the MIL executor ------------------------------------------------------

class MILChunk:
    """The engine's backend protocol over one package: a MILModel per function, one shared state
    (as Core ML lets `prefill_b8` and `infer` share a cache)."""

    def __init__(self, path: Path, precision: str = "fp16"):
        from .mil import MILModel

        self.path = Path(path)
        package = Package.open(path)
        program = package.program()
        weights: dict = {}
        self.models = {f: MILModel(path, f, precision, _package=package, _program=program, _weights=weights)
                       for f in package.function_names}
        # The loaded program (every function's fp16 weights: GBs at E2B size) is garbage now, but
        # pymil's ops and vars form reference cycles: collect it before the next chunk loads.
        del program
        gc.collect()
        first = next(iter(self.models.values()))
        self.state = first.make_state() if first.interface["states"] else None

    @property
    def functions(self) -> list[str]:
        return list(self.models)

    def reset_state(self) -> None:
        if self.state is not None:
            self.state.reset()

    def predict(self, function: str, inputs: dict) -> dict:
        model = self.models.get(function)
        if model is None:
            raise BundleError(f"{self.path}: no function {function!r} (has {', '.join(self.models)})")
        feed = {n: np.asarray(inputs[n]).astype(t["dtype"], copy=False) for n, t in model.interface["inputs"].items()}
        return model.predict(feed, state=self.state)


def _check_size(path: Path, dtype, shape) -> None:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not path.is_file():
        raise BundleError(f"{path}: missing")
    if path.stat().st_size != expected:
        raise BundleError(f"{path}: {path.stat().st_size} bytes, expected {expected} for {tuple(shape)} {np.dtype(dtype).name}")


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
        embed_scale=float(config["embed_scale"]), per_layer_embed_scale=float(config["per_layer_embed_scale"]),
        rope=rope,
    )


def open_engine(root: str | Path, precision: str = "fp16") -> Engine:
    """A step driver over the bundle's chunks, executed by the MIL executor."""
    root = Path(root)
    config = read_json(root / "model_config.json")
    chunks = [MILChunk(p, precision) for p in chunk_paths(root)]
    first = chunks[0].models["infer"].interface["inputs"]
    context = first["causal_mask_full"]["shape"][-1]
    window = first["causal_mask_sliding"]["shape"][-1]
    return Engine(chunks, load_host(root, config), context=context, window=window,
                  **prefill_paths({f: m.interface for f, m in chunks[0].models.items()}))


def prefill_paths(interfaces: dict) -> dict:
    """The Engine's prompt-path arguments, read off chunk_1's functions."""
    batches = sorted(int(f[len("prefill_b"):]) for f in interfaces if f.startswith("prefill_b") and f[9:].isdigit())
    kv = sorted(int(f[len("prefill_kv_b"):]) for f in interfaces if f.startswith("prefill_kv_b"))
    width = interfaces[f"prefill_kv_b{kv[0]}"]["inputs"]["per_layer_raw"]["shape"][-1] if kv else None
    return {"prefill_batch": batches[-1] if batches else None, "kv_batches": tuple(kv), "kv_ple_width": width}

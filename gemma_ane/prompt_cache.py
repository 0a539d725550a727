"""Prompt cache files: the caches of a prompt prefix with its token ids, so a long system prompt is
processed once across processes (as mlx-lm's prompt cache files and llama.cpp's slot save/restore).

A file is a numpy .npz archive:
- `tokens` int64 [n]: the ids whose K/V it holds, positions 0..n-1 (an image's soft tokens: their negative
  keys, encoder.soft_keys; files from before images hold int32);
- `meta`: JSON text: {"format": 1, "bundle": the bundle's fingerprint, "context", "window"};
- `chunk_K/NAME`: chunk K's state NAME: the ring whole, a full cache's first n slots (axis 2).
A file made for another bundle (other weights, context or window) is refused, never misread.

Torch-free: the runtime side.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np

from .bundle import layout
from .engine import RING, Engine
from .files import write_atomic

FORMAT = 1


class PromptCacheError(ValueError):
    """A prompt cache file that cannot be used here; the message names the file and the field."""


def fingerprint(root: Path) -> str:
    """What the cached K/V depend on: the manifest (every file's sha256) when the bundle has one,
    else the chunks' and sidecars' names and sizes (the published layout has no manifest)."""
    root = Path(root)
    h = hashlib.sha256()
    if (root / layout.MANIFEST).is_file():
        h.update((root / layout.MANIFEST).read_bytes())
    else:
        for f in sorted(p for p in root.rglob("*") if p.is_file() and layout.HF_DIR not in p.parts):
            h.update(f"{f.relative_to(root)}:{f.stat().st_size}\n".encode())
    return h.hexdigest()[:32]


def _meta(engine: Engine, bundle: str) -> dict:
    return {"format": FORMAT, "bundle": bundle, "context": engine.context, "window": engine.window}


def save(path, engine: Engine, position: int, bundle: str) -> None:
    """Write the caches of engine.tokens[:position] (see Engine.caches) to `path`, atomically."""
    arrays = {"tokens": np.asarray(engine.tokens[:position], np.int64)}
    for k, chunk in enumerate(engine.caches(position), 1):
        arrays.update({f"chunk_{k}/{name}": a for name, a in chunk.items()})
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.array(json.dumps(_meta(engine, bundle))), **arrays)
    write_atomic(path, buffer.getvalue())


def load(path, engine: Engine, bundle: str) -> int:
    """Restore the engine from a file `save` wrote for this bundle; returns the tokens it holds."""
    if not Path(path).is_file():
        raise PromptCacheError(f"{path}: no such prompt cache file")
    if not zipfile.is_zipfile(path):
        raise PromptCacheError(f"{path}: not a prompt cache file (not an .npz archive)")
    try:
        with np.load(path, allow_pickle=False) as f:
            files = {k: f[k] for k in f.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise PromptCacheError(f"{path}: not a prompt cache file ({e})") from None
    if "meta" not in files or "tokens" not in files:
        raise PromptCacheError(f"{path}: not a prompt cache file (no {'meta' if 'meta' not in files else 'tokens'})")
    meta, want = json.loads(str(files.pop("meta"))), _meta(engine, bundle)
    for key, value in want.items():
        if meta.get(key) != value:
            raise PromptCacheError(f"{path}: made for another bundle ({key} {meta.get(key)!r}, this one {value!r})")
    tokens = files.pop("tokens").tolist()
    n = len(tokens)
    if not 0 < n <= engine.context:
        raise PromptCacheError(f"{path}: tokens: {n} ids, expected 1 to {engine.context}")
    caches = []
    for k, chunk in enumerate(engine.chunks, 1):
        states = chunk.interfaces["infer"]["states"]
        caches.append({})
        for name, t in states.items():
            shape = list(t["shape"]) if name == RING else [*t["shape"][:2], n, *t["shape"][3:]]
            a = files.get(f"chunk_{k}/{name}")
            if a is None or list(a.shape) != shape:
                got = "missing" if a is None else list(a.shape)
                raise PromptCacheError(f"{path}: chunk_{k}/{name}: expected shape {shape}, got {got}")
            caches[-1][name] = a
    engine.restore(tokens, caches)
    return n

"""Prompt cache files: the caches of a prompt prefix with its token ids, so a long system prompt is
processed once across processes (as mlx-lm's prompt cache files and llama.cpp's slot save/restore).

A file is a numpy .npz archive of exactly these members:
- `tokens` int64 [n]: the ids whose K/V it holds, positions 0..n-1 (an image's soft tokens: their negative
  keys, encoder.soft_keys; files from before images hold int32);
- `meta`: JSON text: {"format": 1, "bundle": the bundle's fingerprint, "context", "window", "images",
  "ring_top"}, where "images" maps the picture number of every soft token in `tokens` to its identity (hex):
  numbers are the saving process's (encoder.media_number), so a load maps each key to this process's number for the
  same picture; "ring_top" is the newest position the saved rings hold (Engine.ring_top_at: past n - 1 by a
  verify batch's rejected drafts, or by an earlier, longer sequence whose prefix a later prompt reused while the
  rings had not wrapped; files from before it lack it, and the worst case is then assumed);
- `chunk_K/NAME`: chunk K's state NAME: the ring whole, a full cache's first n slots (axis 2).
A file made for another bundle (other weights, context or window) is refused, never misread.

The reader trusts nothing in the file: it opens only regular files, refuses members it does not expect, and
checks each member's declared size (the zip header) and its .npy header's shape and dtype against the bundle
before it reads the data, so a zip bomb or a header declaring 10**12 elements costs no memory. Every refusal is
one PromptCacheError line naming the file and the field.

Torch-free: the runtime side.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..bundle import layout
from ..errors import InputError
from ..files import write_atomic
from .encoder import IDENTITY_BYTES, KEY_BITS, NUMBER_BITS, identity_of, key_number, media_number
from .engine import RING, Engine

FORMAT = 1
HEADER_BYTES = 4096  # an .npy header: numpy writes ~128 bytes for the shapes here (a 64-byte multiple)
META_BYTES = 1 << 20  # the meta JSON: a few fields and one identity per image in the tokens
TOKEN_DTYPES = (np.dtype("<i8"), np.dtype("<i4"))  # int32: files from before images
KINDS = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device"}


class PromptCacheError(InputError):
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
    tokens = engine.tokens[:position]
    numbers = sorted({key_number(t)[0] for t in tokens if t < 0})
    images = {str(n): identity_of(n) for n in numbers}
    unknown = [n for n, identity in images.items() if identity is None]
    if unknown:  # keys that encoder.soft_keys did not make in this process: nothing could map them back
        raise PromptCacheError(f"{path}: tokens hold soft-token keys of no known image (number {unknown[0]})")
    arrays = {"tokens": np.asarray(tokens, np.int64)}
    for k, chunk in enumerate(engine.caches(position), 1):  # first: it refuses a position it holds no caches of
        arrays.update({f"chunk_{k}/{name}": a for name, a in chunk.items()})
    meta = {
        **_meta(engine, bundle),
        "images": {n: identity.hex() for n, identity in images.items()},
        "ring_top": engine.ring_top_at(position),
    }
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.array(json.dumps(meta)), **arrays)
    write_atomic(path, buffer.getvalue())


def load(path, engine: Engine, bundle: str) -> int:
    """Restore the engine from a file `save` wrote for this bundle; returns the tokens it holds."""
    states = [(k, name, t) for k, c in enumerate(engine.chunks) for name, t in c.interfaces["infer"]["states"].items()]
    with _open(path) as z:
        members = _members(z, path, ["meta", "tokens", *(f"chunk_{k + 1}/{name}" for k, name, _ in states)])
        meta = _read_meta(z, members["meta"], path)
        want = _meta(engine, bundle)
        for key, value in want.items():
            if meta.get(key) != value:
                raise PromptCacheError(f"{path}: made for another bundle ({key} {meta.get(key)!r}, this one {value!r})")
        tokens = _read_tokens(z, members["tokens"], path, engine.context)
        n = len(tokens)
        tokens = _soft_keys_here(tokens, meta.get("images", {}), path)
        caches = [{} for _ in engine.chunks]
        for k, name, t in states:
            field = f"chunk_{k + 1}/{name}"
            shape = list(t["shape"]) if name == RING else [*t["shape"][:2], n, *t["shape"][3:]]
            caches[k][name] = _read_state(z, members[field], path, field, shape, t["dtype"])
    engine.restore(tokens, caches, _ring_top(meta, n, engine, path))
    return n


def _ring_top(meta: dict, n: int, engine: Engine, path) -> int | None:
    """The meta's ring_top, within what an engine can leave behind position n - 1: rows of a longer sequence
    the rings still hold before they first wrap (below `ring`), or rejected drafts (up to the padding
    ring - window past n - 1: Engine.reuse keeps no prefix the rows written past it could have evicted)."""
    top = meta.get("ring_top")
    lo, hi = n - 1, min(engine.context - 1, max(engine.ring - 1, n - 1 + engine.ring - engine.window))
    if top is not None and (type(top) is not int or not lo <= top <= hi):
        raise PromptCacheError(f"{path}: meta: ring_top {top!r}, expected an integer from {lo} to {hi}")
    return top


def _open(path) -> zipfile.ZipFile:
    """The file as a zip archive, if it is a regular file (a FIFO would block, /dev/zero never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise PromptCacheError(f"{path}: no such prompt cache file") from None
    except OSError as e:
        raise PromptCacheError(f"{path}: cannot read the prompt cache file ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for is_kind, name in KINDS.items() if is_kind(mode)), "not a regular file")
        raise PromptCacheError(f"{path}: not a prompt cache file ({kind}, not a regular file)")
    f = os.fdopen(fd, "rb")
    try:
        return zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        f.close()
        raise PromptCacheError(f"{path}: not a prompt cache file (not an .npz archive: {e})") from None


def _members(z: zipfile.ZipFile, path, fields: list[str]) -> dict[str, zipfile.ZipInfo]:
    """Each expected field's member (`field`.npy); any other member, or one twice, is refused."""
    members = {}
    for info in z.infolist():
        field = info.filename.removesuffix(".npy")
        if field not in fields or not info.filename.endswith(".npy"):
            raise PromptCacheError(f"{path}: {info.filename}: not a member of a prompt cache file for this bundle")
        if field in members:
            raise PromptCacheError(f"{path}: {field}: stored twice")
        members[field] = info
    for field in fields:
        if field not in members:
            raise PromptCacheError(f"{path}: {field}: missing (not a prompt cache file for this bundle)")
    return members


def _read(z, info: zipfile.ZipInfo, path, field: str, limit: int, check) -> np.ndarray:
    """A member's array, its sizes checked before its data is read: the zip header's declared size against
    `limit`, the .npy header's (shape, dtype) by `check`, which returns what is wrong or None. The zip stream
    stops at the declared size, so a member that inflates past it fails its CRC check instead of filling memory."""
    if info.file_size > limit:
        raise PromptCacheError(f"{path}: {field}: declares {info.file_size} bytes, at most {limit} expected")
    try:
        with z.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                # internal: caught below with numpy's own, and raised as a PromptCacheError naming file and field
                raise ValueError(f"unsupported .npy version {version}")
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else None
            shape, fortran, dtype = (read_header or np.lib.format.read_array_header_2_0)(f)
            problem = check(shape, dtype)
            if problem:
                raise PromptCacheError(f"{path}: {field}: {problem}")
            nbytes = math.prod(shape) * dtype.itemsize
            data = f.read(nbytes)
            if len(data) != nbytes or f.read(1):  # reading to the end checks the member's CRC
                # internal: caught below, as the version's
                raise ValueError(f"{len(data)} bytes of data where the header declares {nbytes}")
            return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")
    except PromptCacheError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, zlib.error) as e:
        raise PromptCacheError(f"{path}: {field}: unreadable ({' '.join(str(e).split())})") from None


def _read_meta(z, info: zipfile.ZipInfo, path) -> dict:
    """The meta member: one string of JSON holding an object."""

    def check(shape, dtype):
        if dtype.kind != "U" or shape != ():
            return f"dtype {dtype} shape {list(shape)}, expected one string"
        return f"a string of {dtype.itemsize} bytes, at most {META_BYTES}" if dtype.itemsize > META_BYTES else None

    text = str(_read(z, info, path, "meta", HEADER_BYTES + META_BYTES, check)[()])
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise PromptCacheError(f"{path}: meta: not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise PromptCacheError(f"{path}: meta: expected a JSON object, got {type(meta).__name__}")
    return meta


def _read_tokens(z, info: zipfile.ZipInfo, path, context: int) -> list[int]:
    """The tokens member: 1 to `context` int64 (or int32) ids."""

    def check(shape, dtype):
        if dtype not in TOKEN_DTYPES:
            return f"dtype {dtype}, expected int64"
        if len(shape) != 1:
            return f"expected shape [n] (one id a position), got {list(shape)}"
        if not 0 < shape[0] <= context:
            return f"{shape[0]} ids, expected 1 to {context}"
        return None

    return _read(z, info, path, "tokens", HEADER_BYTES + 8 * context, check).tolist()


def _read_state(z, info: zipfile.ZipInfo, path, field: str, shape: list[int], declared: str) -> np.ndarray:
    """A chunk's state member: exactly `shape`, of the bundle's dtype, or float32 for a float state (what the
    MIL executor holds at precision fp32; the engine casts it as it writes the state)."""
    dtypes = {np.dtype(declared)} | ({np.dtype("<f4")} if np.dtype(declared).kind == "f" else set())

    def check(got_shape, got):
        if got not in dtypes:
            return f"dtype {got}, expected {' or '.join(sorted(str(d) for d in dtypes))}"
        return None if list(got_shape) == shape else f"expected shape {shape}, got {list(got_shape)}"

    itemsize = max(d.itemsize for d in dtypes)
    return _read(z, info, path, field, HEADER_BYTES + math.prod(shape) * itemsize, check)


def _soft_keys_here(tokens: list[int], images, path) -> list[int]:
    """The tokens with each soft-token key (negative) mapped from the saving process's picture number to
    this process's number for the same picture (meta.images names it by identity)."""
    if not isinstance(images, dict):
        raise PromptCacheError(f"{path}: meta.images: expected an object, got {type(images).__name__}")
    numbers = {}
    out = []
    for t in tokens:
        if t >= 0:
            out.append(t)
            continue
        number, index = key_number(t)
        if number not in numbers:
            identity = images.get(str(number))
            try:
                raw = bytes.fromhex(identity) if isinstance(identity, str) else b""
            except ValueError:
                raw = b""
            if len(raw) != IDENTITY_BYTES or number >= 1 << NUMBER_BITS:
                what = "names no image" if identity is None else f"is {identity!r}, not an image identity"
                raise PromptCacheError(
                    f"{path}: meta.images: picture {number} of soft token {t} {what} (files saved before "
                    "image identities cannot be mapped: save it again)"
                )
            numbers[number] = media_number(raw)
        out.append(-((numbers[number] << KEY_BITS) + index) - 1)
    return out

"""Soft tokens at run time: an image's pixels through the bundle's vision model (`vision.mlpackage`, one function
`encode`), or a clip's log-mel features through its audio model (`audio.mlpackage`, one function per bucket of clip
length), into the rows that replace its placeholder in the prompt.

The engine tells tokens apart by id, and prefix reuse compares ids; a picture or a clip has no ids, so each of its
soft tokens gets a key of its own: a negative number made of its content's number and the token's index
(`soft_keys`). A content's number stands for its identity (`image_identity`, `audio_identity`: a 256-bit hash of
what the soft tokens depend on, the decoded pixels or samples and the preprocessing) one to one within the process
(`media_number`), so the same picture or clip always gets the same keys, and a follow-up question about it reuses
the caches like any repeated text, while two get the same keys only if their whole identities agree. Each encoder
keeps its newest results by identity (`CachingEncoder`), so nothing is encoded twice. Keys never reach the
vocabulary: the engine embeds a negative id as its soft token's row, with the per-layer embedding of the pad token
(transformers replaces multimodal ids by the pad id for that lookup).

Every modality's encoder meets `MediaEncoder`: the content-part type it takes, its begin/placeholder/end token ids,
and prepare/encode. Prompts are expanded by `expand_media` over a dict of them keyed by part type: the image
encoder's `<|image|>` and the audio encoder's `<|audio|>` (between begin- and end-of-audio) side by side.

Torch-free: this is the runtime side.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..bundle import BundleError, layout, load_npy
from ..bundle.host import MASK_BLOCKED
from ..bundle.opened import Bundle
from ..bundle.schema import audio_function
from ..errors import InputError
from . import audio
from .audio import AudioError, input_audio_bytes, load_audio
from .backend import open_one_function
from .device import Device
from .engine import ContextOverflow
from .images import MAX_PIXELS, ImageError, Patches, data_url_bytes, load_image, preprocess

FUNCTION = "encode"
OTHER_MEDIA = ("video",)  # parts Gemma 4's template renders that this runtime cannot read
MODEL_OF = {"image": "vision model", "audio": "audio model"}  # what a bundle lacks when it cannot encode a part type
ERROR_OF = {"image": ImageError, "audio": AudioError}  # the error of each part type
KEY_BITS = 11  # a soft token's index within its content: up to 2048 (the largest image budget is 1120, a clip 750)
NUMBER_BITS = 48  # a content's number (media_number): with KEY_BITS, keys stay within int64
IDENTITY_BYTES = 32  # content_identity: 256 bits, no collision to be found
CACHED_IMAGES = 8  # encoded pictures (and clips) kept, newest first: a chat's media are not encoded twice


@dataclass(frozen=True)
class SoftTokens:
    """One encoded picture or clip: its keys (the ids its placeholders take in the engine) and their rows
    (n, hidden)."""

    keys: list[int]
    rows: np.ndarray


def content_identity(header: str, data: bytes) -> bytes:
    """A 256-bit hash of `header` (the modality's shape and preprocessing, in a form no other modality's header
    takes) and the content's bytes."""
    h = hashlib.blake2b(header.encode(), digest_size=IDENTITY_BYTES)
    h.update(data)
    return h.digest()


def image_identity(img, budget: int, patch_size: int, pooling_kernel_size: int) -> bytes:
    """What an image's soft tokens depend on, as a 256-bit hash: the picture as decoded (size and RGB bytes:
    equal pictures from any file or format agree) and the preprocessing (the soft-token budget, the patch and
    pooling sizes), so one picture under another budget is another identity. Its header starts with a digit."""
    return content_identity(f"{img.width}x{img.height}:{budget}:{patch_size}:{pooling_kernel_size}:", img.tobytes())


def audio_identity(samples: np.ndarray) -> bytes:
    """What a clip's soft tokens depend on, as a 256-bit hash: its samples as decoded (float32 at 16 kHz, mono:
    equal sound from any file or format agrees); the features are a function of them alone. Its header starts with
    "audio", never with an image's digit."""
    x = np.ascontiguousarray(samples, np.float32)
    return content_identity(f"audio:{audio.SAMPLE_RATE}:{len(x)}:", x.tobytes())


# The engine's token list and prompt cache files are int64, too narrow for an identity, so each identity (of any
# modality) is interned to a number below 2**NUMBER_BITS, one to one: a content's number starts at the first 48
# bits of its identity, and when another identity already holds that number (only a collision made on purpose
# finds one, as issue 25's did in 50 s) it takes the next free one. Prefix reuse and the encoders' caches then
# compare whole identities by comparing keys, with no change to the engine. Numbers are what this process made of
# the identities it met, so a prompt cache file stores the identity of every picture or clip its tokens hold and
# maps its keys to this process's numbers on load (prompt_cache.py). The table is never pruned: a number still in
# some engine's caches must never pass to other content. It holds one entry (about 200 bytes) per distinct picture
# or clip the process has encoded or loaded, far less than the content itself cost to decode and encode.
_numbers: dict[bytes, int] = {}
_identities: dict[int, bytes] = {}
_interning = threading.Lock()  # the server encodes off its event loop: two threads must not take one number


def media_number(identity: bytes) -> int:
    """This process's number for a picture's or a clip's identity: the same identity always the same number, two
    identities never the same one."""
    with _interning:
        number = _numbers.get(identity)
        if number is None:
            number = int.from_bytes(identity[: NUMBER_BITS // 8], "big")
            while number in _identities:
                number = (number + 1) % (1 << NUMBER_BITS)
            _numbers[identity], _identities[number] = number, identity
        return number


def soft_keys(identity: bytes, n: int) -> list[int]:
    """n negative ids unique to this content (image_identity, audio_identity): its number (media_number), then the
    index. Negative keeps them out of every vocabulary; a prompt cache file stores them as int64."""
    base = media_number(identity) << KEY_BITS
    return [-(base + j) - 1 for j in range(n)]


def key_number(key: int) -> tuple[int, int]:
    """(the content's number, the token's index) of a soft token's key: soft_keys inverted."""
    return (-key - 1) >> KEY_BITS, (-key - 1) & ((1 << KEY_BITS) - 1)


def identity_of(number: int) -> bytes | None:
    """The identity this process gave `number`, or None."""
    with _interning:
        return _identities.get(number)


def encoder_inputs(patches: Patches, table: np.ndarray, head_dim: int, rope_theta: float, k: int) -> dict:
    """`encode`'s inputs for one image (images.preprocess's Patches), in cell order: each k x k pooling cell's
    patches consecutive, cells row by row (transformers' pooled order), padding after; the graph then pools with
    a reshape (vision.py). `table` is the (2, rows, hidden) position table, x rows then y rows."""
    rows, cols = patches.grid
    n = rows * cols
    x, y = patches.positions[:n, 0], patches.positions[:n, 1]
    cell = (y // k) * (cols // k) + x // k
    order = np.concatenate([np.argsort(cell, kind="stable"), np.arange(n, len(patches.positions))])
    pos = patches.positions[order]
    valid = pos[:, 0] >= 0
    xy = np.maximum(pos, 0)
    emb = (table[0][xy[:, 0]].astype(np.float32) + table[1][xy[:, 1]]) * valid[:, None]
    # axial RoPE (Gemma4VisionRotaryEmbedding): the first half of a head rotates by x, the second by y
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2))
    f = pos[:, :, None].astype(np.float32) * inv_freq  # (N, 2, head_dim / 4), in fp32 as transformers
    angle = np.concatenate([f[:, 0], f[:, 0], f[:, 1], f[:, 1]], axis=-1)
    return {
        "pixel_values": patches.pixel_values[order][None],
        "position_embeddings": emb[None],
        "cos": np.cos(angle).T[None, None],  # (1, 1, head_dim, N): heads are laid out (1, heads, D, N)
        "sin": np.sin(angle).T[None, None],
        "attention_mask": np.where(valid, 0, MASK_BLOCKED).astype(np.float16)[None, None, None],
    }


class MediaEncoder(Protocol):
    """What expand_media asks of an encoder. `prepare` is the cheap half of `encode` (load, check, hash): it tells
    how many soft tokens a source will take before the model runs, so a prompt that cannot fit is refused before
    anything is encoded."""

    kind: str  # the content-part type it takes ("image")

    @property
    def token_ids(self) -> tuple[int, int, int]:
        """(begin, placeholder, end): the template renders a part as the placeholder, which becomes begin, the
        soft tokens' keys, end."""

    def prepare(self, source, what: str):
        """The source loaded and checked (errors name `what`), ready for soft_tokens and encode."""

    def soft_tokens(self, prepared) -> int:
        """How many soft tokens the prepared source takes."""

    def encode(self, source, what: str, prepared=None) -> SoftTokens:
        """The source's soft tokens (from `prepared` when given)."""


class CachingEncoder:
    """What every modality's encoder shares: its newest CACHED_IMAGES results kept by identity, and `encode` built on
    the subclass's `prepare` ((identity, the model's input, or None when cached)), `_count` (soft tokens of an
    input) and `_run` (an input's rows, valid rows only). `encoded` counts the model's calls."""

    model = ""  # the bundle's model, for messages ("vision")

    def __init__(self):
        self.cache: OrderedDict[bytes, SoftTokens] = OrderedDict()
        self.encoded = 0

    def soft_tokens(self, prepared: tuple) -> int:
        digest, data = prepared
        return len(self.cache[digest].keys) if data is None else self._count(data)

    def encode(self, source, what: str | None = None, prepared=None) -> SoftTokens:
        what = what or self.kind
        digest, data = prepared or self.prepare(source, what)
        if data is None and digest not in self.cache:  # evicted by the prompt's other media since
            digest, data = self.prepare(source, what)
        if data is None:
            self.cache.move_to_end(digest)
            return self.cache[digest]
        rows = self._run(data)
        self.encoded += 1
        if not np.isfinite(rows).all():
            raise BundleError(f"{self.model}: the soft tokens of {what} hold NaN or inf (damaged weights); re-convert")
        tokens = SoftTokens(soft_keys(digest, len(rows)), rows)
        self.cache[digest] = tokens
        while len(self.cache) > CACHED_IMAGES:
            self.cache.popitem(last=False)
        return tokens


class ImageEncoder(CachingEncoder):
    """`encode(image)`: an image (path, bytes or PIL image) as SoftTokens, through the vision model; the newest
    CACHED_IMAGES results kept by identity (image_identity). `encoded` counts the vision model's calls; `max_pixels`
    bounds an image's width * height, checked from its header before it is decoded."""

    kind, model = "image", "vision"

    def __init__(self, package, table: np.ndarray, entry: dict, max_pixels: int = MAX_PIXELS):
        super().__init__()
        self.package, self.table, self.entry, self.max_pixels = package, table, entry, max_pixels

    @property
    def token_ids(self) -> tuple[int, int, int]:
        """(begin-of-image, image placeholder, end-of-image) ids of this bundle's tokenizer."""
        e = self.entry
        return e["boi_token_id"], e["image_token_id"], e["eoi_token_id"]

    def prepare(self, image, what: str = "image") -> tuple[bytes, Patches | None]:
        """(the picture's identity, its patches), or (identity, None) when it is cached: the cheap half of encode,
        which tells how many soft tokens the image will take before the vision model runs."""
        img = load_image(image, what, self.max_pixels)
        e = self.entry
        digest = image_identity(img, e["image_tokens"], e["patch_size"], e["pooling_kernel_size"])
        if digest in self.cache:
            return digest, None
        return digest, preprocess(
            img, e["image_tokens"], e["patch_size"], e["pooling_kernel_size"], what, self.max_pixels
        )

    def _count(self, patches: Patches) -> int:
        return patches.soft_tokens

    def _run(self, patches: Patches) -> np.ndarray:
        e = self.entry
        x = encoder_inputs(patches, self.table, e["head_dim"], e["rope_theta"], e["pooling_kernel_size"])
        out = np.asarray(self.package.predict(FUNCTION, x, None)["image_embeds"], np.float32)
        return out[0, : patches.soft_tokens]


class AudioEncoder(CachingEncoder):
    """`encode(clip)`: a clip (a path, a file's bytes, or float samples at 16 kHz) as SoftTokens, through the audio
    model's function for the shortest bucket that holds it (`packages`: function -> the package running it); the
    newest results kept by identity (audio_identity). A clip longer than the largest bucket is refused, not split:
    transformers encodes one clip in one pass, its attention reaching back across what a split would cut, so two
    halves would not be the clip's soft tokens (and the bundle's largest bucket is 30 s, transformers' own cap)."""

    kind, model = "audio", "audio"

    def __init__(self, packages: dict, entry: dict):
        super().__init__()
        self.packages, self.entry = packages, entry
        self.buckets = entry["buckets"]

    @property
    def token_ids(self) -> tuple[int, int, int]:
        """(begin-of-audio, audio placeholder, end-of-audio) ids of this bundle's tokenizer."""
        e = self.entry
        return e["boa_token_id"], e["audio_token_id"], e["eoa_token_id"]

    @property
    def max_seconds(self) -> float:
        """The longest clip the largest bucket holds: frames whose analysis windows end inside the clip."""
        frames = self.buckets[-1]
        return min((frames * audio.HOP_LENGTH + audio.FRAME_LENGTH // 2) / audio.SAMPLE_RATE, audio.MAX_SECONDS)

    def prepare(self, clip, what: str = "audio") -> tuple[bytes, audio.Features | None]:
        """(the clip's identity, its features padded to its bucket), or (identity, None) when it is cached: the
        cheap half of encode, which tells how many soft tokens the clip will take before the audio model runs."""
        samples = load_audio(clip, what, audio.MAX_SECONDS)
        frames = audio.num_frames(len(samples))
        bucket = next((b for b in self.buckets if b >= frames), None)
        if bucket is None:
            raise AudioError(
                f"{what}: {len(samples) / audio.SAMPLE_RATE:.2f} s long; this bundle's audio model takes clips of up "
                f"to {self.max_seconds:.2f} s (split it into shorter clips, each its own part)"
            )
        digest = audio_identity(samples)
        if digest in self.cache:
            return digest, None
        return digest, audio.preprocess(samples, bucket, what)

    def _count(self, features: audio.Features) -> int:
        return features.soft_tokens

    def _run(self, features: audio.Features) -> np.ndarray:
        function = audio_function(len(features.mask), self.buckets)
        x = {"input_features": features.features[None], "input_features_mask": features.mask[None].astype(np.float32)}
        out = np.asarray(self.packages[function].predict(function, x, None)["audio_embeds"], np.float32)
        return out[0, : features.soft_tokens]


def open_image_encoder(bundle: Bundle, device: Device, max_pixels: int = MAX_PIXELS):
    """The bundle's image encoder (taking images of at most max_pixels), or None when model_config.json states no
    vision model."""
    if max_pixels < 1:
        raise InputError(f"max_image_pixels={max_pixels}: must be >= 1")
    vision = bundle.config.vision
    if vision is None:
        return None
    package = open_one_function(bundle, "vision", FUNCTION, "a vision model", device)
    path = bundle.root / vision.position_table
    table = load_npy(path)
    width = package.interfaces[FUNCTION]["inputs"]["position_embeddings"]["shape"][-1]
    need = (2, vision.image_tokens * vision.pooling_kernel_size, width)
    if table.shape != need:
        raise BundleError(f"{path}: shape {table.shape}, expected {need} (x and y rows the budget reaches)")
    return ImageEncoder(package, table, bundle.config.raw["vision"], max_pixels)


def open_audio_encoder(bundle: Bundle, device: Device):
    """The bundle's audio encoder, or None when model_config.json states no audio model. Every bucket's function
    must be in the package with the bucket's input shape. The MIL executor loads a package's functions together
    (one copy of the weights); Core ML loads one function per model, so each bucket gets its own."""
    entry = bundle.config.audio
    if entry is None:
        return None
    buckets = entry.buckets
    functions = [audio_function(frames, buckets) for frames in buckets]
    first = open_one_function(bundle, "audio", functions[-1], "an audio model", device)
    shared = device.backend == "mil"
    packages = {
        f: first if shared or f == functions[-1] else open_one_function(bundle, "audio", f, "an audio model", device)
        for f in functions
    }
    for frames, f in zip(buckets, functions):
        io = first.interfaces.get(f)
        shape = io and io["inputs"].get("input_features", {}).get("shape")
        if shape is None or list(shape) != [1, frames, entry.mel_bins]:
            raise BundleError(
                f"{bundle.root}: the audio model has no function {f!r} taking (1, {frames}, {entry.mel_bins}) "
                f"features ({layout.MODEL_CONFIG}'s audio.buckets states a bucket of {frames} frames)"
            )
    return AudioEncoder(packages, bundle.config.raw["audio"])


# -- prompts with media ----------------------------------------------------------------------------------------


def media_sources(messages: list) -> list[tuple[str, str, object]]:
    """(part type, where, source) of every media part in `messages`, in the order the chat template renders their
    placeholders: {"type": "image", "image": path, bytes or PIL image} (or "path"), and OpenAI's
    {"type": "image_url", "image_url": {"url": "data:..."}}, both of type "image"; {"type": "audio", "audio": path,
    bytes or float samples at 16 kHz} (or "path"), and OpenAI's {"type": "input_audio", "input_audio": {"data":
    BASE64, "format": "wav"}}, both of type "audio"."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind, where = part.get("type") if isinstance(part, dict) else None, f"messages[{i}].content[{j}]"
            if kind in OTHER_MEDIA:
                raise ImageError(f"{where}: {kind} input is not supported (text, images and audio only)")
            if kind == "image":
                source = part.get("image", part.get("path"))
                if source is None:
                    raise ImageError(f"{where}: an image part needs 'image' (a path, bytes or a PIL image)")
                found.append(("image", where, source))
            elif kind == "image_url":
                url = part.get("image_url")
                found.append(("image", where, data_url_bytes(url.get("url") if isinstance(url, dict) else url, where)))
            elif kind == "audio":
                source = part.get("audio", part.get("path"))
                if source is None:
                    raise AudioError(f"{where}: an audio part needs 'audio' (a path, bytes or 16 kHz samples)")
                found.append(("audio", where, source))
            elif kind == "input_audio":
                found.append(("audio", where, input_audio_bytes(part.get("input_audio"), f"{where}.input_audio")))
    return found


def expand_media(ids: list[int], marks: list[int], encoders: dict[str, MediaEncoder], sources: list, context: int):
    """The prompt with each placeholder (one id, as the template renders it) replaced by its encoder's begin id,
    the source's soft-token keys and its end id, as transformers' processor expands it; `marks` (positions in
    `ids`) moved with it. `sources` are media_sources' and `encoders` are keyed by their part type. Returns (ids,
    marks, {key: row} for the engine). A prompt longer than `context` is refused before anything is encoded."""
    for kind, where, _ in sources:
        if kind not in encoders:
            raise ERROR_OF[kind](f"{where}: this bundle has no {MODEL_OF[kind]} (converted without one)")
    by_placeholder = {e.token_ids[1]: e for e in encoders.values()}
    for placeholder, e in by_placeholder.items():
        n = sum(kind == e.kind for kind, _, _ in sources)
        if ids.count(placeholder) != n:
            raise ERROR_OF.get(e.kind, ImageError)(
                f"the prompt holds {ids.count(placeholder)} {e.kind} placeholder(s) for {n} {e.kind}(s)"
            )
    prepared = [encoders[kind].prepare(source, where) for kind, where, source in sources]
    n = len(ids) + sum(encoders[s[0]].soft_tokens(p) + 1 for s, p in zip(sources, prepared))  # + begin, end - one
    if n > context:
        media = " and ".join(sorted({kind for kind, _, _ in sources}))  # only what this prompt holds
        included = f" ({media} included)" if media else ""
        raise ContextOverflow(f"prompt of {n} tokens{included} exceeds the context of {context}")
    queues = {kind: [] for kind in encoders}  # each part type's soft tokens, in prompt order
    for (kind, where, source), p in zip(sources, prepared):
        queues[kind].append(encoders[kind].encode(source, where, p))
    out, moved, soft = [], {}, {}
    for p, t in enumerate(ids):
        moved[p] = len(out)
        if t not in by_placeholder:
            out.append(t)
            continue
        begin, _, end = by_placeholder[t].token_ids
        tokens = queues[by_placeholder[t].kind].pop(0)
        out += [begin, *tokens.keys, end]
        soft.update(zip(tokens.keys, tokens.rows))
    return out, [moved[m] for m in marks], soft

"""The host side of a step, in numpy: int8 embedding rows, RoPE rows and additive masks.

The chunks take these as inputs (CONTRACT §3) so that nothing position-dependent is baked into the
Core ML program. Used by the converter (to write sidecars), the graph runner and the runtime.
"""

from __future__ import annotations

import numpy as np

from .spec import ModelSpec

# The additive value of a blocked mask entry. Not -inf, and not fp16's limit -65504: the Neural Engine
# mishandles -inf in softmax, and score + (-65504) is already -inf in fp16 for any score below -16.
# With -40000 (exact in fp16) every intermediate of `softmax(scores + mask)` stays finite while the
# scores lie within +-MASK_SCORE_BOUND: the sum stays above -65504, and so does its difference from
# the row's max, which max-subtracting softmax computes. A blocked entry still weighs exactly 0:
# exp() of anything below -17.4 is 0 in fp16, and it sits >= 40000 - 2 * bound below the max.
# Gemma 4 normalizes q and k (RMSNorm times a learned scale) before q.k, so scores are
# |q||k|-bounded, orders of magnitude inside the bound.
MASK_BLOCKED = np.float16(-40000.0)
MASK_SCORE_BOUND = (65504 + int(MASK_BLOCKED)) // 2  # 12752: the |score| every blocked entry tolerates


# -- int8 per-row tables (CONTRACT §2) ------------------------------------------------------------


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8: scale = fp16(max|row|); q = clamp(round(w*127/scale), -127, 127)."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=1).astype(np.float16)
    s32 = scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, np.float32(1.0))
    q = np.clip(np.rint(w * (np.float32(127.0) / safe)[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray, multiplier: float) -> np.ndarray:
    """value = q * scale/127 * multiplier, in float32 (the embed scale folded into one factor)."""
    factor = scale.astype(np.float32) * np.float32(multiplier / 127.0)
    return q.astype(np.float32) * factor[..., None]


# -- RoPE ---------------------------------------------------------------------------------------


def rope_table(inv_freq: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [rows, d] exactly as transformers builds them: angle = pos * inv_freq, split-half."""
    pos = np.arange(rows, dtype=np.float32)[:, None]
    freqs = pos * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rope_tables(spec: ModelSpec, rows: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{'sliding_attention': (cos, sin), 'full_attention': (cos, sin)} for positions [0, rows)."""
    return {t: rope_table(r.inv_freq(), rows) for t, r in spec.rope.items()}


def rotated_pairs(cos: np.ndarray, sin: np.ndarray) -> int:
    """How many split-half pairs a table actually rotates (sin != 0 somewhere in the column)."""
    half = cos.shape[-1] // 2
    moving = np.any(np.asarray(sin[:, :half], np.float32) != 0, axis=0)
    return int(moving.sum())


# -- masks (CONTRACT §3) ----------------------------------------------------------------------------


def full_mask(p0: int, T: int, context: int, dtype=np.float16) -> np.ndarray:
    """Linear cache, slot = position: row t (position p0+t) sees slots i <= p0+t."""
    rows = p0 + np.arange(T)[:, None]
    allowed = np.arange(context)[None, :] <= rows
    return np.where(allowed, 0, MASK_BLOCKED).astype(dtype)[None, None]


def sliding_mask(p0: int, T: int, window: int, dtype=np.float16, ring: int | None = None) -> np.ndarray:
    """Ring of `ring` slots (default: the window), written at (p mod ring) before attending.

    Row t (position p = p0+t) may see slot s iff the slot holds a position q with p-window < q <= p.
    After the batch's writes a slot holds the newest position congruent to s that has been written,
    which is exact only when the batch does not overwrite a slot an earlier row still needs: the
    runner guarantees that (T == 1, the batch ends inside the first pass of the ring, or the ring
    has T - 1 slots beyond the window). Rows written past p0+T-1 earlier (rejected drafts) sit in
    slots this formula dates ring positions back: both dates lie outside every row's window.
    """
    ring = ring or window
    last = p0 + T - 1
    slots = np.arange(ring)
    # newest written position in each slot after the batch, or -1 for never written
    held = last - ((last - slots) % ring)
    held = np.where(held >= 0, held, -1)
    p = p0 + np.arange(T)[:, None]
    allowed = (held[None, :] >= 0) & (held[None, :] <= p) & (held[None, :] > p - window)
    return np.where(allowed, 0, MASK_BLOCKED).astype(dtype)[None, None]


def kv_sliding_mask(p0: int, T: int, window: int, dtype=np.float16, ring: int | None = None) -> np.ndarray:
    """KV-only prefill: row t (position p0+t) attends over [ring as it was before the batch | the
    batch]. A ring column is valid iff its slot holds a position in (p0+t-window, p0-1]; a batch
    column j iff j <= t. Shape (1, 1, T, ring + T)."""
    ring = ring or window
    last = p0 - 1
    slots = np.arange(ring)
    held = last - ((last - slots) % ring) if last >= 0 else np.full(ring, -1)
    t = np.arange(T)[:, None]
    ring = (held[None, :] >= 0) & (held[None, :] > p0 + t - window)
    batch = np.arange(T)[None, :] <= t
    allowed = np.concatenate([ring, batch], axis=1)
    return np.where(allowed, 0, MASK_BLOCKED).astype(dtype)[None, None]

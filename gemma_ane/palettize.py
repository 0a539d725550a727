"""Our k-means LUT palettizer, and the MIL pass that puts its result into a converted program.

coremltools' kmeans mode runs one scikit-learn KMeans per group of 32 output channels: ~6.5 s for
one 6144x1536 weight here, hours for E2B. 1-D k-means over fp16 weights has structure we can use:
a group has at most 65536 distinct values, so it is fully described by a histogram over the fp16
codes. With prefix sums of counts and of values over that histogram, a Lloyd step is a binary
search for the cluster boundaries and a few differences, for all groups at once; the cost is one
pass over the weight plus O(groups * 65536). The output is the exact representation coremltools
writes for `per_grouped_channel` palettization on iOS18 (`constexpr_lut_to_dense` with a
[groups, 1, 2^bits, 1] LUT and uint-n indices), so Core ML loads it unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

_CODES = 1 << 16


def _fp16_order():
    """Order-preserving key for every fp16 bit pattern, and each key's value (non-finite keys are
    clamped to the finite range: they hold no weights, but the value table must stay sorted)."""
    bits = np.arange(_CODES, dtype=np.uint32)
    key = np.where(bits & 0x8000, 0xFFFF - bits, bits | 0x8000).astype(np.int32)
    raw = bits.astype(np.uint16).view(np.float16).astype(np.float64)
    raw = np.where(np.isnan(raw), np.where(bits & 0x8000, -np.inf, np.inf), raw)  # NaNs sort outside +-inf
    values = np.empty(_CODES, np.float64)
    values[key] = np.clip(raw, -65504.0, 65504.0)
    return key, torch.from_numpy(values)


_KEY_NP, _VALUES = _fp16_order()


def kmeans_lut(weight: np.ndarray, nbits: int = 4, group_size: int = 32, max_iter: int = 300):
    """LUT-quantize a [out, in] weight (as the fp16 values a program stores) per group of
    `group_size` output channels.

    Returns (lut fp16 [groups, 1, 2^nbits, 1], indices uint8 [out, in]). Deterministic: the
    centroids start at each group's quantiles and Lloyd iterations run to a fixed point.
    """
    w16 = np.ascontiguousarray(weight, dtype=np.float16)
    if not np.isfinite(w16).all():
        raise ValueError("weight has non-finite values in fp16")
    out, cols = w16.shape
    if out % group_size:
        raise ValueError(f"{out} output channels are not divisible by group_size {group_size}")
    k, G, n = 1 << nbits, out // group_size, group_size * cols
    # one flat bin per (group, code): a single bincount builds every group's histogram
    flat = torch.from_numpy(_KEY_NP[w16.view(np.uint16).reshape(G, n)] + (np.arange(G, dtype=np.int32) * _CODES)[:, None])
    counts = torch.bincount(flat.reshape(-1), minlength=G * _CODES).reshape(G, _CODES)
    # prefix[g, j] = total over the j smallest codes (count, and sum of values)
    ccount = torch.zeros(G, _CODES + 1, dtype=torch.int64)
    csum = torch.zeros(G, _CODES + 1, dtype=torch.float64)
    torch.cumsum(counts, dim=1, out=ccount[:, 1:])
    torch.cumsum(counts * _VALUES, dim=1, out=csum[:, 1:])

    def stats(edges):  # per cluster (count, sum) between consecutive code edges
        c = torch.gather(ccount, 1, edges)
        s = torch.gather(csum, 1, edges)
        return c[:, 1:] - c[:, :-1], s[:, 1:] - s[:, :-1]

    targets = ((torch.arange(k) + 0.5) * n / k).long().expand(G, k).contiguous()
    centroids = _VALUES[torch.searchsorted(ccount[:, 1:].contiguous(), targets).clamp_max(_CODES - 1)]
    lo, hi = torch.zeros(G, 1, dtype=torch.long), torch.full((G, 1), _CODES)
    for _ in range(max_iter):
        mids = (centroids[:, 1:] + centroids[:, :-1]) / 2
        edges = torch.cat([lo, torch.searchsorted(_VALUES, mids, right=True), hi], dim=1)
        cnt, tot = stats(edges)
        updated = torch.where(cnt > 0, tot / cnt.clamp_min(1), centroids)
        updated = torch.sort(updated, dim=1).values
        if torch.equal(updated, centroids):
            break
        centroids = updated
    lut = centroids.to(torch.float16)
    # Assign against the fp16 LUT actually stored, so every weight maps to its nearest stored value:
    # mark each group's boundaries on the code axis, and a cumulative sum labels every code.
    lut64 = lut.double()
    bounds = torch.searchsorted(_VALUES, (lut64[:, 1:] + lut64[:, :-1]) / 2, right=True)
    marks = torch.zeros(G, _CODES + 1, dtype=torch.int16).scatter_add_(1, bounds, torch.ones_like(bounds, dtype=torch.int16))
    cluster_of_code = torch.cumsum(marks[:, :_CODES], dim=1).to(torch.uint8)
    indices = cluster_of_code.reshape(-1)[flat.reshape(-1).long()].reshape(out, cols).numpy()
    return lut.numpy().reshape(G, 1, k, 1), indices


def lut_to_dense(lut: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The inverse, as constexpr_lut_to_dense computes it for per-grouped-channel LUTs (axis 0)."""
    groups, k = lut.shape[0], lut.shape[2]
    rows_per_group = indices.shape[0] // groups
    table = lut.reshape(groups, k)
    group_of_row = np.arange(indices.shape[0]) // rows_per_group
    return table[group_of_row[:, None], indices]


def snr_db(reference: np.ndarray, approx: np.ndarray) -> float:
    reference = np.asarray(reference, np.float64)
    noise = reference - np.asarray(approx, np.float64)
    return float(10 * np.log10((reference**2).sum() / max((noise**2).sum(), 1e-300)))

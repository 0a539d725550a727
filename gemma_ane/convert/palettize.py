"""Our k-means LUT palettizer, and the MIL pass that puts its result into a converted program.

coremltools' kmeans mode runs one scikit-learn KMeans per group of 32 output channels: ~6.5 s for
one 6144x1536 weight here, hours for E2B. 1-D k-means over fp16 weights has structure we can use:
a group has at most 65536 distinct values, so it is fully described by a histogram over the fp16
codes. With prefix sums of counts, values and squares over that histogram, a Lloyd step is a
binary search for the cluster boundaries and a few differences, for all groups at once; the cost
is one pass over the weight plus O(groups * codes present). The output is the exact representation coremltools
writes for `per_grouped_channel` palettization on iOS18 (`constexpr_lut_to_dense` with a
[groups, 1, 2^bits, 1] LUT and uint-n indices), so Core ML loads it unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConversionError

_CODES = 1 << 16


def _search(sorted_values: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """Codes with value <= x, per element. (torch.searchsorted broadcasts a 1-D sequence to
    every row first: 100x slower here than numpy's.)"""
    return torch.from_numpy(np.searchsorted(sorted_values, x.numpy(), side="right"))


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


def kmeans_lut(
    weight: np.ndarray,
    nbits: int = 4,
    group_size: int = 32,
    max_iter: int = 300,
    block_bins: int = 1 << 24,
    block_values: int = 1 << 23,
):
    """LUT-quantize a [out, in] weight (as the fp16 values a program stores) per group of
    `group_size` output channels.

    Returns (lut fp16 [groups, 1, 2^nbits, 1], indices uint8 [out, in]). Deterministic (no random
    seeding): centroids start at an optimal-quantizer spacing of each group's distribution, Lloyd
    iterations run to a fixed point, and empty clusters are re-seeded where the error is largest.
    """
    w16 = np.ascontiguousarray(weight, dtype=np.float16)
    if not np.isfinite(w16).all():
        raise ConversionError("weight has non-finite values in fp16")
    out, cols = w16.shape
    if out % group_size:
        raise ConversionError(f"{out} output channels are not divisible by group_size {group_size}")
    # Groups are independent: run them in blocks so the [groups, codes] prefix tables stay within
    # `block_bins` entries (the LM head has 8192 groups; all at once would need ~6 GB).
    present = np.zeros(_CODES, bool)
    for r in range(0, out, max(1, (1 << 22) // cols)):  # in blocks: bincount's int64 copy of the LM head is GBs
        present |= np.bincount(w16[r : r + max(1, (1 << 22) // cols)].view(np.uint16).reshape(-1), minlength=_CODES) > 0
    # ... and so that a block's per-weight temporaries (~21 bytes a weight) stay within `block_values` weights: a
    # weight born in bf16 has few distinct fp16 codes, and the bins bound alone let a block take half the LM head
    # (~4 GB of temporaries, measured as the converter's peak). Blocks hold whole groups: the result is the same.
    per_block = max(1, min(block_bins // int(present.sum()), block_values // (group_size * cols))) * group_size
    if out <= per_block:
        return _kmeans_block(w16, nbits, group_size, max_iter)
    # each block's result written in place: a list of blocks to concatenate would hold the indices twice
    lut, indices = np.empty((out // group_size, 1, 1 << nbits, 1), np.float16), np.empty((out, cols), np.uint8)
    for r in range(0, out, per_block):
        lut[r // group_size : (r + per_block) // group_size], indices[r : r + per_block] = _kmeans_block(
            w16[r : r + per_block], nbits, group_size, max_iter
        )
    return lut, indices


def _kmeans_block(w16: np.ndarray, nbits: int, group_size: int, max_iter: int):
    out, cols = w16.shape
    k, G, n = 1 << nbits, out // group_size, group_size * cols
    # Only the fp16 codes that occur anywhere in the weight get a bin (typically a third of them);
    # one flat bin per (group, code) then lets a single bincount build every group's histogram.
    codes = w16.view(np.uint16).reshape(G, n)
    present = np.zeros(_CODES, bool)  # by order key
    present[_KEY_NP] = np.bincount(codes.reshape(-1), minlength=_CODES) > 0
    local = (np.cumsum(present) - 1).astype(np.int32)
    C = int(present.sum())
    values = _VALUES[torch.from_numpy(present)]
    values_np = values.numpy()
    # each weight's bin, its code's rank among the codes present (one gather through a 64 K-entry table)
    flat = torch.from_numpy(local[_KEY_NP][codes] + (np.arange(G, dtype=np.int32) * C)[:, None])
    counts = torch.bincount(flat.reshape(-1), minlength=G * C).reshape(G, C)
    # prefix[g, j] = total over the j smallest codes (count, and sum of values)
    ccount = torch.zeros(G, C + 1, dtype=torch.int64)
    csum = torch.zeros(G, C + 1, dtype=torch.float64)
    torch.cumsum(counts, dim=1, out=ccount[:, 1:])
    torch.cumsum(counts * values, dim=1, out=csum[:, 1:])

    csq = torch.zeros(G, C + 1, dtype=torch.float64)
    torch.cumsum(counts * values * values, dim=1, out=csq[:, 1:])

    def stats(edges):  # per cluster (count, sum) between consecutive code edges
        c = torch.gather(ccount, 1, edges)
        s = torch.gather(csum, 1, edges)
        return c[:, 1:] - c[:, :-1], s[:, 1:] - s[:, :-1]

    lo, hi = torch.zeros(G, 1, dtype=torch.long), torch.full((G, 1), C)

    def lloyd(centroids):
        for _ in range(max_iter):
            mids = (centroids[:, 1:] + centroids[:, :-1]) / 2
            edges = torch.cat([lo, _search(values_np, mids), hi], dim=1)
            cnt, tot = stats(edges)
            updated = torch.sort(torch.where(cnt > 0, tot / cnt.clamp_min(1), centroids), dim=1).values
            if torch.equal(updated, centroids):
                break
            centroids = updated
        return centroids, edges

    # Start where an optimal quantizer puts its levels: point density ~ p(x)^(1/3) (Panter-Dite),
    # with p estimated between 256 quantiles of the group (per-code counts are too sparse for it).
    # Lloyd from plain quantiles starves the tails and settles ~1.5 dB worse at 6 bits.
    M = 256
    marks = (torch.arange(M + 1, dtype=torch.float64) / M * (n - 1)).round().long().expand(G, M + 1).contiguous()
    q = values[torch.searchsorted(ccount[:, 1:].contiguous(), marks + 1).clamp_max(C - 1)]
    step = torch.diff(q, dim=1).clamp_min(0)
    mass = torch.cumsum(step ** (2.0 / 3.0), dim=1)  # integral of p^(1/3) with p = (1/M) / step
    mass = torch.nn.functional.pad(mass, (1, 0))
    targets = ((torch.arange(k, dtype=torch.float64) + 0.5) / k * mass[:, -1:]).contiguous()
    b = torch.searchsorted(mass, targets).clamp(1, M)
    m0, m1 = torch.gather(mass, 1, b - 1), torch.gather(mass, 1, b)
    q0, q1 = torch.gather(q, 1, b - 1), torch.gather(q, 1, b)
    centroids = q0 + (q1 - q0) * ((targets - m0) / (m1 - m0).clamp_min(1e-300)).clamp(0, 1)
    centroids, edges = lloyd(torch.sort(centroids, dim=1).values)
    # Lloyd leaves a centroid that lost all its points where it is; move each empty one into the
    # cluster with the largest squared error (half a std above its mean) and settle again.
    for _ in range(k):
        cnt, tot = stats(edges)
        empty = cnt == 0
        if not empty.any():
            break
        g = empty.any(dim=1).nonzero().squeeze(1)
        sq = torch.gather(csq, 1, edges)
        sq = sq[:, 1:] - sq[:, :-1]
        mean = tot / cnt.clamp_min(1)
        err = sq - tot * mean
        big = err[g].argmax(dim=1)
        std = torch.sqrt((err[g, big] / cnt[g, big].clamp_min(1)).clamp_min(0))
        centroids[g, empty[g].long().argmax(dim=1)] = mean[g, big] + 0.5 * std + 1e-9
        centroids, edges = lloyd(torch.sort(centroids, dim=1).values)
    lut = centroids.to(torch.float16)
    # Assign against the fp16 LUT actually stored, so every weight maps to its nearest stored value:
    # mark each group's boundaries on the code axis, and a cumulative sum labels every code.
    lut64 = lut.double()
    bounds = _search(values_np, (lut64[:, 1:] + lut64[:, :-1]) / 2)
    marks = torch.zeros(G, C + 1, dtype=torch.int16).scatter_add_(1, bounds, torch.ones_like(bounds, dtype=torch.int16))
    cluster_of_code = torch.cumsum(marks[:, :C], dim=1).to(torch.uint8)
    indices = torch.index_select(cluster_of_code.reshape(-1), 0, flat.reshape(-1)).reshape(out, cols).numpy()
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

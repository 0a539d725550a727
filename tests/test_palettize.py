"""Our k-means LUT palettizer against coremltools' own kmeans palettization on the same weights."""

import numpy as np
import pytest

from gemma_ane.convert.palettize import kmeans_lut, lut_to_dense, snr_db


def coremltools_kmeans(w: np.ndarray, nbits: int, group_size: int) -> np.ndarray:
    from coremltools.optimize.coreml._quantization_passes import palettize_weights

    params = palettize_weights.grouped_channelwise_compress(w, "KMEANS", nbits, 0, group_size)
    return palettize_weights.decompress(params)


def weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    # a trained layer's rows have different scales and heavy tails: Student-t rows, scaled
    w = rng.standard_t(5, size=shape) * rng.uniform(0.01, 0.05, size=(shape[0], 1))
    return w.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("nbits", [4, 6])
def test_snr_at_least_coremltools(nbits):
    w = weights((256, 1536))
    lut, idx = kmeans_lut(w, nbits, 32)
    ours = snr_db(w, lut_to_dense(lut, idx))
    theirs = snr_db(w, coremltools_kmeans(w, nbits, 32))
    assert ours >= theirs - 0.1, (ours, theirs)


def test_layout_is_coremltools_per_grouped_channel():
    w = weights((96, 64), seed=1)
    lut, idx = kmeans_lut(w, 4, 32)
    assert lut.shape == (3, 1, 16, 1) and lut.dtype == np.float16
    assert idx.shape == (96, 64) and idx.max() <= 15
    # every weight maps to its nearest stored LUT entry
    table = lut.reshape(3, 16).astype(np.float64)
    nearest = np.abs(w.reshape(3, 32, 64, 1) - table[:, None, None, :]).argmin(-1).reshape(96, 64)
    dense = lut_to_dense(lut, idx)
    np.testing.assert_allclose(np.abs(dense - w), np.abs(lut_to_dense(lut, nearest.astype(np.uint8)) - w), atol=1e-7)


def test_deterministic_and_edge_cases():
    w = weights((64, 128), seed=2)
    a, b = kmeans_lut(w), kmeans_lut(w.copy())
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    few = np.repeat(np.array([[-1.0, 0.5, 2.0]], np.float32), 32, axis=0)  # 3 distinct values < 16
    lut, idx = kmeans_lut(few)
    np.testing.assert_array_equal(lut_to_dense(lut, idx), few)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        kmeans_lut(np.zeros((33, 8), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        kmeans_lut(np.full((32, 8), np.inf, np.float32))


def test_blocks_bound_the_temporaries_and_change_nothing(monkeypatch):
    """A weight born in bf16 has few distinct fp16 codes (3,794 in a random E2B-scale head), so bounding blocks by
    histogram bins alone let one block take half the LM head: 4.1 GB of temporaries, the converter's peak (0.6 GB
    with the bound). Blocks of whole groups give the same LUTs and indices as one block."""
    from gemma_ane.convert import palettize

    w = np.random.default_rng(3).standard_normal((4096, 256), np.float32) * 0.02
    w = ((w.view(np.uint32) + 0x8000) & 0xFFFF0000).view(np.float32).astype(np.float16)  # rounded to bf16
    whole = kmeans_lut(w, 4, 32, block_values=1 << 40)
    blocks = []
    block = palettize._kmeans_block
    monkeypatch.setattr(palettize, "_kmeans_block", lambda w16, *a: blocks.append(w16.shape) or block(w16, *a))
    bounded = kmeans_lut(w, 4, 32, block_values=1 << 16)
    assert len(blocks) > 1 and max(r * c for r, c in blocks) <= 1 << 16
    assert np.array_equal(whole[0], bounded[0]) and np.array_equal(whole[1], bounded[1])

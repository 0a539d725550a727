"""E2B's real geometry: window 512, context 2048, 35 layers with 20 KV-shared. The other presets use
windows of 8-16, so only here do the ring and mask arithmetic run at the sizes a real model uses."""

import numpy as np
import pytest

from gemma_ane.bundle.host import kv_sliding_mask, sliding_mask
from gemma_ane.convert.checkpoint import Checkpoint
from gemma_ane.oracle.verify import FP16_MIN_COSINE, FP16_MIN_TOP1, compare, oracle_logits, oracle_model, random_ids

WINDOW, CONTEXT = 512, 2048


def _ring_after(p_end: int) -> np.ndarray:
    """The position each ring slot holds once positions [0, p_end) were written at p % WINDOW (-1: empty)."""
    held = np.full(WINDOW, -1)
    for p in range(p_end):
        held[p % WINDOW] = p
    return held


@pytest.mark.parametrize("p0,T", [(0, 8), (504, 8), (511, 1), (512, 1), (513, 1), (1023, 1), (1024, 1), (2047, 1)])
def test_sliding_mask_sees_exactly_the_window(p0, T):
    held = _ring_after(p0 + T)  # write-then-attend: the batch is in the ring
    seen = sliding_mask(p0, T, WINDOW)[0, 0] == 0
    for t in range(T):
        p = p0 + t
        assert sorted(held[seen[t]]) == list(range(max(0, p - WINDOW + 1), p + 1)), (p0, T, t)


@pytest.mark.parametrize("p0,T", [(0, 64), (448, 64), (512, 64), (960, 64), (1984, 64)])
def test_kv_prefill_mask_sees_exactly_the_window(p0, T):
    held = _ring_after(p0)  # attend-then-write: the ring as it was, then the batch beside it
    seen = kv_sliding_mask(p0, T, WINDOW)[0, 0] == 0
    cols = np.concatenate([held, p0 + np.arange(T)])
    for t in range(T):
        p = p0 + t
        assert sorted(cols[seen[t]]) == list(range(max(0, p - WINDOW + 1), p + 1)), (p0, T, t)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """The e2b-narrow checkpoint and its 16-bit bundle at context 2048 (one KV-only prefill size,
    to keep the conversion short)."""
    from gemma_ane.convert import ConvertOptions, convert
    from gemma_ane.oracle.tiny import write_tiny

    root = tmp_path_factory.mktemp("narrow")
    ckpt = write_tiny(root / "ckpt", preset="e2b-narrow")
    convert(
        str(ckpt),
        str(root / "bundle"),
        ConvertOptions(context=CONTEXT, bits=16, vision=False, kv_prefill_batches=(64,)),
        progress=False,
    )
    return ckpt, root / "bundle"


@pytest.mark.slow
def test_bundle_tracks_transformers_across_the_ring(narrow):
    """Prompt 560 (prefill batches inside the first ring pass, then single steps that wrap it),
    teacher-forced decode to 600: every position against transformers. (Past 1024, the second
    wrap, is test_kv_only_prefill_past_the_window's: batches get there in a fraction of the time.)"""
    from gemma_ane.oracle.verify import verify_bundle

    r = verify_bundle(*narrow, tokens=600, precision="fp16", seed=0, prompt_len=560)
    print(f"\nbundle, 600 positions: top-1 {r['top1_agreement']:.4f}, min cosine {r['min_cosine']:.5f}")
    assert (r["context"], r["window"]) == (CONTEXT, WINDOW)
    assert r["top1_agreement"] >= FP16_MIN_TOP1 and r["min_cosine"] >= FP16_MIN_COSINE, r


@pytest.mark.slow
def test_kv_only_prefill_past_the_window(narrow):
    """A 1040-token prompt through KV-only prefill (no logits, the ring overwritten by whole
    batches), then decode to 1100: the first logits it gives and every one after match transformers."""
    from gemma_ane.bundle import open_bundle
    from gemma_ane.runtime.backend import open_engine
    from gemma_ane.runtime.device import Device

    src, bundle = narrow
    ckpt = Checkpoint(src)
    engine = open_engine(open_bundle(bundle, check=False), Device.of("mil", "fp16"))
    ids = random_ids(ckpt.spec, 1100, seed=0)
    ours = engine.feed(ids[:1040], logits="last")
    assert [f for _, f, _ in engine.history].count("prefill_kv_b64") == 16  # positions 0-1023 without a head
    ours += [engine.feed([t], logits="last")[0] for t in ids[1040:]]
    tables = {k: np.asarray(getattr(engine.host, k)) for k in ("embed_q", "embed_scales", "ple_q", "ple_scales")}
    r = compare(np.stack(ours), oracle_logits(oracle_model(ckpt, tables), ids)[1039:])
    print(f"\nKV-only prefill, positions 1039-1099: top-1 {r['top1_agreement']:.4f}, min cosine {r['min_cosine']:.5f}")
    assert r["top1_agreement"] >= FP16_MIN_TOP1 and r["min_cosine"] >= FP16_MIN_COSINE, r

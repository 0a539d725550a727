"""The published layout: argmax head, fp32 PLE norm file, all-pairs RoPE tables, no manifest.
We reproduce it with `convert --layout published` and check that the runtime detects and runs it."""

import warnings

import numpy as np
import pytest

import gemma_ane
from gemma_ane.bundle import BundleError
from gemma_ane.bundle.host import rotated_pairs

pytestmark = pytest.mark.slow  # every test here converts a bundle or runs a pipeline


@pytest.fixture(scope="module")
def bundles(tiny_published, tiny_bundle16):
    return tiny_published, tiny_bundle16


def test_layout_is_the_published_one(bundles):
    pub, _ = bundles
    assert not (pub / "manifest.json").exists()
    assert (pub / "per_layer_norm_weight.bin").stat().st_size == 16 * 4  # fp32, P = 16
    cos, sin = np.load(pub / "cos_full.npy"), np.load(pub / "sin_full.npy")
    assert cos.shape == (8192, 64) and rotated_pairs(cos[:1000], sin[:1000]) == 32  # all pairs, not 8


def test_runtime_detects_and_runs_it_greedy(bundles):
    pub, ours = bundles
    with pytest.warns(UserWarning, match="rotate 32 pairs but the config allows 8"):
        model = gemma_ane.load(pub, backend="mil")
    assert model.head == "token_id"
    ref = gemma_ane.load(ours, backend="mil")
    a = model.generate("Hello there", raw=True, temperature=0, max_tokens=24)
    b = ref.generate("Hello there", raw=True, temperature=0, max_tokens=24)
    # exact RoPE tables replace the published ones, so the argmax head follows our logits head
    assert a.tokens == b.tokens and len(a.tokens) == 24
    with pytest.raises(ValueError, match="sampling and logit_bias are not possible"):
        model.generate("Hello", temperature=0.7, max_tokens=2)
    with pytest.raises(ValueError, match="sampling and logit_bias are not possible"):
        model.generate("Hello", temperature=0, logit_bias={5: -100}, max_tokens=2)  # greedy cannot ban either


def test_published_tables_kept_on_request(bundles):
    pub, _ = bundles
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = gemma_ane.load(pub, backend="mil", exact_rope=False)
    assert any("using them as they are" in str(w.message) for w in caught)
    cos = np.asarray(model.engine.host.rope["full_attention"][0])
    assert rotated_pairs(cos[:1000], np.asarray(model.engine.host.rope["full_attention"][1][:1000])) == 32


def test_bad_norm_file_size(bundles, tmp_path):
    import shutil

    pub, _ = bundles
    bad = tmp_path / "bad"
    shutil.copytree(pub, bad)
    (bad / "per_layer_norm_weight.bin").write_bytes(b"\0" * 10)
    with pytest.raises(BundleError, match="per_layer_norm_weight.bin: 10 bytes"):
        gemma_ane.load(bad, backend="mil")

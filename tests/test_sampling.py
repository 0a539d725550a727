"""The sampler's fp16 fast path against the plain fp32 path, and its ordering primitives."""

import numpy as np
import pytest

from gemma_ane.sampling import Sampler, SamplingParams, _order_key, top_indices


def test_order_key_orders_every_fp16_value_exactly():
    bits = np.arange(65536, dtype=np.uint16)
    values = bits.view(np.float16)
    finite = ~np.isnan(values)
    values, key = values[finite].astype(np.float32), _order_key(bits.view(np.float16))[finite]
    order = np.argsort(key, kind="stable")
    assert np.all(np.diff(values[order]) >= 0)
    # equal keys <=> equal values (only -0 and +0 share a value)
    assert len(np.unique(key)) == len(np.unique(values)) == finite.sum() - 1


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int16])
def test_top_indices_is_value_then_index_order(dtype):
    rng = np.random.default_rng(0)
    for N, n in ((262144, 64), (262144, 1), (5000, 300), (40, 40)):
        x = rng.integers(-50, 50, N).astype(dtype)  # many ties at every boundary
        want = np.lexsort((np.arange(N), -x.astype(np.float64)))[:n]
        assert top_indices(x, n).tolist() == want.tolist(), (N, n)


CASES = {
    "greedy": dict(temperature=0.0),
    "greedy-penalised": dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
    "gemma-defaults-penalised": dict(temperature=1.0, top_k=64, top_p=0.95, repetition_penalty=1.1,
                                     presence_penalty=0.5),
    "top-k-min-p-frequency": dict(temperature=0.7, top_k=40, min_p=0.05, frequency_penalty=1.5),
    "boosting-penalties": dict(temperature=1.2, top_k=8, repetition_penalty=0.5, presence_penalty=-2.0),
    "top-k-1": dict(temperature=2.0, top_k=1, repetition_penalty=2.0),
}


@pytest.mark.parametrize("vocab", [262144, 3000])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_fp16_fast_path_draws_what_fp32_draws(case, vocab):
    rng = np.random.default_rng(1)
    params = SamplingParams(seed=11, **CASES[case])
    history = rng.integers(0, vocab, 40)
    fast, plain = Sampler(params, history), Sampler(params, history)
    tokens = []
    for step in range(60):
        # Quantised to quarter steps: ties everywhere, including at the top-k boundary; the tokens
        # already seen are pushed to the top so the penalties decide what is drawn.
        x = np.round(rng.standard_normal(vocab) * 3 * 4) / 4
        x[list(fast.counts)[:20]] += 8
        x16 = x.astype(np.float16)
        a, b = fast.sample(x16), plain.choose(plain.penalize(x16.astype(np.float32)))
        assert a == b, (case, step)
        fast.observe(a)
        plain.observe(b)
        tokens.append(a)
    assert len(set(tokens)) > 5 or params.temperature == 0.0 or params.top_k == 1


def test_sample_leaves_the_logits_alone():
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float16)
    before = x.copy()
    s = Sampler(SamplingParams(temperature=1.0, top_k=10, repetition_penalty=1.5, seed=0), history=[0, 1, 2])
    s.sample(x)
    s.sample(x.astype(np.float32))
    assert np.array_equal(x, before)

"""The sampler: its distribution against transformers' logits processors, seeded draws against that
distribution, the fp16 fast path against the plain fp32 path, and its ordering primitives."""

import numpy as np
import pytest

from gemma_ane.runtime.sampling import Sampler, SamplingError, SamplingParams, _order_key, top_indices


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


@pytest.mark.parametrize("allowed", [1, 3, 100, 5000])
def test_top_indices_of_a_masked_vocabulary(allowed):
    """Constrained decoding masks all but a few tokens to -inf: the answer is still a full sort's (the
    masked ties by lower index when fewer tokens than asked for are allowed)."""
    rng = np.random.default_rng(allowed)
    x = np.full(262144, -np.inf, np.float16)
    x[rng.choice(len(x), allowed, replace=False)] = rng.standard_normal(allowed)
    for keyed in (x, _order_key(x), x.astype(np.float32)):
        for n in (1, 5, 64):
            want = np.lexsort((np.arange(len(x)), -keyed.astype(np.float64)))[:n]
            assert top_indices(keyed, n).tolist() == want.tolist(), (allowed, n)


CASES = {
    "greedy": dict(temperature=0.0),
    "greedy-penalised": dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
    "gemma-defaults-penalised": dict(
        temperature=1.0, top_k=64, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5
    ),
    "top-k-min-p-frequency": dict(temperature=0.7, top_k=40, min_p=0.05, frequency_penalty=1.5),
    "boosting-penalties": dict(temperature=1.2, top_k=8, repetition_penalty=0.5, presence_penalty=-2.0),
    "top-k-1": dict(temperature=2.0, top_k=1, repetition_penalty=2.0),
    # biases on seen and unseen tokens alike, bans among them: the fast path judges them on their fp32 values
    "greedy-biased": dict(temperature=0.0, logit_bias=dict(zip(range(0, 3000, 150), [4.0, -2.5, -100, 7.5] * 5))),
    "top-k-biased-penalised": dict(
        temperature=1.0,
        top_k=40,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        logit_bias=dict(zip(range(7, 3000, 97), [9.0, -100, -4.0] * 11)),
    ),
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
        a, b = fast.sample(x16), plain.choose(plain.adjust(x16.astype(np.float32)))
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


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_temperature_past_fp32_is_flat_without_a_warning():
    """temperature 1e308 (a float, so accepted) is as flat as fp32's largest: uniform over what top-k keeps, and
    no overflow warning in a server's log."""
    x = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    for t in (1e308, float(np.finfo(np.float32).max)):
        ids, probs = Sampler(SamplingParams(temperature=t, top_k=5, seed=0)).distribution(x)
        assert len(ids) == 5 and np.allclose(probs, 0.2)


# -- the distribution against transformers' own logits processors --------------------------------------------------


def hf_distribution(x, params: SamplingParams, history=()) -> np.ndarray:
    """The probabilities transformers samples from (dense, 0 where cut), by its own processors in the order
    `generate` applies them. Presence and frequency penalties have no transformers processor: they are OpenAI's
    formula, logit - presence * [count > 0] - frequency * count, applied after the repetition penalty as ours."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    seen = torch.tensor([list(history)], dtype=torch.long)
    scores = torch.tensor(np.asarray(x, np.float32))[None]
    if len(history):
        scores = lp.RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(seen, scores)
    ids, counts = np.unique(np.asarray(history, np.int64), return_counts=True)
    scores[0, ids] -= torch.tensor(params.presence_penalty + params.frequency_penalty * counts, dtype=torch.float32)
    warpers = [lp.TemperatureLogitsWarper(float(params.temperature))]
    warpers += [lp.TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [lp.TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    warpers += [lp.MinPLogitsWarper(params.min_p)] if params.min_p > 0 else []
    for warp in warpers:
        scores = warp(seen, scores)
    return torch.softmax(scores.double(), -1)[0].numpy()  # float32's sum over 262,144 terms is off by ~4e-5


def our_distribution(x, params: SamplingParams, history=()) -> np.ndarray:
    """What `Sampler.choose` draws from, the same way dense."""
    s = Sampler(params, history)
    ids, probs = s.distribution(s.adjust(np.array(x, np.float32)))
    dense = np.zeros(len(x))
    dense[ids] = probs
    return dense


def _logits(name: str) -> np.ndarray:
    rng = np.random.default_rng(3)
    if name == "ties":  # groups of equal logits; every cut below falls between groups (see the test after)
        return np.array([3, 1, 3, 2.5, 2.5, 1, 2.5, 0, -1, 0.5, 2, 2, -3, 1, 0, 0.25], np.float32)
    if name == "near-ties":  # six top logits one float32 ulp apart, the larger at the higher id (unlike a tie)
        x = rng.standard_normal(64).astype(np.float32)
        x[[2, 9, 20, 33, 41, 50]] = np.float32(4) + np.arange(6, dtype=np.float32) * np.spacing(np.float32(4))
        return x
    x = (rng.standard_normal(int(name.split("-")[1])) * 2).astype(np.float32)
    x[rng.choice(len(x), 20, replace=False)] += 8  # a few clear favourites, as real logits have
    return x


def _history(x: np.ndarray) -> list[int]:
    """Tokens seen before: the best ones (so penalties move the cuts), a negative one (repetition's other rule),
    a middling one, with counts 1 to 3 (so the frequency penalty differs from the presence penalty)."""
    order = np.argsort(-x, kind="stable")
    return [order[0]] + [order[1]] * 2 + [order[4]] * 3 + [order[-1]] * 2 + [order[len(x) // 2]]


DISTRIBUTIONS = {
    "temperature-0.6": dict(temperature=0.6),
    "temperature-1.7": dict(temperature=1.7),
    "top-k": dict(top_k=5),
    "top-p": dict(top_p=0.7),
    "min-p": dict(min_p=0.2),
    "temperature-top-k-top-p-min-p": dict(temperature=0.7, top_k=7, top_p=0.8, min_p=0.05),
    "repetition": dict(repetition_penalty=1.8),
    "repetition-boost": dict(repetition_penalty=0.6),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "penalties-then-temperature-top-p-min-p": dict(
        temperature=0.8, top_p=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.5
    ),
}


@pytest.mark.parametrize("logits", ["ties", "near-ties", "random-1000", "random-262144"])
@pytest.mark.parametrize("case", DISTRIBUTIONS, ids=list(DISTRIBUTIONS))
def test_distribution_matches_transformers(case, logits):
    x = _logits(logits)
    params, history = SamplingParams(**DISTRIBUTIONS[case]), _history(x)
    ours, want = our_distribution(x, params, history), hf_distribution(x, params, history)
    assert np.flatnonzero(ours).tolist() == np.flatnonzero(want).tolist()  # the same tokens kept
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-12)


def test_ties_at_a_cut_keep_the_lower_ids():
    """Where a cut falls among equal logits, ours keeps exactly k tokens (top-k), or as many as the mass needs
    (top-p), lower ids first, as `top_indices` orders everything. transformers keeps every tied token at a top-k
    cut and the higher ids at a top-p cut: the same mass, other tokens."""
    x = np.array([3, 1, 3, 2.5, 2.5, 1, 2.5, 0], np.float32)  # ids 3, 4, 6 tie
    for params, ours, theirs in (
        (SamplingParams(top_k=4), [0, 2, 3, 4], [0, 2, 3, 4, 6]),
        (SamplingParams(top_p=0.7), [0, 2, 3, 4], [0, 2, 4, 6]),
    ):
        assert np.flatnonzero(our_distribution(x, params)).tolist() == ours
        assert np.flatnonzero(hf_distribution(x, params)).tolist() == theirs


# Top-p and min-p both cut the same ranking, so only the tighter one binds: one case each.
@pytest.mark.parametrize(
    "dtype,params",
    [
        (np.float32, dict(temperature=0.8, top_p=0.9, min_p=0.05)),  # the plain path; min-p binds
        (
            np.float16,
            dict(
                temperature=1.3,
                top_k=12,
                top_p=0.95,
                min_p=0.02,
                repetition_penalty=1.5,
                presence_penalty=0.5,
                frequency_penalty=0.3,
            ),
        ),  # the fp16 top-k path, its own code; top-p binds
    ],
    ids=["fp32-min-p", "fp16-top-k-top-p-penalised"],
)
def test_seeded_draws_follow_the_distribution(dtype, params):
    """20,000 draws against transformers' distribution: Pearson's chi-square, p-value from scipy."""
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000).astype(np.float32)
    top = rng.choice(1000, 16, replace=False)
    x[top] += 4 + rng.standard_normal(16)
    x = x.astype(dtype)
    history = [top[0], top[1], top[1], top[2]]
    want = hf_distribution(x.astype(np.float32), SamplingParams(**params), history)
    s = Sampler(SamplingParams(seed=0, **params), history)
    draws = np.array([s.sample(x) for _ in range(20000)])
    kept = np.flatnonzero(want)
    assert set(draws.tolist()) <= set(kept.tolist())
    observed, expected = np.bincount(draws, minlength=len(x))[kept], want[kept] * len(draws)
    assert len(kept) > 5 and expected.min() >= 5  # the test's own premise: enough bins, each well filled
    assert stats.chisquare(observed, expected * (len(draws) / expected.sum())).pvalue > 1e-3


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", -1),
        ("top_k", 1.5),
        ("top_p", 0),
        ("min_p", 2),
        ("repetition_penalty", 0),
        ("presence_penalty", 3),
        ("frequency_penalty", "x"),
        ("seed", 2**63),  # OpenAI's seed is signed 64-bit: -1 is a seed, 2**63 is past it
        ("logprobs", 21),
        ("top_q", 0.5),
    ],
)
def test_errors_name_the_parameter(name, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams.from_generation_config({}, **{name: value})
    assert e.value.param == name and name in str(e.value)


# -- logit_bias (OpenAI's): added to the logits after the penalties; -100 bans, +100 forces ------------------------


def _peaked(vocab: int, dtype) -> np.ndarray:
    """Logits with one clear favourite (id 3, by 12) over a spread of others."""
    x = np.random.default_rng(6).standard_normal(vocab) * 2
    x[3] = 20
    return x.astype(dtype)


MODES = {  # (params, vocabulary): the full one where the fp16 fast path runs
    "greedy": (dict(temperature=0.0), 262144),
    "top-k": (dict(temperature=1.5, top_k=20, seed=0), 262144),
    "top-p": (dict(temperature=1.5, top_p=0.9, seed=0), 1000),
    # near uniform, where adding -100 alone would not ban: exp(-100 / 1000) keeps 90 % of the weight
    "flat": (dict(temperature=1000.0, seed=0), 8),
}


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_logit_bias_bans_and_forces(mode, dtype):
    params, vocab = MODES[mode]
    x = _peaked(vocab, dtype)
    banned = {3: -100, 5: -100, 6: -100}
    free = Sampler(SamplingParams(**params))
    assert 3 in [free.sample(x) for _ in range(100)]  # the favourite, unless banned
    s = Sampler(SamplingParams(**params, logit_bias=banned))
    draws = [s.sample(x) for _ in range(100)]
    assert not set(draws) & set(banned)
    if mode != "flat":  # +100 on a middling token: it beats the favourite's lead of ~12 every time
        s = Sampler(SamplingParams(**params, logit_bias={"500": 100}))
        assert {s.sample(x) for _ in range(50)} == {500}


def test_logit_bias_comes_after_the_penalties():
    x = np.array([5.0, 4.0, 3.0, 0.0], np.float32)
    # repetition 2 halves token 0 to 2.5; a bias of +1 after it gives 3.5 < 4, before it would give 3
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 1.0}), history=[0])
    assert s.adjust(x.copy()).tolist() == [3.5, 4.0, 3.0, 0.0]
    assert s.sample(x) == 1 and s.sample(x.astype(np.float16)) == 1


@pytest.mark.parametrize(
    "params",
    [dict(temperature=0.7, top_p=0.9, min_p=0.02), dict(temperature=1.3, top_k=7)],
    ids=["temperature-top-p-min-p", "top-k"],
)
def test_biased_distribution_is_transformers_on_biased_logits(params):
    x = _logits("random-1000")
    order = np.argsort(-x)
    bias = {int(order[0]): -100, int(order[1]): -3.5, int(order[30]): 6.0, int(order[400]): 100}
    biased = x.copy()
    for t, b in bias.items():
        biased[t] = -np.inf if b == -100 else biased[t] + b
    ours = our_distribution(x, SamplingParams(**params, logit_bias=bias))
    want = hf_distribution(biased, SamplingParams(**params))
    assert np.flatnonzero(ours).tolist() == np.flatnonzero(want).tolist()
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-12)


def test_logit_bias_keys_may_be_json_strings():
    p = SamplingParams.from_generation_config({}, vocab_size=512, logit_bias={"5": -100, 7: 2, "511": 0.5})
    assert p.logit_bias == {5: -100.0, 7: 2.0, 511: 0.5}


@pytest.mark.parametrize(
    "bias",
    [
        [5],
        {"x": 1},
        {"-1": 1},
        {" 5": 1},
        {"５": 1},  # a full-width digit: str.isdigit says yes
        {True: 1},
        {"512": 1},  # the vocabulary is 0..511
        {"5": 101},
        {"5": -100.5},
        {"5": "a"},
        {"5": None},
        {"5": True},
        {"5": float("nan")},
        {str(i): -100 for i in range(512)},  # nothing left to say
    ],
)
def test_bad_logit_bias_names_the_parameter(bias):
    with pytest.raises(SamplingError) as e:
        SamplingParams.from_generation_config({}, vocab_size=512, logit_bias=bias)
    assert e.value.param == "logit_bias" and str(e.value).startswith("logit_bias: ")


def test_a_bias_beyond_the_logits_is_an_error_at_the_first_draw():
    s = Sampler(SamplingParams(temperature=0.0, logit_bias={600: 1}))  # no vocabulary given: checked on the logits
    with pytest.raises(SamplingError, match="600 is not in the vocabulary of 512"):
        s.sample(np.zeros(512, np.float16))

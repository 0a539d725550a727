"""Speculative sampling's math, numpy only: the drafter's sparse distribution (Proposal) against a dense
reference, and the tokens draft() + verify() emit against the target's own sampling distribution, by
chi-square over many seeded trials (one position, and the joint law of two)."""

from dataclasses import replace

import numpy as np
import pytest
from scipy.stats import chisquare

from gemma_ane.runtime.sampling import Proposal, Sampler, SamplingParams

V = 40


def dense(prop: Proposal) -> np.ndarray:
    """The proposal's full logit vector, built the obvious way."""
    x = np.full(prop.vocab, -np.inf if prop.fill is None else prop.fill, np.float64)
    x[prop.ids] = prop.logits
    return x


def softmax(x: np.ndarray, t: float) -> np.ndarray:
    e = np.exp((x - x.max()) / t)
    return e / e.sum()


def assert_law(counts: np.ndarray, probs: np.ndarray, what=""):
    """Nothing outside the support, and a chi-square fit (bins expecting < 5 merged into one)."""
    assert counts[probs == 0].sum() == 0, (what, np.flatnonzero((probs == 0) & (counts > 0)))
    counts, expected = counts[probs > 0], probs[probs > 0] * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if not small.any():
        obs, exp = obs[:-1], exp[:-1]
    assert len(obs) >= 2, what  # else the test has nothing to compare
    pvalue = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert pvalue > 1e-4, (what, pvalue)


def scored(rng, n: int, vocab: int = V, scale: float = 2.0) -> Proposal:
    """Gemma 4's centroid head: n scored ids, every other token at the scored minimum minus one."""
    ids = rng.choice(vocab, n, replace=False)
    logits = (rng.standard_normal(n) * scale).astype(np.float32)
    return Proposal(ids, logits, float(logits.min()) - 1.0, vocab)


def full(logits: np.ndarray, rng) -> Proposal:
    """Every token scored, ids in a random order."""
    perm = rng.permutation(len(logits))
    return Proposal(perm, np.asarray(logits, np.float32)[perm], None, len(logits))


# --- Proposal ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0.5, 1.0, 2.3])
@pytest.mark.parametrize("kind", ["fill", "fill-few-unscored", "full"])
def test_proposal_probs_match_the_dense_softmax(kind, t):
    rng = np.random.default_rng(3)
    prop = {
        "fill": scored(rng, 6),
        "fill-few-unscored": scored(rng, V - 2),
        "full": full(rng.standard_normal(V) * 2, rng),
    }[kind]
    want = softmax(dense(prop), t)
    got = prop.probs(np.arange(V), t)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got.sum() == pytest.approx(1.0, abs=1e-12)
    tokens = rng.integers(0, V, 100)  # any order, repeats
    np.testing.assert_allclose(prop.probs(tokens, t), want[tokens], rtol=1e-12)


def test_proposal_without_fill_must_cover_the_vocabulary():
    with pytest.raises(ValueError, match="proposal"):
        Proposal(np.arange(5), np.zeros(5), None, V)


def test_proposal_argmax_is_a_dense_argmax():
    """Ties by lowest id, including a fill logit equal to or above the best scored one."""
    rng = np.random.default_rng(4)
    for trial in range(300):
        n = int(rng.integers(1, V + 1))
        ids = rng.choice(V, n, replace=False)
        logits = rng.integers(-3, 3, n).astype(np.float32)  # ties everywhere
        fill = None if n == V and trial % 2 else float(rng.integers(-4, 4))
        prop = Proposal(ids, logits, fill, V)
        assert prop.argmax() == int(np.argmax(dense(prop))), (ids, logits, fill)
    # the fill above every scored logit: the lowest unscored id wins
    assert Proposal([0, 1, 3], [1.0, 2.0, 2.0], 5.0, V).argmax() == 2
    assert Proposal([0, 1, 3], [1.0, 2.0, 2.0], 2.0, V).argmax() == 1


@pytest.mark.parametrize("t", [0.6, 1.0, 1.8])
@pytest.mark.parametrize("n", [1, 5, V - 2, V])
def test_proposal_draws_follow_its_probs(n, t):
    rng = np.random.default_rng(n)
    prop = full(rng.standard_normal(V) * 1.5, rng) if n == V else scored(rng, n, scale=1.0)
    if n == V - 2:  # two unscored tokens holding most of the mass: the uniform pick among few must be right
        prop = Proposal(prop.ids, prop.logits, float(prop.logits.max()) + 1.0, V)
    draw = np.random.default_rng(5)
    counts = np.bincount([prop.draw(draw, t) for _ in range(6000)], minlength=V)
    assert_law(counts, softmax(dense(prop), t))


def test_sampler_draft_uses_its_temperature_and_argmax_when_greedy():
    rng = np.random.default_rng(6)
    prop = scored(rng, 8)
    s = Sampler(SamplingParams(temperature=2.5, seed=1))
    counts = np.bincount([s.draft(prop) for _ in range(6000)], minlength=V)
    assert_law(counts, softmax(dense(prop), 2.5))
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)):
        assert Sampler(params).draft(prop) == int(np.argmax(dense(prop)))


# --- one position: draft() + verify() emit the target's law --------------------------------------------

HISTORY = [3, 3, 7, 11, 20]
TARGETS = {
    "plain": dict(temperature=1.0),
    "hot-penalised": dict(temperature=1.4, repetition_penalty=1.6, presence_penalty=0.9, frequency_penalty=0.4),
    "cool-top-k": dict(temperature=0.7, top_k=6),
    "top-p": dict(temperature=1.0, top_p=0.7),
    "min-p-penalised": dict(temperature=1.3, min_p=0.1, repetition_penalty=1.3),
    "biased": dict(temperature=1.0, logit_bias={0: -100, 1: -100, 2: -100, 5: 3.0, 9: -2.0}),
}


def target_logits(rng) -> np.ndarray:
    x = rng.standard_normal(V) * 1.5
    x[HISTORY] += 2.0  # the penalties have something to change
    x[[0, 1, 2]] += 3.0  # and the bans something to remove
    return x.astype(np.float16)  # chunk_3's dtype


def proposals(x: np.ndarray, rng) -> dict[str, Proposal]:
    low = np.argsort(x.astype(np.float32))[:6]  # where top-k / top-p / min-p leave nothing
    return {
        "close": full(x.astype(np.float32) + rng.standard_normal(V) * 0.3, rng),
        "far": full(rng.standard_normal(V) * 2.5, rng),
        "fill": scored(rng, 5),  # most of q's mass on the 35 unscored tokens
        "off-support": Proposal(np.unique(np.r_[low, 0, 1, 2]), np.full(9, 4.0, np.float32), 0.0, V),
    }


def law(params: SamplingParams, logits: np.ndarray, history) -> np.ndarray:
    """The target's own sampling distribution, dense."""
    s = Sampler(params, history)
    ids, probs = s.distribution(s.adjust(np.array(logits, np.float32)))
    out = np.zeros(len(logits))
    out[ids] = probs
    return out


@pytest.mark.parametrize("case", TARGETS, ids=list(TARGETS))
def test_speculative_sampling_emits_the_target_law(case):
    rng = np.random.default_rng(sum(map(ord, case)))
    params = SamplingParams(seed=7, **TARGETS[case])
    x = target_logits(rng)
    want = law(params, x, HISTORY)
    for name, prop in proposals(x, rng).items():
        s = Sampler(params, HISTORY)
        counts, n, accepts = np.zeros(V, np.int64), 4000, 0
        for _ in range(n):
            token, accepted = s.verify(x, s.draft(prop), prop)
            counts[token] += 1
            accepts += accepted
        assert s.counts == Sampler(params, HISTORY).counts  # verify observes nothing
        assert_law(counts, want, name)
        # and drafts are kept as often as the rule min(1, p/q) keeps them: sum_x min(p(x), q(x)) (not, e.g., a
        # fresh draw from p that happens to equal the draft, which emits the same law but accepts less)
        rate = np.minimum(want, prop.probs(np.arange(V), params.temperature)).sum()
        assert abs(accepts / n - rate) <= 4.5 * np.sqrt(rate * (1 - rate) / n) + 1e-3, (name, accepts / n, rate)


# --- two positions: the joint law of the first two emitted tokens ----------------------------------------

V2 = 12


def row2(t1: int) -> np.ndarray:
    """A toy target's second row, which depends on the first token."""
    x = np.cos(np.arange(V2) * (t1 + 1) * 0.7) * 2.0
    x[(3 * t1) % V2] += 2.5
    return x.astype(np.float32)


def drafter2(d1: int) -> Proposal:
    """A toy drafter's second proposal, conditioned on its own first draft: up to 3 scored ids, a fill for the rest."""
    ids = np.array([(d1 + 1) % V2, (3 * d1) % V2, (d1 + 5) % V2])
    ids = np.unique(ids)
    return Proposal(ids, np.linspace(2.0, 0.5, len(ids)), -0.5, V2)


@pytest.mark.parametrize(
    "target",
    [dict(temperature=1.0), dict(temperature=0.8, top_k=5, repetition_penalty=2.0, presence_penalty=1.0)],
    ids=["plain", "top-k-penalised"],
)
def test_two_drafts_emit_the_joint_target_law(target):
    """K=2: row 1 verifies draft 1; if it is accepted, row 2 (logits given token 1) verifies draft 2, else the
    next burst drafts again from token 1 and verifies at the same row. The caller observes each token in order."""
    params = SamplingParams(seed=9, **target)
    history = [4, 4, 1]
    x1 = np.cos(np.arange(V2) * 1.3).astype(np.float32) * 2.0
    p1 = Proposal(np.array([0, 4, 7]), np.array([1.5, 0.5, -1.0]), -2.0, V2)
    want = np.zeros((V2, V2))
    for t1, w1 in enumerate(law(params, x1, history)):
        want[t1] = w1 * law(params, row2(t1), history + [t1])
    rows, q2 = [row2(t) for t in range(V2)], [drafter2(t) for t in range(V2)]
    counts = np.zeros((V2, V2), np.int64)
    for seed in range(6000):
        s = Sampler(replace(params, seed=seed), history)
        d1 = s.draft(p1)
        d2 = s.draft(q2[d1])  # both drafts before any verify, as a burst does
        t1, ok = s.verify(x1, d1, p1)
        s.observe(t1)
        if not ok:
            d2 = s.draft(q2[t1])
        t2, _ = s.verify(rows[t1], d2, q2[t1])  # accepted: t1 == d1
        counts[t1, t2] += 1
    assert_law(counts.ravel(), want.ravel())


# --- greedy --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.5, logit_bias={5: 4.0}),
        dict(temperature=0.9, top_k=1, presence_penalty=2.0),
    ],
)
def test_greedy_verify_keeps_the_targets_token(params):
    rng = np.random.default_rng(10)
    s = Sampler(SamplingParams(**params), HISTORY)
    for _ in range(20):
        x = target_logits(rng)
        prop = scored(rng, 6)
        want = s.sample(x)
        for draft in range(V):
            assert s.verify(x, draft, prop) == (want, draft == want)

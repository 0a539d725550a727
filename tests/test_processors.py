"""The logits processors (sampling.make_logits_processors) and the sampler chain (sampling.make_sampler), each step
alone against a hand-computed expectation, each one's effect through the Sampler (so a step dropped from its chain
fails here), and the chains' order."""

from __future__ import annotations

import numpy as np
import pytest

from gemma_ane.runtime.sampling import (
    Ban,
    Candidates,
    GrammarMask,
    LogitBias,
    MinP,
    OccurrencePenalty,
    RepetitionPenalty,
    Sampler,
    SamplingParams,
    Temperature,
    TopK,
    TopP,
    make_logits_processors,
    make_sampler,
)

IDS = np.array([2, 5, 7], np.int64)  # the tokens a processor is shown: seen ones, biased ones
X = np.array([2.0, -2.0, 1.0], np.float32)  # their logits
COUNTS = np.array([1, 3, 0], np.float32)  # 7 is biased but unseen


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    assert RepetitionPenalty(2.0)(IDS, X, COUNTS).tolist() == [1.0, -4.0, 1.0]


def test_occurrence_penalty_is_presence_plus_frequency_times_count():
    assert OccurrencePenalty(0.5, 0.25)(IDS, X, COUNTS).tolist() == [2.0 - 0.75, -2.0 - 1.25, 1.0]


def test_logit_bias_adds_and_bans():
    out = LogitBias({7: 1.5, 2: -100})(IDS, X, COUNTS)
    assert out.tolist() == [-np.inf, -2.0, 2.5] and X.tolist() == [2.0, -2.0, 1.0]  # the input stays


def test_ban_whatever_the_bias():
    assert Ban([5])(IDS, X, COUNTS).tolist() == [2.0, -np.inf, 1.0]


class Grammar:
    """A grammar.Constraint's interface over a fixed allowed set: `refused` are in its mask but its parser refuses
    them (llguidance's <unk> case); each advance is recorded."""

    def __init__(self, vocab: int, allowed, refused=()):
        self.ok = np.zeros(vocab, bool)
        self.ok[list(allowed)] = True
        self.refused, self.taken = set(refused), []

    def allowed(self, banned=None):
        out = self.ok.copy()
        if banned is not None:
            out[banned] = False
        return out

    def legal(self, token):
        return int(token) not in self.refused

    def mask(self, logits, allowed):
        out = np.full_like(logits, -np.inf)
        np.copyto(out, logits, where=allowed)
        return out

    def advance(self, token):
        self.taken.append(int(token))


def no_token(steps):
    return ValueError(f"no token after {steps}")


def test_grammar_mask_forbids_what_the_grammar_does_not_take_and_the_banned():
    mask = GrammarMask(Grammar(8, [2, 5, 6]), [6], no_token)
    assert mask(IDS, X, COUNTS).tolist() == [2.0, -2.0, -np.inf]  # 7 not in the grammar
    row = np.arange(8, dtype=np.float16)
    assert mask.row(row).tolist() == [-np.inf] * 2 + [2.0] + [-np.inf] * 2 + [5.0] + [-np.inf] * 2  # 6 banned
    assert row.tolist() == list(range(8))  # the caller's row stays the model's distribution


def test_grammar_mask_drops_a_token_its_parser_refuses_and_follows_the_output():
    grammar = Grammar(8, [2, 5], refused=[5])
    mask = GrammarMask(grammar, [], no_token)
    assert not mask.takes(5) and mask.allowed.tolist() == [i == 2 for i in range(8)] and mask.takes(2)
    mask.advance(2)
    assert grammar.taken == [2] and mask.steps == 1 and mask.allowed[5]  # the next step's mask is the grammar's


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0, top_k=3, seed=0)], ids=str)
def test_the_sampler_draws_through_the_grammar_mask(dtype, params):
    """The best logits forbidden, one allowed token refused by the parser: only the grammar's tokens are drawn, each
    consumed by it; a step with none left is the mask's error, naming the step."""
    vocab = 20000  # past 16,384: the fp16 path's strided candidate search
    logits = np.random.default_rng(1).standard_normal(vocab).astype(dtype)
    logits[[10, 11]] = 30.0
    grammar = Grammar(vocab, [3, 4, 9], refused=[9])
    logits[9] = 20.0
    s = Sampler(SamplingParams(**params), grammar=GrammarMask(grammar, [], no_token))
    draws = []
    for _ in range(20):
        draws.append(s.sample(logits))
        s.observe(draws[-1])
    assert set(draws) <= {3, 4} and grammar.taken == draws
    grammar.ok[:] = False
    grammar.ok[9] = True  # only a token the parser refuses
    s.grammar._allowed = None
    with pytest.raises(ValueError, match="no token after 20"):
        s.sample(logits)


def test_the_processor_chain_is_built_in_order_and_only_of_what_changes_a_logit():
    """Penalties (repetition, then presence and frequency) on the raw logits, then logit bias, then the runtime's
    bans, then the grammar mask, last: it sees every other processor's -inf."""
    assert make_logits_processors(SamplingParams()) == []
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={3: 1.0})
    mask = GrammarMask(Grammar(8, [1]), [], no_token)
    chain = make_logits_processors(params.validate(), bans=[9], grammar=mask)
    assert [type(p) for p in chain] == [RepetitionPenalty, OccurrencePenalty, LogitBias, Ban, GrammarMask]
    assert chain[-1] is mask


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_sampler_applies_the_chain_and_its_bans(dtype):
    logits = np.array([0.0, 5.0, 4.0, 1.0], dtype)
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={3: 3.5}), history=[1], bans=[2])
    assert s.adjust(logits.astype(np.float32)).tolist() == [0.0, 2.5, -np.inf, 4.5]
    assert s.sample(logits) == 3  # 1 penalised, 2 banned, 3 biased past them


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(
    ("params", "history", "bans", "want"),
    [
        (dict(repetition_penalty=4.0), [0], (), 1),
        (dict(presence_penalty=2.0), [0], (), 1),
        (dict(frequency_penalty=1.0), [0, 0], (), 1),
        (dict(logit_bias={2: 3.0}), [], (), 2),
        (dict(), [], [0], 1),
    ],
    ids=["repetition", "presence", "frequency", "bias", "ban"],
)
def test_each_processor_decides_a_greedy_draw_through_the_sampler(dtype, params, history, bans, want):
    """Token 0 leads by 1.5 and token 2 trails it by 2: each processor alone changes the argmax, on the fp16 fast
    path (a vocabulary past 16,384) and the fp32 one."""
    logits = np.zeros(20000, dtype)
    logits[[0, 1, 2]] = [3.0, 1.5, 1.0]
    s = Sampler(SamplingParams(temperature=0.0, **params), history=history, bans=bans)
    assert s.sample(logits) == want and Sampler(SamplingParams(temperature=0.0)).sample(logits) == 0


# -- the sampler chain ----------------------------------------------------------------------------------------------

L = np.array([2.0, 1.0, 0.0, -1.0, -3.0], np.float32)


def softmax(x):
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


def dist(c: Candidates) -> dict[int, float]:
    ids, p = c.distribution()
    return {int(i): float(q) for i, q in zip(ids, p)}


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-6 for k in a)


def test_temperature_divides_the_logits():
    assert close(dist(Temperature(2.0)(Candidates(L))), dict(enumerate(softmax(L / 2))))


def test_top_k_keeps_the_k_most_likely_renormalised():
    assert close(dist(TopK(2)(Candidates(L))), dict(enumerate(softmax(L[:2]))))


def test_top_p_keeps_the_fewest_reaching_the_mass():
    p = softmax(L)  # 0.64, 0.23, ...: 0.8 needs two
    assert close(dist(TopP(0.8)(Candidates(L))), {0: p[0] / p[:2].sum(), 1: p[1] / p[:2].sum()})


def test_min_p_keeps_those_at_least_min_p_times_the_most_likely():
    p = softmax(L)  # relative to the first: 1, 0.37, 0.14, 0.05, 0.007
    assert close(dist(MinP(0.1)(Candidates(L))), dict(enumerate(p[:3] / p[:3].sum())))


def test_the_sampler_chain_is_built_in_order_and_only_of_what_changes_the_distribution():
    def kinds(**kw):
        return [(type(s).__name__, *vars(s).values()) for s in make_sampler(SamplingParams(**kw))]

    assert kinds() == []
    assert kinds(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05) == [
        ("Temperature", 0.7),
        ("TopK", 40),
        ("TopP", 0.9),
        ("MinP", 0.05),
    ]
    assert kinds(temperature=0.0, top_k=40) == kinds(temperature=0.7, top_k=1) == [("TopK", 1)]  # the argmax


# Each case's step alone sets the distribution (tokens kept, or their probabilities): a Sampler whose chain lost it
# draws from another one.
STEP_CASES = {
    "temperature": (dict(temperature=0.5), dict(enumerate(softmax(L / 0.5)))),
    "top-k": (dict(top_k=2), dict(enumerate(softmax(L[:2])))),
    "top-p": (dict(top_p=0.8), dict(enumerate(softmax(L[:2])))),
    "min-p": (dict(min_p=0.1), dict(enumerate(softmax(L[:3])))),
    # the cuts on the tempered distribution: at T=2 top-p 0.9 and min-p 0.2 keep four tokens, at T=1 two
    "temperature-then-top-p-min-p": (dict(temperature=2.0, top_p=0.9, min_p=0.2), dict(enumerate(softmax(L[:4] / 2)))),
}


@pytest.mark.parametrize("case", STEP_CASES, ids=list(STEP_CASES))
def test_each_sampler_step_shapes_the_samplers_distribution(case):
    params, want = STEP_CASES[case]
    ids, p = Sampler(SamplingParams(**params)).distribution(L.copy())
    assert close({int(i): float(q) for i, q in zip(ids, p)}, want)


def test_temperature_comes_before_the_cuts():
    """At T=2 top-p 0.6 needs the top two (0.44, then 0.70) and min-p 0.5 keeps the second (0.61 of the first); cut
    before the temperature, top-p would keep the first alone (0.64) and min-p drop the second (0.37 of the first)."""
    for cut in (TopP(0.6), MinP(0.5)):
        kept = Candidates(L)
        for step in (Temperature(2.0), cut):
            kept = step(kept)
        assert sorted(dist(kept)) == [0, 1]
        reversed_chain = Temperature(2.0)(cut(Candidates(L)))
        assert sorted(dist(reversed_chain)) == [0]
    ids, _ = Sampler(SamplingParams(temperature=2.0, top_p=0.6)).distribution(L.copy())
    assert sorted(ids.tolist()) == [0, 1]


def test_the_fp16_top_k_path_runs_the_rest_of_the_chain():
    """The fast path does top-k's work on the fp16 keys; the temperature and the cuts after it still apply: at T=0.2
    and min-p 0.5 only the best of the top 3 is left."""
    logits = np.zeros(20000, np.float16)
    logits[[0, 1, 2]] = [3.0, 2.5, 2.0]
    s = Sampler(SamplingParams(temperature=0.2, top_k=3, min_p=0.5, seed=0))
    assert {s.sample(logits) for _ in range(200)} == {0}
    loose = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=0))
    assert {loose.sample(logits) for _ in range(200)} == {0, 1, 2}


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_seed_reproduces_a_whole_constrained_penalised_run(dtype):
    def run(seed):
        rng = np.random.default_rng(3)
        grammar = Grammar(5000, range(0, 5000, 3))
        s = Sampler(
            SamplingParams(temperature=1.2, top_k=50, top_p=0.9, repetition_penalty=1.3, seed=seed),
            history=[3, 6],
            grammar=GrammarMask(grammar, [9], no_token),
        )
        out = []
        for _ in range(50):
            out.append(s.sample((rng.standard_normal(5000) * 3).astype(dtype)))
            s.observe(out[-1])
        return out

    a = run(11)
    assert a == run(11) and a != run(12) and all(t % 3 == 0 and t != 9 for t in a)

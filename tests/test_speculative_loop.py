"""The runtime's speculative loop over a toy target whose next-token law is a known Markov table: sampled output
follows the target's own law (chi-square over many seeds), and every token reports the logprob of the row it was
drawn from. The real engine's verify calls are proven in test_speculative.py; the acceptance math alone in
test_speculative_sampling.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chisquare

from gemma_ane.oracle.tokenizer_files import build_tokenizer
from gemma_ane.runtime.chat import ChatTemplate
from gemma_ane.runtime.model import Model
from gemma_ane.runtime.sampling import Proposal

VOCAB, FIRST, N = 1024, 300, 4  # the toy law lives on tokens 300..303; every other token has probability 0
rng = np.random.default_rng(7)
TARGET = rng.normal(0, 1.2, (N, N)).astype(np.float32)  # row: the last token; column: the next one
DRAFT = rng.normal(0, 1.2, (N, N)).astype(np.float32)  # the drafter's own (different) law


def row(table, token) -> np.ndarray:
    out = np.full(VOCAB, -np.inf, np.float32)
    out[FIRST : FIRST + N] = table[(int(token) - FIRST) % N]
    return out


class MarkovEngine:
    """The engine's interface (prompt, feed, verify, accept, rewind) over a table: logits depend on the last token."""

    head, context, window, verify_batch = "logits", 4096, 16, 4

    def __init__(self):
        self.tokens, self.final_hidden, self.shared_kv, self.verifies = [], np.ones(4, np.float32), {"kv": 0}, 0
        self.crossings = []  # one context: no ladder to climb

    @property
    def position(self):
        return len(self.tokens)

    def prompt(self, ids, marks=(), cancelled=None, exact=False):
        self.tokens = list(ids)
        return 0, row(TARGET, ids[-1])

    def feed(self, ids):
        self.tokens += list(ids)
        return [row(TARGET, ids[-1])]

    def can_verify(self):
        return True

    def verify(self, ids):
        self.tokens += list(ids)
        self.verifies += 1
        return np.stack([row(TARGET, t) for t in ids]), np.zeros((len(ids), 4), np.float32)

    def accept(self, position, hidden):
        self.rewind(position)

    def rewind(self, position):
        self.tokens = self.tokens[:position]


class MarkovDrafter:
    def step(self, token, carry, position, kv):
        logits = DRAFT[(int(token) - FIRST) % N]
        return Proposal(np.arange(FIRST, FIRST + N), logits, -1e9, VOCAB), carry


def model(drafts: int) -> Model:
    m = Model(Path("."), MarkovEngine(), build_tokenizer(VOCAB), ChatTemplate(None), {}, {"vocab_size": VOCAB}, "toy")
    m.drafter, m.engine.verify_batch = MarkovDrafter(), 4
    m.draft_tokens = drafts
    return m


def softmax(x, t=1.0):
    e = np.exp((x.astype(np.float64) - x.max()) / t)
    return e / e.sum()


@pytest.mark.parametrize("drafts", [1, 3])
def test_sampled_tokens_follow_the_targets_law(drafts):
    """The joint law of the first four tokens after the prompt over 4000 seeds: the first comes from the prompt's
    logits, the other three from verify calls (accepted drafts, corrections, bonus rows after all drafts held)."""
    m, t, runs = model(drafts), 0.9, 4000
    counts = np.zeros((N,) * 4)
    for seed in range(runs):
        r = m.generate("x", raw=True, max_tokens=4, temperature=t, seed=seed)
        counts[tuple(np.array(r.tokens) - FIRST)] += 1
    assert m.engine.verifies >= runs  # every run verified drafts
    law = softmax(TARGET[(m.encode("x")[-1] - FIRST) % N], t)
    for _ in range(3):  # law[..., b, c] = law[..., b] * P(c | b)
        law = law[..., None] * np.stack([softmax(TARGET[b], t) for b in range(N)]).reshape(
            (1,) * (law.ndim - 1) + (N, N)
        )
    keep = law.ravel() * runs >= 5  # chi-square wants expected counts of 5 or more: pool the rest
    observed = np.append(counts.ravel()[keep], counts.ravel()[~keep].sum())
    expected = np.append(law.ravel()[keep], law.ravel()[~keep].sum())
    expected *= runs / expected.sum()  # the law sums to 1 up to rounding, which chisquare refuses
    assert chisquare(observed, expected).pvalue > 1e-4


def test_each_token_reports_the_logprob_of_its_own_row():
    m = model(3)
    r = m.generate("x", raw=True, max_tokens=12, temperature=1.0, seed=3, logprobs=0)
    assert m.engine.verifies >= 2
    prev = m.encode("x")[-1]
    for token, lp in zip(r.tokens, r.logprobs):
        expect = np.log(softmax(TARGET[(prev - FIRST) % N])[token - FIRST])
        assert lp == pytest.approx(expect, abs=1e-5)
        prev = token


def test_a_seed_reproduces_a_drafted_run():
    a = model(3).generate("x", raw=True, max_tokens=20, temperature=1.0, seed=11)
    b = model(3).generate("x", raw=True, max_tokens=20, temperature=1.0, seed=11)
    assert a.tokens == b.tokens and len(a.tokens) == 20 and 0 < a.acceptance_rate < 1

"""The logits processors (sampling.make_logits_processors), each alone against a hand-computed expectation, and
their chain as the Sampler applies it."""

from __future__ import annotations

import numpy as np
import pytest

from gemma_ane.runtime.sampling import (
    Ban,
    LogitBias,
    OccurrencePenalty,
    RepetitionPenalty,
    Sampler,
    SamplingParams,
    make_logits_processors,
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


def test_the_chain_is_built_in_order_and_only_of_what_changes_a_logit():
    assert make_logits_processors(SamplingParams()) == []
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={3: 1.0})
    chain = make_logits_processors(params.validate(), bans=[9])
    assert [type(p) for p in chain] == [RepetitionPenalty, OccurrencePenalty, LogitBias, Ban]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_sampler_applies_the_chain_and_its_bans(dtype):
    logits = np.array([0.0, 5.0, 4.0, 1.0], dtype)
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={3: 3.5}), history=[1], bans=[2])
    assert s.adjust(logits.astype(np.float32)).tolist() == [0.0, 2.5, -np.inf, 4.5]
    assert s.sample(logits) == 3  # 1 penalised, 2 banned, 3 biased past them

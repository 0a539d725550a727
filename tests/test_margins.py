"""verify's report of top-1 misses (issue 25): each miss with the reference's gap, the fp32 pass rule that forgives
near-ties only, and the tests' helper that asserts every miss is one."""

import numpy as np
import pytest
from margins import assert_top1

from gemma_ane.oracle.verify import FP32_LOGIT_ERR, compare, passed

REF = np.array([[5.0, 1.0, 0.0], [2.0, 1.995, 0.0], [0.0, 3.0, 1.0]])


def test_compare_lists_each_miss_with_the_references_gap():
    ours = np.array([[4.0, 1.0, 0.0], [1.99, 2.0, 0.0], [0.0, 1.0, 3.0]])  # row 1: a near-tie; row 2: a miss
    r = compare(ours, REF, first=10)
    assert r["top1_agreement"] == pytest.approx(1 / 3)
    assert r["top1_misses"] == [
        {"position": 11, "ours": 1, "ref": 0, "ref_gap": pytest.approx(0.005)},
        {"position": 12, "ours": 2, "ref": 1, "ref_gap": pytest.approx(2.0)},
    ]
    assert r["max_miss_gap"] == pytest.approx(2.0)
    same = compare(REF, REF)
    assert same["top1_misses"] == [] and same["max_miss_gap"] == 0.0 and same["top1_agreement"] == 1.0


def test_fp32_passes_a_near_tie_and_fails_a_clear_miss():
    tie = np.array([[5.0, 1.0, 0.0], [2.0 - 1.5 * FP32_LOGIT_ERR, 2.0, 0.0], [0.0, 3.0, 1.0]])
    ref = REF.copy()
    ref[1, 1] = 2.0 - FP32_LOGIT_ERR  # the reference's top two within 2 x the fp32 error bound
    report = {"precision": "fp32", **compare(tie, ref)}
    assert report["top1_agreement"] < 1.0 and report["min_cosine"] >= 0.9999 and passed(report)
    ref[1, 1] = 2.0 - 3 * FP32_LOGIT_ERR  # a clear choice: missing it fails, whatever the cosine
    report = {"precision": "fp32", **compare(tie, ref)}
    assert report["min_cosine"] >= 0.9999 and not passed(report)


def test_assert_top1_forgives_ties_only():
    ours = np.array([[5.0, 1.0, 0.0], [1.99, 2.0, 0.0], [0.0, 3.0, 1.0]])
    assert assert_top1(compare(ours, REF), err=0.01) == 1
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_top1(compare(ours, REF), err=0.002)
    wrong_row = np.roll(REF, 1, axis=0)  # every row one position late
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_top1(compare(wrong_row, REF), err=0.01)

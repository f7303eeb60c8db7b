"""Sensitivity-calibrated thresholds and exact Clopper–Pearson bounds on score distributions with known answers."""
import math

import numpy as np
import pytest

from relayinfer.sdk.patho_calibration import (binomial_tail, binomial_tail_sum, calibrate_threshold,
    clopper_pearson_lower, clopper_pearson_upper)


@pytest.mark.parametrize("n", [1, 10, 299, 921, 5000])
def test_lower_bound_all_successes_is_closed_form(n):
    # P(X >= n) = p^n = alpha/2  ->  p_L = (alpha/2)^(1/n)
    assert clopper_pearson_lower(n, n) == pytest.approx(0.025 ** (1 / n), abs=1e-12)
    assert clopper_pearson_lower(n, n, two_sided=False) == pytest.approx(0.05 ** (1 / n), abs=1e-12)


@pytest.mark.parametrize("n", [1, 7, 100, 2000])
def test_lower_bound_one_success_is_closed_form(n):
    # P(X >= 1) = 1 - (1-p)^n = alpha/2  ->  p_L = 1 - (1 - alpha/2)^(1/n)
    assert clopper_pearson_lower(1, n) == pytest.approx(1 - 0.975 ** (1 / n), rel=1e-9)


def test_bounds_known_table_values_and_symmetry():
    # R: binom.test(996, 1000)$conf.int -> 0.9897903 0.9989091
    assert clopper_pearson_lower(996, 1000) == pytest.approx(0.9897903, abs=1e-6)
    assert clopper_pearson_upper(996, 1000) == pytest.approx(0.9989091, abs=1e-6)
    # R: binom.test(5, 10)$conf.int -> 0.1870860 0.8129140 (symmetric at x = n/2)
    assert clopper_pearson_lower(5, 10) == pytest.approx(0.1870860, abs=1e-6)
    assert clopper_pearson_upper(5, 10) == pytest.approx(0.8129140, abs=1e-6)
    assert clopper_pearson_lower(0, 10) == 0.0 and clopper_pearson_upper(10, 10) == 1.0
    # the bound is the p at which the observed count is just in the alpha/2 tail
    p = clopper_pearson_lower(37, 50)
    assert binomial_tail(37, 50, p) == pytest.approx(0.025, rel=1e-9)


def test_threshold_is_kth_largest_positive_on_a_grid():
    # 1000 positives at 0.001..1.000, target 0.996 -> 996 must pass -> t = the 996th largest = 0.005
    pos = np.arange(1, 1001) / 1000
    neg = np.arange(0, 1000) / 1000 * 0.01          # negatives in [0, 0.00999]: all below 0.005? half of them
    cal = calibrate_threshold(np.r_[pos, neg], np.r_[np.ones(1000), np.zeros(1000)], target=0.996)
    assert cal.threshold == pytest.approx(0.005)
    assert cal.tp == 996 and cal.sensitivity == pytest.approx(0.996)
    assert cal.tn == int(np.count_nonzero(neg < 0.005)) == 500
    assert cal.specificity == pytest.approx(0.5)
    assert cal.sensitivity_lower == pytest.approx(0.9897903, abs=1e-6)
    assert not cal.target_proven


def test_threshold_is_the_largest_meeting_the_target():
    rng = np.random.default_rng(0)
    s = rng.random(300)
    y = rng.random(300) < 0.3
    for target in (0.5, 0.9, 0.95, 0.996, 1.0):
        cal = calibrate_threshold(s, y, target)
        assert np.mean(s[y] >= cal.threshold) >= target
        above = s[y][s[y] > cal.threshold]            # the next larger candidate misses the target
        if above.size:
            assert np.mean(s[y] >= above.min()) < target


def test_separable_gaussians_specificity_matches_the_normal_cdf():
    # positives N(3, 1), negatives N(0, 1), target 0.9: t ~ 3 - 1.2816; specificity ~ Phi(t)
    rng = np.random.default_rng(1)
    pos, neg = rng.normal(3, 1, 200_000), rng.normal(0, 1, 200_000)
    cal = calibrate_threshold(np.r_[pos, neg], np.r_[np.ones(pos.size), np.zeros(neg.size)], target=0.9)
    assert cal.threshold == pytest.approx(3 - 1.2815516, abs=0.01)
    phi = 0.5 * (1 + math.erf(cal.threshold / math.sqrt(2)))
    assert cal.specificity == pytest.approx(phi, abs=0.003)
    assert cal.specificity_lower < cal.specificity < cal.specificity_upper


def test_ties_and_perfect_separation():
    cal = calibrate_threshold([0.9, 0.9, 0.9, 0.1, 0.1], [1, 1, 1, 0, 0], target=0.996)
    assert cal.threshold == 0.9 and cal.sensitivity == 1.0 and cal.specificity == 1.0
    assert cal.sensitivity_lower == pytest.approx(0.025 ** (1 / 3))
    no_neg = calibrate_threshold([0.2, 0.4], [1, 1])
    assert no_neg.specificity is None and no_neg.threshold == 0.2


@pytest.mark.parametrize("scores,labels,target,match", [
    ([0.1, 0.2], [0, 0], 0.996, "no positive"),
    ([0.1], [1, 0], 0.996, "differ in length"),
    ([0.1, float("nan")], [1, 0], 0.996, "finite"),
    ([0.1, 0.2], [1, 2], 0.996, "0 \\(negative\\) or 1"),
    ([0.1, 0.2], [1, 0], 0.0, "target"),
])
def test_bad_calibration_input_is_named(scores, labels, target, match):
    with pytest.raises(ValueError, match=match):
        calibrate_threshold(scores, labels, target)


def test_incomplete_beta_tail_equals_the_exact_binomial_sum():
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        x, p = int(rng.integers(0, n + 1)), float(rng.random())
        exact = binomial_tail_sum(x, n, p)
        assert binomial_tail(x, n, p) == pytest.approx(exact, rel=1e-9, abs=1e-300)

"""Sensitivity-calibrated decision thresholds (torch-free, numpy + math only).

Screening must miss few lesions, so the threshold is chosen for sensitivity first: from a calibration
set of slide scores with known labels, the **largest** threshold t whose sensitivity (the fraction of
positive slides scoring >= t) is at least the target (default 0.996, the sensitivity the Digepath
paper, arXiv 2505.21928, reports for its screening module; a target here, never a result of this
code). The largest such t gives the best specificity (fraction of negatives scoring < t) among the
thresholds that meet the target.

With k = ceil(target * P) of P positives needed, t is the k-th largest positive score. The
sensitivity reached on the calibration set, x / P, comes with the exact Clopper–Pearson lower
confidence bound (Clopper & Pearson 1934): the p_L with P(X >= x | n, p_L) = alpha / 2 for the
two-sided (1 - alpha) interval (alpha for one-sided), found by bisection on the binomial tail
(the regularized incomplete beta function, by continued fraction; no scipy). With x = n it is (alpha/2)^(1/n): 299 of 299 positives give a
two-sided 95 % lower bound of 0.9877, so showing 99.6 % at that confidence needs 921 positives without a miss.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Calibration", "binomial_tail", "binomial_tail_sum", "clopper_pearson_lower", "clopper_pearson_upper", "calibrate_threshold"]


def binomial_tail(x: int, n: int, p: float) -> float:
    """P(X >= x) for X ~ Binomial(n, p) = I_p(x, n - x + 1), the regularized incomplete beta function
    (exact identity), evaluated by its continued fraction (Numerical Recipes, 3rd ed., section 6.4,
    modified Lentz) to double precision in O(1) terms for any n."""
    if x <= 0:
        return 1.0
    if x > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    return _betainc(float(x), float(n - x + 1), p)


def binomial_tail_sum(x: int, n: int, p: float) -> float:
    """P(X >= x) by summing the binomial terms in log space: O(n), the reference for ``binomial_tail``."""
    if x <= 0:
        return 1.0
    if x > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
            for i in range(x, n + 1)]
    m = max(logs)
    return min(1.0, math.exp(m) * math.fsum(math.exp(v - m) for v in logs))


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for a, b > 0, 0 < x < 1 (NR 6.4: front factor times the
    continued fraction, using the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) where it converges faster)."""
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return min(1.0, max(0.0, front * h))


def _bisect(f, lo: float = 0.0, hi: float = 1.0, iters: int = 200) -> float:
    """Root of an increasing f on [lo, hi] by bisection (to double precision)."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson_lower(x: int, n: int, alpha: float = 0.05, two_sided: bool = True) -> float:
    """Exact (Clopper–Pearson) lower confidence bound of a binomial proportion: x successes of n trials.
    Two-sided (1 - alpha) interval's lower end by default (alpha/2 in the tail); 0 when x = 0.
    Raises ValueError unless 0 <= x <= n, n >= 1 and 0 < alpha < 1."""
    _check(x, n, alpha)
    if x == 0:
        return 0.0
    a = alpha / 2 if two_sided else alpha
    return _bisect(lambda p: binomial_tail(x, n, p) - a)


def clopper_pearson_upper(x: int, n: int, alpha: float = 0.05, two_sided: bool = True) -> float:
    """Exact upper confidence bound (the lower bound of the failures, mirrored); 1 when x = n."""
    _check(x, n, alpha)
    return 1.0 - clopper_pearson_lower(n - x, n, alpha, two_sided)


def _check(x: int, n: int, alpha: float) -> None:
    if n < 1 or not 0 <= x <= n:
        raise ValueError(f"need 0 <= x <= n and n >= 1, got x={x}, n={n}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


@dataclass(frozen=True)
class Calibration:
    """A calibrated threshold. ``threshold``: flag a slide positive when score >= threshold;
    ``target``: the sensitivity asked; ``sensitivity`` = ``tp / positives`` reached on the calibration
    set; ``sensitivity_lower``: its exact Clopper–Pearson lower bound at ``confidence`` (two-sided
    unless ``two_sided`` is False); ``specificity`` = ``tn / negatives`` at the threshold (None without
    negatives) and its bounds; ``target_proven``: sensitivity_lower >= target."""

    threshold: float
    target: float
    positives: int
    negatives: int
    tp: int
    tn: int
    sensitivity: float
    sensitivity_lower: float
    specificity: float | None
    specificity_lower: float | None
    specificity_upper: float | None
    confidence: float
    two_sided: bool
    target_proven: bool

    def to_dict(self) -> dict:
        """Plain dict for JSON reports."""
        return asdict(self)


def calibrate_threshold(scores, labels, target: float = 0.996, alpha: float = 0.05,
                        two_sided: bool = True) -> Calibration:
    """The largest threshold t with sensitivity(t) >= ``target`` on (``scores``, ``labels``).

    ``scores``: float array (n,), higher = more likely lesion; ``labels``: (n,) 0/1 or bool (1 = lesion).
    Raises ValueError for mismatched lengths, non-finite scores, labels other than 0/1, no positive
    slide, or a target outside (0, 1].
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores ({s.size}) and labels ({y.size}) differ in length")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 (negative) or 1 (positive)")
    if not 0 < target <= 1:
        raise ValueError(f"target sensitivity must be in (0, 1], got {target}")
    y = y.astype(bool)
    pos, neg = np.sort(s[y])[::-1], s[~y]
    if pos.size == 0:
        raise ValueError("the calibration set has no positive slide: sensitivity is undefined")
    k = math.ceil(round(target * pos.size, 9))            # positives that must score >= t
    t = float(pos[k - 1])                                    # the k-th largest positive score
    tp = int(np.count_nonzero(pos >= t))                     # ties at t count too
    tn = int(np.count_nonzero(neg < t))
    n_neg = int(neg.size)
    lower = clopper_pearson_lower(tp, pos.size, alpha, two_sided)
    return Calibration(
        threshold=t, target=target, positives=int(pos.size), negatives=n_neg, tp=tp, tn=tn,
        sensitivity=tp / pos.size, sensitivity_lower=lower,
        specificity=tn / n_neg if n_neg else None,
        specificity_lower=clopper_pearson_lower(tn, n_neg, alpha, two_sided) if n_neg else None,
        specificity_upper=clopper_pearson_upper(tn, n_neg, alpha, two_sided) if n_neg else None,
        confidence=1 - alpha, two_sided=two_sided, target_proven=lower >= target)

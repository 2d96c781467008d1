"""Statistics a sweep's claims rest on: per-run scores that average out eval noise (the mean of the last evals,
the area under the eval curve) and 95 % confidence intervals over seeds, plain and paired (two settings run
with the same seeds), by Student's t. Pure Python and numpy (no scipy): the t quantile is found by bisection
on the t distribution's CDF, integrated numerically.

    interval = mean_ci([0.61, 0.64, 0.58, 0.66, 0.60])          # Interval(mean, low, high, n)
    paired = paired_ci({0: 0.61, 1: 0.64}, {0: 0.55, 1: 0.60})  # a - b over the seeds both have
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values and its confidence interval [low, high] (low == high == mean when n == 1: one
    value says nothing about the spread; `half_width` is then nan)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2 if self.n > 1 else math.nan

    def excludes_zero(self) -> bool:
        """Whether the interval lies entirely above or below 0 (the difference is decided at its level)."""
        return self.n > 1 and (self.low > 0 or self.high < 0)

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.3f} (n={self.n}, no CI)"
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom (Simpson's rule on the density from 0 to |x|)."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    steps = 4000  # even; the density is smooth, so the error is far below the bisection's tolerance
    grid = np.linspace(0.0, abs(x), steps + 1)
    density = np.exp(log_norm - (df + 1) / 2 * np.log1p(grid * grid / df))
    weights = np.ones(steps + 1)
    weights[1:-1:2], weights[2:-1:2] = 4, 2
    half = float(density @ weights) * (abs(x) / steps) / 3
    return 0.5 + math.copysign(half, x)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (0.975 and 4: 2.776)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1 (got p={p}, df={df})")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if _t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


def mean_ci(values: Sequence[float], level: float = 0.95) -> Interval:
    """The mean of ``values`` and its ``level`` confidence interval by Student's t (sample std, ddof 1)."""
    data = np.asarray([v for v in values if v is not None], dtype=float)
    if len(data) == 0:
        raise ValueError("mean_ci needs at least one value")
    mean = float(data.mean())
    if len(data) == 1:
        return Interval(mean, mean, mean, 1)
    half = t_quantile(0.5 + level / 2, len(data) - 1) * float(data.std(ddof=1)) / math.sqrt(len(data))
    return Interval(mean, mean - half, mean + half, len(data))


def paired_ci(a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95) -> Interval:
    """The mean of a[seed] − b[seed] over the seeds both have, with its ``level`` CI (a paired t interval: the
    seed's shared randomness cancels, so it is tighter than comparing the two means)."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("paired_ci needs seeds present in both settings")
    return mean_ci([a[s] - b[s] for s in seeds], level)


LAST_EVALS = 3  # the evals a run's last score averages, unless told otherwise


def last_evals_mean(history: Sequence[Mapping], n: int = LAST_EVALS) -> float:
    """The mean held-out success of the last ``n`` evaluations of a run (``history``: {"step", "eval/success"}
    records, step 0 the base): one eval carries about ±2 points of noise at 512 problems, the mean of several
    less."""
    evals = [r["eval/success"] for r in sorted(history, key=lambda r: r["step"]) if r["step"] > 0]
    if not evals:
        raise ValueError("last_evals_mean needs at least one evaluation after step 0")
    return float(np.mean(evals[-n:]))


def eval_auc(history: Sequence[Mapping]) -> float:
    """The area under the held-out success curve (trapezoids over the eval steps, base included) divided by the
    steps it spans: the run's mean success, which rewards learning early as well as ending high."""
    points = sorted((r["step"], r["eval/success"]) for r in history)
    if len(points) < 2 or points[-1][0] == points[0][0]:
        raise ValueError("eval_auc needs evaluations at two or more steps")
    steps, success = np.array(points, dtype=float).T
    area = float(np.sum((success[1:] + success[:-1]) / 2 * np.diff(steps)))
    return area / (steps[-1] - steps[0])


__all__ = ["LAST_EVALS", "Interval", "eval_auc", "last_evals_mean", "mean_ci", "paired_ci", "t_quantile"]

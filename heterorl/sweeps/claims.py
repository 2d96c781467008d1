"""The GEPO paper's claims about staleness (arXiv 2508.17850), each checked against a sweep and said in one plain
sentence: reproduced, not reproduced, or not decided, with the numbers it rests on.

Every comparison is paired over the seeds both settings ran (`paired_ci`, 95 % Student-t), on each run's mean
held-out success over its last `LAST_EVALS` evaluations. "Little" and "close" mean within `CLOSE` (3 points of
success): a claim of smallness is reproduced when the whole interval lies inside that margin, not reproduced when
it lies wholly outside, and not decided otherwise; a claim of order ("more", "larger", "grows", "lower") is
reproduced when its interval excludes 0 on the claimed side, not reproduced when it excludes 0 on the other side,
and not decided when it contains 0. The online setting is the sweep's ``online_delay``; the smallest and largest
staleness are the delay settings whose measured mean staleness (over every finished cell) is the smallest above 0
and the largest. "Small staleness" is at most `SMALL_STALENESS` versions on average: a sweep whose smallest stale
setting is staler than that has not tested the third claim, and says so with the numbers it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from heterorl.sweeps.stats import LAST_EVALS, Interval, last_evals_mean, mean_ci, paired_ci

CLOSE = 0.03  # "degrades little", "close": within 3 points of held-out success
SMALL_STALENESS = 8.0  # "small staleness": a mean of at most 8 versions (the paper's largest delay is ~64 steps)

REPRODUCED, NOT_REPRODUCED, NOT_DECIDED = "reproduced", "not reproduced", "not decided"


@dataclass(frozen=True)
class Claim:
    claim: str  # what the paper says
    verdict: str  # REPRODUCED | NOT_REPRODUCED | NOT_DECIDED
    evidence: str  # the numbers, or why nothing could be said

    def sentence(self) -> str:
        return f"{self.claim}: **{self.verdict}** — {self.evidence}"


def last_score(history) -> float:
    return last_evals_mean(history, LAST_EVALS)


def best_to_last_gap(history) -> float:
    """The best single eval of the run minus its last-evals score (how far it fell from its best)."""
    return max(r["eval/success"] for r in history if r["step"] > 0) - last_score(history)


def run_metric(cell, key: str) -> float | None:
    """The mean over a run's steps of a per-step metric: from its metrics.jsonl when present, else from the
    ``metric_means`` its summary recorded when the sweep finished it."""
    values = [r[key] for r in cell.metrics if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    if values:
        return sum(values) / len(values)
    return cell.summary.get("metric_means", {}).get(key)


def _order_verdict(interval: Interval) -> str:
    if interval.n < 2 or not interval.excludes_zero():
        return NOT_DECIDED
    return REPRODUCED if interval.low > 0 else NOT_REPRODUCED


def _small_verdict(interval: Interval, lower: float, upper: float) -> str:
    if interval.n < 2:
        return NOT_DECIDED
    if lower <= interval.low and interval.high <= upper:
        return REPRODUCED
    if interval.low > upper or interval.high < lower:
        return NOT_REPRODUCED
    return NOT_DECIDED


def paper_claims(sweep, task: str) -> list[Claim]:
    """The paper's five staleness claims checked on ``task`` of a loaded sweep (`heterorl.sweeps.report`)."""
    online = sweep.online_delay

    measured = {}
    for delay in sweep.delays:
        values = [c.summary.get("staleness_mean") for c in sweep.cells
                  if c.done and c.summary["task"] == task and c.key[1] == delay]
        values = [v for v in values if v is not None]
        if values:
            measured[delay] = sum(values) / len(values)
    stale = sorted((d for d, s in measured.items() if s > 0 and d != online), key=measured.get)
    missing = [loss for loss in ("gepo", "grpo") if loss not in sweep.losses]
    if not stale or missing:
        why = f"the sweep lacks {' and '.join(missing)}" if missing else "the sweep has no stale setting finished"
        return [Claim(c, NOT_DECIDED, why) for c in _CLAIMS]
    small, large = stale[0], stale[-1]
    if online is None:  # a sweep of stale settings only (long runs at one lag): the claims that need none
        return [*(Claim(c, NOT_DECIDED, "the sweep has no online setting") for c in _CLAIMS[:3]),
                *_stale_claims(sweep, task, measured, small, large)]
    return _online_claims(sweep, task, measured, online, small, large) + \
        _stale_claims(sweep, task, measured, small, large)


def _per_seed(sweep, task: str, loss: str, delay: str, score: Callable) -> dict[int, float]:
    return sweep.seed_scores(task, loss, delay, score)


def _last(cell) -> float:
    return last_score(cell.summary["history"])


def _gap(cell) -> float:
    return best_to_last_gap(cell.summary["history"])


def _metric(key: str) -> Callable:
    return lambda cell: run_metric(cell, key)


def _paired(a: Mapping[int, float], b: Mapping[int, float]) -> Interval | None:
    return paired_ci(a, b) if set(a) & set(b) else None


def _label(measured: dict, delay: str) -> str:
    return f"{delay} (staleness {measured[delay]:.1f})"


def _online_claims(sweep, task: str, measured: dict, online: str, small: str, large: str) -> list[Claim]:
    """The claims that compare stale settings with the online one (the first three)."""
    def per_seed(loss: str, delay: str) -> dict[int, float]:
        return _per_seed(sweep, task, loss, delay, _last)

    def drop(loss: str) -> dict[int, float]:
        on, off = per_seed(loss, online), per_seed(loss, large)
        return {s: on[s] - off[s] for s in set(on) & set(off)}

    claims = []
    gepo_drop, grpo_drop = drop("gepo"), drop("grpo")
    iv = mean_ci(list(gepo_drop.values())) if gepo_drop else None
    claims.append(_decide(
        _CLAIMS[0], iv, lambda i: _small_verdict(i, -float("inf"), CLOSE),
        lambda i: f"GEPO's last-{LAST_EVALS}-evals success, {online} minus {_label(measured, large)}: {i} "
                  f"(its fall; n={i.n} seeds; 'little' = at most {CLOSE:.2f})"))
    iv = _paired(grpo_drop, gepo_drop)
    claims.append(_decide(
        _CLAIMS[1], iv, _order_verdict,
        lambda i: f"GRPO's fall minus GEPO's, {online} to {_label(measured, large)}: {i} (n={i.n}; GRPO "
                  f"{change(-_mean(grpo_drop))}, GEPO {change(-_mean(gepo_drop))})"))
    iv = _paired(per_seed("gepo", small), per_seed("grpo", small))
    if measured[small] <= SMALL_STALENESS:
        claims.append(_decide(
            _CLAIMS[2], iv, lambda i: _small_verdict(i, -CLOSE, CLOSE),
            lambda i: f"GEPO minus GRPO at {_label(measured, small)}: {i} (n={i.n}; 'close' = within ±{CLOSE:.2f})"))
    else:
        claims.append(_decide(
            _CLAIMS[2], iv, lambda i: NOT_DECIDED,
            lambda i: f"not tested: the least stale setting, {_label(measured, small)}, is above the "
                      f"{SMALL_STALENESS:g} versions taken as small; GEPO minus GRPO there: {i} (n={i.n})"))
    return claims


def _stale_claims(sweep, task: str, measured: dict, small: str, large: str) -> list[Claim]:
    """The claims that need stale settings only (the last two): late collapse, and the weights' variance."""
    def per_seed(loss: str, delay: str, score: Callable) -> dict[int, float]:
        return _per_seed(sweep, task, loss, delay, score)

    claims = []
    if "gspo" in sweep.losses:
        iv = _paired(per_seed("gspo", large, _gap), per_seed("gepo", large, _gap))
        claims.append(_decide(
            _CLAIMS[3], iv, _order_verdict,
            lambda i: f"GSPO's best-to-last gap minus GEPO's at {_label(measured, large)}: {i} (n={i.n}; gap = best "
                      f"eval minus the last-{LAST_EVALS}-evals score)"))
    else:
        claims.append(Claim(_CLAIMS[3], NOT_DECIDED, "the sweep lacks gspo"))
    seq_var, weight_var = _metric("ratio/seq_var"), _metric("is/weight_var")
    grows = _paired(per_seed("grpo", large, seq_var), per_seed("grpo", small, seq_var))
    lower = _paired(per_seed("gepo", large, weight_var), per_seed("gepo", large, seq_var))
    if small == large:
        claims.append(Claim(_CLAIMS[4], NOT_DECIDED, "the sweep has one stale setting: nothing to grow from"))
    elif grows is None or lower is None:
        claims.append(Claim(_CLAIMS[4], NOT_DECIDED, "the runs lack ratio/seq_var or is/weight_var"))
    else:
        both = (_order_verdict(grows), _order_verdict(Interval(-lower.mean, -lower.high, -lower.low, lower.n)))
        verdict = (REPRODUCED if both == (REPRODUCED, REPRODUCED) else
                   NOT_REPRODUCED if NOT_REPRODUCED in both else NOT_DECIDED)
        claims.append(Claim(_CLAIMS[4], verdict,
                            f"the variance of the sequence ratio p/q in GRPO's runs, {_label(measured, large)} minus "
                            f"{_label(measured, small)}: {grows} ({both[0]}); GEPO's own weight variance minus that "
                            f"of p/q in the same GEPO runs at {_label(measured, large)}: {lower} ({both[1]})"))
    return claims


def change(delta: float) -> str:
    """A change of held-out success in words, its sign said once: "rose by 0.012", "fell by 0.008", "did not
    change" (below half the last digit shown)."""
    if not math.isfinite(delta):
        return "changed by an unknown amount"
    if abs(delta) < 0.0005:
        return "did not change"
    return f"{'rose' if delta > 0 else 'fell'} by {abs(delta):.3f}"


def _mean(values: Mapping[int, float]) -> float:
    return sum(values.values()) / len(values) if values else float("nan")


def _decide(claim: str, interval: Interval | None, verdict, evidence) -> Claim:
    if interval is None:
        return Claim(claim, NOT_DECIDED, "no seed ran both settings")
    return Claim(claim, verdict(interval), evidence(interval))


_CLAIMS = (
    "GEPO degrades little from online to the largest staleness",
    "GRPO degrades more than GEPO",
    "At small staleness GEPO and GRPO are close",
    "GSPO's best-to-last gap is larger than GEPO's (at the largest staleness)",
    "Importance-weight variance grows with staleness, and GEPO's stays lower",
)

__all__ = ["CLOSE", "SMALL_STALENESS", "Claim", "best_to_last_gap", "change", "last_score", "paper_claims",
           "run_metric"]

"""Checkpoint interval and ETTR for a mix of failure kinds: closed form and Monte Carlo.

Model (all times in seconds of wall clock). Failures are a Poisson process of rate 1/M for the
whole job. The job computes ``tau`` then blocks ``delta`` to checkpoint, and repeats. A failure
throws away the work since the last committed checkpoint; it is of kind k with probability
``p_k`` (independently of everything else) and costs a recovery of ``R_k``; a failure during a
recovery starts a new recovery (of a freshly drawn kind).

Closed form. Let ``c = tau + delta`` and ``S = sum_k p_k exp(-R_k / M)`` (the chance that a
recovery finishes before the next failure). The expected time X from a failure until training
again satisfies ``X = sum_k p_k (1 - e^(-R_k/M)) M + (1 - S) X`` (a recovery ends at ``R_k``
or is cut by a failure after ``M (1 - e^(-R_k/M))`` on average), so ``M + X = M / S``. The
expected time to complete one cycle c from a fresh start satisfies ``T = M (1 - e^(-c/M))
+ (1 - e^(-c/M)) (X + T)``, so ``T = (e^(c/M) - 1) (M + X)``, and

    ETTR = tau / T = tau * sum_k p_k exp(-R_k / M) / (M * (exp((tau + delta) / M) - 1))

With a single kind this is Daly's (2006) exact form ``tau / (M e^(R/M) (e^(c/M) - 1))``.

Interval: Young (1974) ``sqrt(2 delta M)`` and Daly's (2006) higher-order optimum, which the
plan uses, rounded to whole steps (a checkpoint only happens between steps).

J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974.
J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3), 2006.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def young_interval_s(*, stall_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 delta M)."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval_s(*, stall_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum; tau = M once the stall reaches 2M."""
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = stall_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * stall_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall_s


def _check_mix(shares: Sequence[float], recoveries_s: Sequence[float]) -> None:
    if len(shares) != len(recoveries_s) or not shares:
        raise ValueError("need one recovery time per failure kind")
    if abs(sum(shares) - 1.0) > 1e-9 or min(shares) < 0:
        raise ValueError("failure kind shares must be >= 0 and sum to 1")


def ettr_mixed(
    *,
    interval_s: float,
    stall_s: float,
    mtbf_s: float,
    shares: Sequence[float],
    recoveries_s: Sequence[float],
) -> float:
    """The closed form above: tau * sum p_k e^(-R_k/M) / (M (e^((tau+delta)/M) - 1))."""
    _check_mix(shares, recoveries_s)
    survive = sum(p * math.exp(-r / mtbf_s) for p, r in zip(shares, recoveries_s, strict=True))
    return interval_s * survive / (mtbf_s * math.expm1((interval_s + stall_s) / mtbf_s))


def ettr_first_order(
    *,
    interval_s: float,
    stall_s: float,
    mtbf_s: float,
    shares: Sequence[float],
    recoveries_s: Sequence[float],
) -> float:
    """tau/(tau+delta) * (1 - (mean R + (tau+delta)/2) / M), floored at 0 (rare failures)."""
    _check_mix(shares, recoveries_s)
    mean_r = sum(p * r for p, r in zip(shares, recoveries_s, strict=True))
    cycle = interval_s + stall_s
    return max(0.0, interval_s / cycle * (1.0 - (mean_r + cycle / 2.0) / mtbf_s))


@dataclass(frozen=True)
class MonteCarlo:
    """ETTR over simulated jobs."""

    mean: float
    """Mean ETTR."""
    stderr: float
    """Standard error of the mean."""
    p5: float
    """5th percentile (an unlucky job)."""
    p95: float
    """95th percentile."""
    failures_mean: float
    """Mean failures per job."""


@dataclass(frozen=True)
class Draws:
    """Random numbers shared by every configuration (common random numbers)."""

    arrivals: np.ndarray
    """(trials, n) cumulative unit exponentials: times M * arrivals are Poisson(1/M)."""
    kinds: np.ndarray
    """(trials, n) uniforms: failure i is of the kind whose cumulative share first exceeds it."""


def draws(*, trials: int, max_failures_mean: float, seed: int) -> Draws:
    """Enough draws for a Poisson count of mean ``max_failures_mean`` (10 sigma margin)."""
    n = int(max_failures_mean + 10.0 * math.sqrt(max_failures_mean) + 20)
    rng = np.random.default_rng(seed)
    return Draws(
        arrivals=np.cumsum(rng.exponential(1.0, size=(trials, n)), axis=1),
        kinds=rng.random(size=(trials, n)),
    )


def simulate_ettr(
    *,
    draws: Draws,
    mtbf_s: float,
    interval_s: float,
    stall_s: float,
    shares: Sequence[float],
    recoveries_s: Sequence[float],
    job_s: float,
) -> MonteCarlo:
    """ETTR of simulated jobs of ``job_s`` seconds.

    Between two failures (a segment) the job first recovers (``R`` of the kind of the failure
    that opened the segment; none for the first segment); a segment shorter than that recovery
    does no work (the next failure starts a new recovery), otherwise it runs whole
    ``tau + delta`` cycles and loses the unfinished one. The end of the job keeps the work since
    the last checkpoint (the job ends cleanly).
    """
    _check_mix(shares, recoveries_s)
    arrivals = draws.arrivals * mtbf_s
    if (arrivals[:, -1] < job_s).any():
        raise ValueError("draws too short for this job length and MTBF")
    bounds = np.cumsum(shares)[:-1]
    kind = np.searchsorted(bounds, draws.kinds, side="right")
    per_failure = np.asarray(recoveries_s, dtype=float)[kind]
    ends = np.minimum(arrivals, job_s)
    starts = np.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    length = ends - starts  # 0 for segments after the job's end
    cost = np.zeros_like(length)
    cost[:, 1:] = per_failure[:, :-1]  # segment i opens with failure i-1's recovery
    usable = np.maximum(length - cost, 0.0)
    cycle = interval_s + stall_s
    cycles = np.floor(usable / cycle)
    work = cycles * interval_s
    by_failure = arrivals < job_s
    tail = np.minimum(usable - cycles * cycle, interval_s)
    work = np.where(by_failure, work, work + tail)
    ettr = work.sum(axis=1) / job_s
    return MonteCarlo(
        mean=float(ettr.mean()),
        stderr=float(ettr.std(ddof=1) / math.sqrt(len(ettr))) if len(ettr) > 1 else 0.0,
        p5=float(np.percentile(ettr, 5)),
        p95=float(np.percentile(ettr, 95)),
        failures_mean=float(by_failure.sum(axis=1).mean()),
    )

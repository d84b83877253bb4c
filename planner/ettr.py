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


# --- the product's model: commit lag, write drag, idle-only failures during a recovery -------


@dataclass(frozen=True, kw_only=True)
class Kind:
    """One failure outcome as the ETTR model sees it."""

    share: float
    """Probability that a failure is of this kind."""
    recovery_s: float
    """R: seconds from the failure until training resumes (no further failure)."""
    strikes_idle: bool
    """Also strikes while the job is recovering; else only while it trains."""
    resets: bool = True
    """Restores from storage: the work since the newest committed checkpoint is lost. False: a
    memory tier (planner.tiers) restores a newer state and only ``recompute_s`` is lost."""
    recompute_s: float = 0.0
    """Memory tiers: mean wall seconds of steps trained again (half a memory interval)."""


def busy_period_s(
    *, start_s: Sequence[float], idle_rate: float, idle: Sequence[Kind]
) -> list[float]:
    """Expected outage from a failure needing ``start_s`` until training resumes, for each start.

    During the outage, failures that can strike an idle cluster arrive at ``idle_rate`` with
    the mix ``idle`` (shares summing to 1); one at time t needing R moves the outage's end to
    ``max(end, t + R)`` (a failure during a recovery extends it, never shortens it). The time
    left D falls at rate 1 and jumps to ``max(D, R)`` at each arrival, so the expected time to
    reach 0 from D = d solves ``T'(d) = 1 + mu * sum_{R_j > d} q_j (T(R_j) - T(d))``, T(0) = 0:
    linear with constant coefficients between the R_j, so T is affine in the unknowns T(R_j)
    on each piece, and one small linear system gives them (exact; the busy period of an
    M/G/infinity queue when the start has the idle mix, ``(e^(mu R) - 1) / mu`` for one R).
    """
    mu = idle_rate
    # Kinds too rare to matter are left out (they would only add round-off).
    idle = [k for k in idle if k.share > 1e-12]
    if mu <= 0 or not idle:
        return [float(r) for r in start_s]
    points = sorted({float(k.recovery_s) for k in idle})
    n = len(points)
    q = np.zeros(n)
    for k in idle:
        q[points.index(float(k.recovery_s))] += k.share
    q /= q.sum()

    def advance(a: float, b: np.ndarray, lo: float, hi: float, i: int) -> tuple[float, np.ndarray]:
        # On (lo, hi) the recoveries above d are points[i:]: T' = 1 + mu*(c.T) - mu*A*T.
        mass = float(q[i:].sum()) if i < n else 0.0
        if mass <= 0:
            return a + (hi - lo), b
        c = np.zeros(n)
        c[i:] = q[i:] / mass
        # T(hi) = K + (T(lo) - K) e^(-x), K = (1 + mu c.T) / (mu mass); written with expm1 so
        # that a tiny mass (x -> 0) gives T(hi) = T(lo) + (hi - lo) without cancellation.
        x = mu * mass * (hi - lo)
        grow = -math.expm1(-x)
        e = 1.0 - grow
        return a * e + grow / (mu * mass), b * e + c * grow

    rows_a = np.zeros(n)
    rows_b = np.zeros((n, n))
    a, b, lo = 0.0, np.zeros(n), 0.0
    for i, hi in enumerate(points):
        a, b = advance(a, b, lo, hi, i)
        rows_a[i], rows_b[i] = a, b
        lo = hi
    t_at = np.linalg.solve(np.eye(n) - rows_b, rows_a)

    def value(d: float) -> float:
        a, b, lo = 0.0, np.zeros(n), 0.0
        for i, hi in enumerate(points):
            if d <= hi:
                a, b = advance(a, b, lo, d, i)
                return float(a + b @ t_at)
            a, b = advance(a, b, lo, hi, i)
            lo = hi
        return float(t_at[-1] + (d - points[-1]))

    return [value(float(d)) for d in start_s]


def memory_interval_steps(
    *, step_s: float, snapshot_stall_s: float, memory_rate_per_s: float
) -> int:
    """The memory snapshot interval (whole steps, >= 1) that minimises what the memory tiers
    cost per second of training: ``(1 + d / (m s)) (1 + lambda m s / 2)`` for a snapshot stall
    d and memory-tier failures at lambda; Young's optimum ``m s = sqrt(2 d / lambda)``, rounded
    to the better neighbour."""
    if memory_rate_per_s <= 0:
        return 1
    young = math.sqrt(2.0 * max(snapshot_stall_s, 1e-9) / memory_rate_per_s) / step_s
    lo = max(1, math.floor(young))

    def cost(m: int) -> float:
        span = m * step_s
        return (1.0 + snapshot_stall_s / span) * (1.0 + memory_rate_per_s * span / 2.0)

    return min((lo, lo + 1), key=cost)


def cycle_s(
    *, interval_s: float | np.ndarray, stall_s: float, write_s: float, drag: float
) -> float | np.ndarray:
    """Wall seconds per checkpoint cycle: compute, slowed by ``drag`` while the previous write
    runs, then the stall, then a wait if the previous write is still running."""
    compute = interval_s + drag * np.minimum(write_s, interval_s)
    return compute + stall_s + np.maximum(0.0, write_s - compute)


def outages_s(*, mtbf_s: float, kinds: Sequence[Kind]) -> list[float]:
    """Each kind's expected outage: from its failure while training until training resumes."""
    shares = [k.share for k in kinds]
    _check_mix(shares, [k.recovery_s for k in kinds])
    idle = [k for k in kinds if k.strikes_idle and k.share > 0]
    idle_share = sum(k.share for k in idle)
    idle_mix = [
        Kind(share=k.share / idle_share, recovery_s=k.recovery_s, strikes_idle=True) for k in idle
    ]
    return busy_period_s(
        start_s=[k.recovery_s for k in kinds], idle_rate=idle_share / mtbf_s, idle=idle_mix
    )


def outage_s(*, mtbf_s: float, kinds: Sequence[Kind]) -> float:
    """X: expected seconds from a failure while training until training resumes."""
    busy = outages_s(mtbf_s=mtbf_s, kinds=kinds)
    return sum(k.share * x for k, x in zip(kinds, busy, strict=True))


@dataclass(frozen=True, kw_only=True)
class Split:
    """The failure mix split by restore tier, as :func:`ettr_model` takes it."""

    reset_share: float
    """Share of failures that restore from storage (and lose the work since the last commit)."""
    outage: float
    """X_s: their mean outage (failures during it included)."""
    dilation: float
    """1 + lambda_m D_m: each second of training also costs the memory-tier failures' outages and
    recomputed steps (D_m, their mean) at their rate lambda_m."""
    mean_outage: float
    """X over every kind (:func:`outage_s`)."""


def split(*, mtbf_s: float, kinds: Sequence[Kind]) -> Split:
    """Storage restores on one side, memory restores (pauses that keep the progress) on the
    other; with every kind on storage this is ``Split(1, outage_s(...), 1)``."""
    busy = outages_s(mtbf_s=mtbf_s, kinds=kinds)
    reset = sum(k.share for k in kinds if k.resets)
    x_s = sum(k.share * x for k, x in zip(kinds, busy, strict=True) if k.resets)
    pause = sum(
        k.share * (x + k.recompute_s) for k, x in zip(kinds, busy, strict=True) if not k.resets
    )
    return Split(
        reset_share=reset,
        outage=x_s / reset if reset > 0 else 0.0,
        dilation=1.0 + pause / mtbf_s,
        mean_outage=sum(k.share * x for k, x in zip(kinds, busy, strict=True)),
    )


def ettr_model(
    *,
    interval_s: float | np.ndarray,
    stall_s: float,
    write_s: float,
    drag: float,
    mtbf_s: float,
    outage: float,
    reset_share: float = 1.0,
    dilation: float = 1.0,
    snapshot_stall_per_s: float = 0.0,
) -> float | np.ndarray:
    """ETTR with commit lag, write drag and the outage X from :func:`outage_s`.

    A checkpoint is restorable only once its write commits, ``W = write_s`` after its stall, so
    after a restart the k-th checkpoint commits at ``W + k c`` (c = :func:`cycle_s`). From the
    end of an outage, the time Y until the first of those cycles begins with no further
    failure satisfies ``M + Y = (M + X) e^(W/M)``, and each cycle of c needs c failure-free
    seconds to bank tau: ``T = (e^(c/M) - 1)(M + Y)``, so

        ETTR = tau e^(-W/M) / ((e^(c/M) - 1) (M + X))

    With W = 0 and X = sum p_k R_k this is Daly's (2006) form for a mix.

    Restore tiers (:func:`split`): only a share ``p_s`` of the failures restores from storage
    and loses the work since the last commit; they arrive at ``r = p_s / M`` and ``outage`` is
    their X_s. The others (memory tiers) pause training for their outage plus the steps they
    recompute and keep the progress: each second of training costs ``g = dilation`` seconds of
    wall clock. Memory snapshots block ``snapshot_stall_per_s`` per second of training. Then

        ETTR = tau e^(-W r) / ((e^(c r) - 1) (g / r + X_s))

    which is the form above when ``p_s = 1, g = 1``, and ``tau / (c g)`` when ``p_s = 0``.
    """
    tau = np.asarray(interval_s, dtype=float)
    c = cycle_s(interval_s=tau, stall_s=stall_s, write_s=write_s, drag=drag)
    c = c + tau * snapshot_stall_per_s
    if reset_share > 0:
        r = reset_share / mtbf_s
        grow = np.expm1(c * r)
        out = tau * math.exp(-write_s * r) / (grow * (dilation / r + outage))
    else:
        out = tau / (c * dilation)
    return float(out) if np.ndim(out) == 0 else out


def best_interval_steps(
    *,
    step_s: float,
    stall_s: float,
    write_s: float,
    drag: float,
    mtbf_s: float,
    outage: float,
    reset_share: float = 1.0,
    dilation: float = 1.0,
    snapshot_stall_per_s: float = 0.0,
) -> int:
    """The whole number of steps that maximises :func:`ettr_model` (searched, not a formula:
    the commit lag and the wait for a long write move it away from Daly's optimum)."""
    reset_mtbf = mtbf_s / max(reset_share, 1e-9)
    guess = daly_interval_s(stall_s=max(stall_s, 1e-3), mtbf_s=reset_mtbf) + write_s
    top = max(4, int(4 * max(guess, write_s, step_s) / step_s) + 4)
    kw = {
        "stall_s": stall_s,
        "write_s": write_s,
        "drag": drag,
        "mtbf_s": mtbf_s,
        "outage": outage,
        "reset_share": reset_share,
        "dilation": dilation,
        "snapshot_stall_per_s": snapshot_stall_per_s,
    }
    steps = np.unique(np.geomspace(1, top, 400).astype(int))
    values = ettr_model(interval_s=steps * step_s, **kw)
    best = int(steps[int(np.argmax(values))])
    # Refine around the coarse optimum (the grid is geometric).
    fine = np.arange(max(1, best // 2), best * 2 + 2)
    values = ettr_model(interval_s=fine * step_s, **kw)
    return int(fine[int(np.argmax(values))])


@dataclass(frozen=True, kw_only=True)
class SimKind:
    """One failure kind for the Monte Carlo: the pool decides whether a spare takes it."""

    share: float
    """Probability that a failure is of this kind."""
    recovery_s: float
    """R without a spare."""
    spare_recovery_s: float
    """R when a free spare takes the failed node's place (= recovery_s if no node is needed)."""
    needs_node: bool
    """Takes a spare when one is free."""
    strikes_idle: bool
    """Also strikes during a recovery."""
    resets: bool = True
    """Restores from storage (see :class:`Kind`)."""
    recompute_s: float = 0.0
    """Memory tiers: wall seconds of steps trained again."""
    spare_resets: bool = True
    """The same when a spare takes the failed node's place."""
    spare_recompute_s: float = 0.0


def simulate(
    *,
    draws: Draws,
    mtbf_s: float,
    kinds: Sequence[SimKind],
    spares: int,
    refill_s: float,
    interval_s: float,
    stall_s: float,
    write_s: float,
    drag: float,
    job_s: float,
    snapshot_stall_per_s: float = 0.0,
) -> MonteCarlo:
    """ETTR of simulated jobs of ``job_s`` seconds, failure by failure (vectorised over jobs).

    Failures arrive at 1/M. One that arrives while the job trains banks the checkpoints
    committed since training resumed (the k-th at ``W + k c``) and opens an outage of its R;
    one that arrives during an outage strikes only if its kind can strike an idle cluster, and
    then moves the outage's end to ``max(end, t + R)``. A node failure takes a free spare (the
    spare comes back ``refill_s`` later) or, when all are in refill, takes none and needs a new
    node. The job ends cleanly: the work since the last checkpoint counts.

    A kind that restores from a memory tier (``resets`` False) keeps the progress: training
    resumes where it stood less ``recompute_s``, and the commit schedule moves by the pause. A
    storage restore that strikes during such a pause banks the checkpoints committed before it.
    """
    shares = [k.share for k in kinds]
    _check_mix(shares, [k.recovery_s for k in kinds])
    arrivals = draws.arrivals * mtbf_s
    if (arrivals[:, -1] < job_s).any():
        raise ValueError("draws too short for this job length and MTBF")
    kind = np.searchsorted(np.cumsum(shares)[:-1], draws.kinds, side="right")
    r_none = np.asarray([k.recovery_s for k in kinds])[kind]
    r_spare = np.asarray([k.spare_recovery_s for k in kinds])[kind]
    needs = np.asarray([k.needs_node for k in kinds])[kind]
    idle = np.asarray([k.strikes_idle for k in kinds])[kind]
    resets = np.asarray([k.resets for k in kinds])[kind]
    recompute = np.asarray([k.recompute_s for k in kinds], dtype=float)[kind]
    spare_resets = np.asarray([k.spare_resets if k.needs_node else k.resets for k in kinds])[kind]
    spare_recompute = np.asarray(
        [k.spare_recompute_s if k.needs_node else k.recompute_s for k in kinds], dtype=float
    )[kind]
    trials = arrivals.shape[0]
    rows = np.arange(trials)
    c = float(cycle_s(interval_s=interval_s, stall_s=stall_s, write_s=write_s, drag=drag))
    c += interval_s * snapshot_stall_per_s
    # Progress since the last storage restore is (wall clock - train_from) while training.
    train_from = np.zeros(trials)
    out_end = np.zeros(trials)
    work = np.zeros(trials)
    struck = np.zeros(trials)
    # In an outage that keeps the progress (a memory-tier restore), and its progress then.
    paused = np.zeros(trials, dtype=bool)
    paused_at = np.zeros(trials)
    pool = np.zeros((trials, max(spares, 1)))
    for i in range(arrivals.shape[1]):
        t = arrivals[:, i]
        live = t < job_s
        if not live.any():
            break
        recovering = t < out_end
        strikes = live & (~recovering | idle[:, i])
        training = strikes & ~recovering
        r = r_none[:, i]
        keeps = ~resets[:, i]
        lose = recompute[:, i]
        if spares > 0:
            j = pool.argmin(axis=1)
            use = strikes & needs[:, i] & (pool[rows, j] <= t)
            pool[rows[use], j[use]] = t[use] + refill_s
            r = np.where(use, r_spare[:, i], r)
            keeps = np.where(use, ~spare_resets[:, i], keeps)
            lose = np.where(use, spare_recompute[:, i], lose)
        progress = np.where(training, t - train_from, paused_at)
        bank = strikes & ~keeps & (training | paused)
        banked = np.floor(np.maximum(progress - write_s, 0.0) / c)
        work += np.where(bank, banked * interval_s, 0.0)
        end = np.where(training, t + r, np.maximum(out_end, t + r))
        # Where the progress resumes after this outage: 0 after a storage restore; the progress
        # less the recomputed steps after a memory restore (during a storage restore's outage a
        # memory-tier failure only extends it).
        resume = np.where(
            training & keeps,
            np.maximum(progress - lose, 0.0),
            np.where(paused & keeps, out_end - train_from, 0.0),
        )
        kept = keeps & (training | paused)
        paused_at = np.where(strikes & training & keeps, progress, paused_at)
        paused = np.where(strikes, kept, paused)
        out_end = np.where(strikes, end, out_end)
        train_from = np.where(strikes, out_end - resume, train_from)
        struck += strikes
    # A job that ends inside a memory restore's outage keeps the progress it resumes from.
    left = np.where(
        job_s >= out_end,
        np.maximum(job_s - train_from, 0.0),
        np.where(paused, out_end - train_from, 0.0),
    )
    cycles = np.floor(left / c)
    work += cycles * interval_s + np.minimum(left - cycles * c, interval_s)
    ettr = work / job_s
    return MonteCarlo(
        mean=float(ettr.mean()),
        stderr=float(ettr.std(ddof=1) / math.sqrt(len(ettr))) if len(ettr) > 1 else 0.0,
        p5=float(np.percentile(ettr, 5)),
        p95=float(np.percentile(ettr, 95)),
        failures_mean=float(struck.mean()),
    )

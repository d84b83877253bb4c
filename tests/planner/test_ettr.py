"""Tests of planner.ettr: intervals, the closed forms, the outage and the Monte Carlo.

Run: .venv/bin/python -m pytest tests/planner/test_ettr.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.ettr import (
    Kind,
    SimKind,
    best_interval_steps,
    busy_period_s,
    cycle_s,
    daly_interval_s,
    draws,
    ettr_first_order,
    ettr_mixed,
    ettr_model,
    outage_s,
    simulate,
    young_interval_s,
)

DAY = 86_400.0


def test_young_and_daly_intervals() -> None:
    assert young_interval_s(stall_s=2.0, mtbf_s=10_000.0) == pytest.approx(200.0)
    # Daly: 200 * (1 + sqrt(1e-4)/3 + 1e-4/9) - 2
    assert daly_interval_s(stall_s=2.0, mtbf_s=10_000.0) == pytest.approx(
        200.0 * (1 + 0.01 / 3 + 1e-4 / 9) - 2.0
    )
    assert daly_interval_s(stall_s=300.0, mtbf_s=100.0) == 100.0  # stall >= 2M: tau = M


def test_mixed_form_is_dalys_for_one_kind_and_hand_computed_for_three() -> None:
    kw = {"interval_s": 200.0, "stall_s": 2.0, "mtbf_s": 2000.0}
    # One kind: Daly (2006) tau / (M e^(R/M) (e^((tau+delta)/M) - 1)).
    daly = 200.0 / (2000.0 * math.exp(60 / 2000) * math.expm1(202 / 2000))
    assert ettr_mixed(shares=[1.0], recoveries_s=[60.0], **kw) == pytest.approx(daly)
    # Three kinds, by hand: S = 0.5 e^-0.01 + 0.3 e^-0.1 + 0.2 e^-0.5.
    s = 0.5 * math.exp(-0.01) + 0.3 * math.exp(-0.1) + 0.2 * math.exp(-0.5)
    expected = 200.0 * s / (2000.0 * (math.exp(0.101) - 1.0))
    got = ettr_mixed(shares=[0.5, 0.3, 0.2], recoveries_s=[20.0, 200.0, 1000.0], **kw)
    assert got == pytest.approx(expected)
    # A mix is not its mean recovery: e^(-R/M) is convex, so the mix does better.
    mean_r = 0.5 * 20 + 0.3 * 200 + 0.2 * 1000
    assert got > ettr_mixed(shares=[1.0], recoveries_s=[mean_r], **kw)


def test_first_order_matches_when_failures_are_rare_and_floors_at_zero() -> None:
    kw = {"interval_s": 200.0, "stall_s": 2.0, "shares": [0.5, 0.5], "recoveries_s": [20, 100]}
    rare = ettr_mixed(mtbf_s=1e6, **kw)
    assert rare == pytest.approx(ettr_first_order(mtbf_s=1e6, **kw), abs=1e-4)
    assert rare == pytest.approx(200 / 202 * (1 - (60 + 101) / 1e6), abs=1e-6)
    assert ettr_first_order(mtbf_s=100.0, **kw) == 0.0


def test_bad_mix_is_rejected() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        ettr_mixed(interval_s=1, stall_s=1, mtbf_s=1, shares=[0.5, 0.4], recoveries_s=[1, 2])
    with pytest.raises(ValueError, match="one recovery"):
        ettr_mixed(interval_s=1, stall_s=1, mtbf_s=1, shares=[1.0], recoveries_s=[1, 2])


def test_busy_period_single_recovery_is_the_m_g_infinity_busy_period() -> None:
    mu, r = 1 / 1800, 1200.0
    one = [Kind(share=1.0, recovery_s=r, strikes_idle=True)]
    got = busy_period_s(start_s=[r, 0.0], idle_rate=mu, idle=one)
    assert got[0] == pytest.approx(math.expm1(mu * r) / mu)
    assert got[1] == 0.0
    # Nothing strikes an idle cluster: the outage is R itself.
    assert busy_period_s(start_s=[r], idle_rate=0.0, idle=one) == [r]


def test_busy_period_is_monotone_and_extends_long_starts_by_idle_arrivals() -> None:
    mu = 1 / 1800
    idle = [
        Kind(share=0.7, recovery_s=1200.0, strikes_idle=True),
        Kind(share=0.3, recovery_s=100.0, strikes_idle=True),
    ]
    xs = busy_period_s(start_s=[50.0, 100.0, 1200.0, 3000.0], idle_rate=mu, idle=idle)
    assert xs == sorted(xs)
    assert all(x > d for x, d in zip(xs, [50.0, 100.0, 1200.0, 3000.0], strict=True))
    # Above the longest idle recovery the outage only adds time 1:1.
    assert xs[3] - xs[2] == pytest.approx(1800.0)


def _mix() -> list[Kind]:
    return [
        Kind(share=0.76, recovery_s=1400.0, strikes_idle=True),
        Kind(share=0.14, recovery_s=170.0, strikes_idle=False),
        Kind(share=0.10, recovery_s=200.0, strikes_idle=False),
    ]


def test_ettr_model_is_dalys_form_without_lag_or_idle_failures() -> None:
    kinds = [Kind(share=k.share, recovery_s=k.recovery_s, strikes_idle=False) for k in _mix()]
    x = outage_s(mtbf_s=3600.0, kinds=kinds)
    assert x == pytest.approx(sum(k.share * k.recovery_s for k in kinds))
    got = ettr_model(interval_s=300.0, stall_s=0.5, write_s=0.0, drag=0.0, mtbf_s=3600.0, outage=x)
    expected = 300.0 / ((3600.0 + x) * math.expm1(300.5 / 3600.0))
    assert got == pytest.approx(expected)


def test_commit_lag_and_drag_cost_what_the_derivation_says() -> None:
    kw = {"interval_s": 300.0, "stall_s": 0.5, "mtbf_s": 3600.0, "outage": 500.0}
    base = ettr_model(write_s=0.0, drag=0.0, **kw)
    lagged = ettr_model(write_s=72.0, drag=0.0, **kw)
    assert lagged / base == pytest.approx(math.exp(-72.0 / 3600.0))
    dragged = ettr_model(write_s=72.0, drag=0.05, **kw)
    assert dragged < lagged
    assert cycle_s(interval_s=300.0, stall_s=0.5, write_s=72.0, drag=0.05) == 300.0 + 3.6 + 0.5
    # A write longer than the compute makes the next save wait for it.
    assert cycle_s(interval_s=60.0, stall_s=0.5, write_s=100.0, drag=0.0) == 100.5


def test_best_interval_is_the_argmax_in_whole_steps() -> None:
    kw = {"stall_s": 0.5, "write_s": 40.0, "drag": 0.02, "mtbf_s": 3600.0, "outage": 600.0}
    steps = best_interval_steps(step_s=10.0, **kw)
    at = {n: ettr_model(interval_s=n * 10.0, **kw) for n in (steps - 1, steps, steps + 1)}
    assert at[steps] >= at[steps - 1] and at[steps] >= at[steps + 1]
    # The commit lag and the drag lengthen the interval beyond Daly's (no lag) optimum.
    assert steps * 10.0 > daly_interval_s(stall_s=0.5, mtbf_s=3600.0)


def _sim_kinds(spare_r: float = 200.0) -> list[SimKind]:
    return [
        SimKind(
            share=0.76,
            recovery_s=1400.0,
            spare_recovery_s=spare_r,
            needs_node=True,
            strikes_idle=True,
        ),
        SimKind(
            share=0.14,
            recovery_s=170.0,
            spare_recovery_s=170.0,
            needs_node=False,
            strikes_idle=False,
        ),
        SimKind(
            share=0.10,
            recovery_s=200.0,
            spare_recovery_s=200.0,
            needs_node=False,
            strikes_idle=False,
        ),
    ]


@pytest.mark.parametrize("mtbf", [1800.0, 3600.0])
def test_monte_carlo_agrees_with_the_closed_form(mtbf: float) -> None:
    """Tolerance: the Monte Carlo estimates a finite job, the formula the long-run ratio.

    They differ by (a) noise, bounded here by 4 standard errors of the mean, and (b) the ends
    of the job: the first segment pays no recovery or commit lag and the last keeps its
    uncommitted work and cuts one cycle or outage, so |bias| <= (2 X_max + tau + W + delta) /
    job_s with X_max the longest expected outage (taken as 3 R_max). 60-day jobs: < 0.3%.
    """
    tau, stall, write, job_s, trials = 300.0, 0.5, 60.0, 60 * DAY, 200
    d = draws(trials=trials, max_failures_mean=job_s / mtbf, seed=11)
    kinds = _sim_kinds()
    mc = simulate(
        draws=d,
        mtbf_s=mtbf,
        kinds=kinds,
        spares=0,
        refill_s=1.0,
        interval_s=tau,
        stall_s=stall,
        write_s=write,
        drag=0.0,
        job_s=job_s,
    )
    x = outage_s(mtbf_s=mtbf, kinds=_mix())
    formula = ettr_model(
        interval_s=tau, stall_s=stall, write_s=write, drag=0.0, mtbf_s=mtbf, outage=x
    )
    tolerance = 4 * mc.stderr + (2 * 3 * 1400.0 + tau + write + stall) / job_s
    assert tolerance < 0.006  # the check means something
    assert abs(mc.mean - formula) < tolerance
    assert mc.p5 < mc.mean < mc.p95


def test_monte_carlo_without_failures_is_checkpoint_overhead_only() -> None:
    d = draws(trials=4, max_failures_mean=1.0, seed=0)
    d = type(d)(arrivals=d.arrivals + 1e9, kinds=d.kinds)  # no failure within the job
    mc = simulate(
        draws=d,
        mtbf_s=1.0,
        kinds=[
            SimKind(
                share=1.0,
                recovery_s=50.0,
                spare_recovery_s=50.0,
                needs_node=False,
                strikes_idle=False,
            )
        ],
        spares=0,
        refill_s=1.0,
        interval_s=97.0,
        stall_s=3.0,
        write_s=20.0,
        drag=0.0,
        job_s=1000.0,
    )
    assert mc.mean == pytest.approx(0.97)  # 10 cycles of 97 s compute + 3 s stall
    assert mc.failures_mean == 0


def test_monte_carlo_spares_shorten_node_failures() -> None:
    d = draws(trials=100, max_failures_mean=200.0, seed=3)
    kw = {
        "draws": d,
        "mtbf_s": 3000.0,
        "interval_s": 200.0,
        "stall_s": 1.0,
        "write_s": 10.0,
        "drag": 0.0,
        "job_s": 5e5,
        "refill_s": 4 * 3600.0,
    }
    none = simulate(kinds=_sim_kinds(), spares=0, **kw)
    some = simulate(kinds=_sim_kinds(), spares=8, **kw)
    assert some.mean > none.mean + 0.05
    # A spare that changes nothing changes nothing.
    same = simulate(kinds=_sim_kinds(spare_r=1400.0), spares=8, **kw)
    assert same.mean == pytest.approx(none.mean)


def test_draws_are_seeded_and_checked_for_length() -> None:
    a, b = (
        draws(trials=5, max_failures_mean=10, seed=1),
        draws(trials=5, max_failures_mean=10, seed=1),
    )
    assert np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.kinds, b.kinds)
    with pytest.raises(ValueError, match="too short"):
        simulate(
            draws=a,
            mtbf_s=1.0,
            kinds=_sim_kinds(),
            spares=0,
            refill_s=1.0,
            interval_s=1,
            stall_s=1,
            write_s=0.0,
            drag=0.0,
            job_s=1e6,
        )


def test_busy_period_is_stable_with_vanishing_kinds() -> None:
    """A kind with a share of 1e-40 (a spare pool that is practically never empty) must not
    change the outage: the piecewise solution is written without cancellation."""
    mu = 1 / 1800
    base = [Kind(share=1.0, recovery_s=300.0, strikes_idle=True)]
    tiny = [*base, Kind(share=1e-40, recovery_s=1600.0, strikes_idle=True)]
    tiny_10 = [*base, Kind(share=1e-10, recovery_s=1600.0, strikes_idle=True)]
    want = busy_period_s(start_s=[300.0, 1600.0], idle_rate=mu, idle=base)
    assert busy_period_s(start_s=[300.0, 1600.0], idle_rate=mu, idle=tiny) == pytest.approx(want)
    assert busy_period_s(start_s=[300.0, 1600.0], idle_rate=mu, idle=tiny_10) == pytest.approx(
        want, rel=1e-6
    )

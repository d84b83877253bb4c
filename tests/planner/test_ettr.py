"""Tests of planner.ettr: intervals, the mixed-failure closed form and the Monte Carlo.

Run: .venv/bin/python -m pytest tests/planner/test_ettr.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.ettr import (
    daly_interval_s,
    draws,
    ettr_first_order,
    ettr_mixed,
    simulate_ettr,
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


@pytest.mark.parametrize("mtbf", [1800.0, 3600.0])
def test_monte_carlo_agrees_with_the_closed_form(mtbf: float) -> None:
    """Tolerance: the Monte Carlo estimates a finite job, the formula the long-run ratio.

    The two differ by (a) noise, bounded here by 4 standard errors of the mean, and (b) the
    ends of the job: the first segment pays no recovery (at most R_max of extra work) and the
    last keeps its uncheckpointed work and cuts one cycle or recovery (at most tau + delta +
    R_max), so |bias| <= (2 R_max + tau + delta) / job_s. With 60-day jobs that is < 0.1%.
    """
    shares, recs = [0.766, 0.134, 0.1], [1400.0, 170.0, 200.0]
    tau, stall, job_s, trials = 300.0, 0.5, 60 * DAY, 300
    d = draws(trials=trials, max_failures_mean=job_s / mtbf, seed=11)
    kw = {"interval_s": tau, "stall_s": stall, "mtbf_s": mtbf, "shares": shares}
    mc = simulate_ettr(draws=d, job_s=job_s, recoveries_s=recs, **kw)
    formula = ettr_mixed(recoveries_s=recs, **kw)
    tolerance = 4 * mc.stderr + (2 * max(recs) + tau + stall) / job_s
    assert tolerance < 0.005  # the check means something
    assert abs(mc.mean - formula) < tolerance
    assert mc.p5 < mc.mean < mc.p95
    assert mc.failures_mean == pytest.approx(job_s / mtbf, rel=0.02)


def test_monte_carlo_samples_the_mix() -> None:
    d = draws(trials=200, max_failures_mean=100.0, seed=5)
    # The draws pick kinds in proportion to the shares.
    bounds = np.cumsum([0.7, 0.2, 0.1])[:-1]
    kinds = np.searchsorted(bounds, d.kinds, side="right")
    freq = np.bincount(kinds.ravel(), minlength=3) / kinds.size
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.01)
    # All weight on one kind = a single-kind run with that recovery.
    kw = {"draws": d, "mtbf_s": 3000.0, "interval_s": 200.0, "stall_s": 1.0, "job_s": 2e5}
    only_last = simulate_ettr(shares=[0.0, 0.0, 1.0], recoveries_s=[10, 20, 900], **kw)
    single = simulate_ettr(shares=[1.0], recoveries_s=[900], **kw)
    assert only_last == single
    cheap = simulate_ettr(shares=[1.0, 0.0, 0.0], recoveries_s=[10, 20, 900], **kw)
    assert cheap.mean > only_last.mean


def test_monte_carlo_without_failures_is_checkpoint_overhead_only() -> None:
    d = draws(trials=4, max_failures_mean=1.0, seed=0)
    d = type(d)(arrivals=d.arrivals + 1e9, kinds=d.kinds)  # no failure within the job
    mc = simulate_ettr(
        draws=d,
        mtbf_s=1.0,
        interval_s=97.0,
        stall_s=3.0,
        shares=[1.0],
        recoveries_s=[50.0],
        job_s=1000.0,
    )
    assert mc.mean == pytest.approx(0.97)  # 10 cycles of 97 s compute + 3 s stall
    assert mc.failures_mean == 0


def test_draws_are_seeded_and_checked_for_length() -> None:
    a, b = (
        draws(trials=5, max_failures_mean=10, seed=1),
        draws(trials=5, max_failures_mean=10, seed=1),
    )
    assert np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.kinds, b.kinds)
    with pytest.raises(ValueError, match="too short"):
        simulate_ettr(
            draws=a, mtbf_s=1.0, interval_s=1, stall_s=1, shares=[1.0], recoveries_s=[1], job_s=1e6
        )

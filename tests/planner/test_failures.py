"""Tests of planner.failures: rates, the Llama 3 mix, hot spares and lemon nodes.

Run: .venv/bin/python -m pytest tests/planner/test_failures.py -q
"""

from __future__ import annotations

import math

import pytest

from planner.failures import (
    FAILURE_RATES,
    FailureModel,
    job_failure_rate_per_s,
    llama3_mix,
    outcomes,
    poisson_sf,
)

DAY = 86_400.0


def test_llama3_rate_reproduces_the_papers_count() -> None:
    # 3.8 per 1,000 node-days on 2,048 nodes for 54 days: the paper's 419 (within rounding).
    model = FailureModel(rate_per_1000_node_days=FAILURE_RATES["llama3"], kinds=llama3_mix())
    rate = job_failure_rate_per_s(model=model, nodes=2048)
    assert rate == pytest.approx(3.8 / 1000 * 2048 / DAY)
    assert rate * 54 * DAY == pytest.approx(419, rel=0.01)


def test_llama3_mix_from_table_5_and_rescaled() -> None:
    kinds = {k.name: k for k in llama3_mix()}
    assert kinds["hardware"].share == pytest.approx(321 / 419)
    assert kinds["software"].share == pytest.approx(56 / 419)
    assert kinds["network"].share == pytest.approx(42 / 419)
    assert kinds["hardware"].needs_node and not kinds["software"].needs_node
    assert kinds["network"].hangs and not kinds["software"].hangs
    scaled = {k.name: k.share for k in llama3_mix(hardware_share=0.78)}
    assert scaled["hardware"] == 0.78
    assert scaled["software"] / scaled["network"] == pytest.approx(56 / 42)
    assert sum(scaled.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        llama3_mix(hardware_share=1.5)


def test_poisson_tail() -> None:
    assert poisson_sf(k=0, mean=2.0) == 1.0
    assert poisson_sf(k=1, mean=2.0) == pytest.approx(1 - math.exp(-2))
    assert poisson_sf(k=3, mean=2.0) == pytest.approx(1 - math.exp(-2) * (1 + 2 + 2))


def test_hot_spares_split_hardware_failures() -> None:
    model = FailureModel(rate_per_1000_node_days=3.8, kinds=llama3_mix(), hot_spares=2)
    nodes, replace = 12_500, 1205.0
    outs = {o.kind: o for o in outcomes(model=model, nodes=nodes, node_replace_s=replace)}
    assert sum(o.share for o in outs.values()) == pytest.approx(1.0)
    hw_rate = 3.8 / 1000 * (321 / 419) * nodes / DAY
    no_spare = poisson_sf(k=2, mean=hw_rate * replace)
    assert outs["hardware"].share == pytest.approx(321 / 419 * no_spare)
    assert outs["hardware+spare"].share == pytest.approx(321 / 419 * (1 - no_spare))
    assert outs["hardware+spare"].spare and not outs["hardware"].spare
    many = FailureModel(rate_per_1000_node_days=3.8, kinds=llama3_mix(), hot_spares=50)
    share = {o.kind: o.share for o in outcomes(model=many, nodes=nodes, node_replace_s=replace)}
    assert share["hardware"] < 1e-50  # 50 spares all in repair at once: practically never


def test_excluding_lemons_removes_their_share_of_hardware_failures() -> None:
    base = FailureModel(rate_per_1000_node_days=4.0, kinds=llama3_mix())
    lemons = FailureModel(
        rate_per_1000_node_days=4.0, kinds=llama3_mix(), lemon_share=0.25, exclude_lemons=True
    )
    hw = 321 / 419
    r0 = job_failure_rate_per_s(model=base, nodes=1000)
    r1 = job_failure_rate_per_s(model=lemons, nodes=1000)
    assert r1 == pytest.approx(r0 * (1 - 0.25 * hw))
    share = {o.kind: o.share for o in outcomes(model=lemons, nodes=1000, node_replace_s=1.0)}
    assert share["hardware"] == pytest.approx(0.75 * hw / (1 - 0.25 * hw))
    kept = FailureModel(rate_per_1000_node_days=4.0, kinds=llama3_mix(), lemon_share=0.25)
    assert job_failure_rate_per_s(model=kept, nodes=1000) == pytest.approx(r0)


def test_model_validation() -> None:
    with pytest.raises(ValueError, match="rate"):
        FailureModel(rate_per_1000_node_days=0, kinds=llama3_mix())
    with pytest.raises(ValueError, match="spares"):
        FailureModel(rate_per_1000_node_days=1, kinds=llama3_mix(), hot_spares=-1)

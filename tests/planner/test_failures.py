"""Tests of planner.failures and planner.spares: rates, the Llama 3 mix, the spare pool, lemons.

Run: .venv/bin/python -m pytest tests/planner/test_failures.py -q
"""

from __future__ import annotations

import math

import pytest

from planner.failures import (
    FAILURE_RATES,
    FailureModel,
    job_failure_rate_per_s,
    kind_rates_per_s,
    llama3_mix,
    node_failure_rate_per_s,
    outcomes,
    poisson_sf,
)
from planner.spares import erlang_b, spares_needed

DAY = 86_400.0


def test_llama3_rate_reproduces_the_papers_count() -> None:
    # 3.8 per 1,000 node-days on 2,048 nodes for 54 days: the paper's 419 (within rounding).
    model = FailureModel(rate_per_1000_node_days=FAILURE_RATES["llama3"], kinds=llama3_mix())
    rate = job_failure_rate_per_s(model=model, nodes=2048)
    assert rate == pytest.approx(3.8 / 1000 * 2048 / DAY)
    assert rate * 54 * DAY == pytest.approx(419, rel=0.01)


def test_llama3_mix_from_table_5_counts_and_rescaled() -> None:
    kinds = {k.name: k for k in llama3_mix()}
    keep = 416 / 419  # three of the 419 needed a person (sec. 3.3.4)
    assert kinds["gpu"].share == pytest.approx(keep * 268 / 419)
    assert kinds["host"].share == pytest.approx(keep * 53 / 419)
    assert kinds["software"].share == pytest.approx(keep * 56 / 419)
    assert kinds["network"].share == pytest.approx(keep * 42 / 419)
    assert kinds["manual"].share == pytest.approx(3 / 419)
    assert kinds["gpu"].needs_node and kinds["host"].host and not kinds["software"].needs_node
    assert kinds["network"].hangs and not kinds["software"].hangs
    # Node hardware strikes an idle cluster; faults of the training code do not.
    assert [k.name for k in kinds.values() if k.strikes_idle] == ["gpu", "host"]
    scaled = {k.name: k.share for k in llama3_mix(hardware_share=0.78)}
    assert scaled["gpu"] + scaled["host"] == pytest.approx(keep * 0.78)
    assert scaled["software"] / scaled["network"] == pytest.approx(56 / 42)
    assert sum(scaled.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        llama3_mix(hardware_share=1.5)


def test_software_per_job_does_not_grow_with_the_job() -> None:
    per_node = FailureModel(rate_per_1000_node_days=3.8, kinds=llama3_mix())
    per_job = FailureModel(rate_per_1000_node_days=3.8, kinds=llama3_mix(per_job_software=True))
    # Same at Llama 3's 2,048 nodes, fewer software faults above it.
    assert job_failure_rate_per_s(model=per_job, nodes=2048) == pytest.approx(
        job_failure_rate_per_s(model=per_node, nodes=2048)
    )
    big = {n: kind_rates_per_s(model=m, nodes=12_500) for n, m in [("n", per_node), ("j", per_job)]}
    assert big["j"]["software"] == pytest.approx(big["n"]["software"] * 2048 / 12_500)
    assert big["j"]["gpu"] == big["n"]["gpu"]


def test_poisson_tail() -> None:
    assert poisson_sf(k=0, mean=2.0) == 1.0
    assert poisson_sf(k=1, mean=2.0) == pytest.approx(1 - math.exp(-2))
    assert poisson_sf(k=3, mean=2.0) == pytest.approx(1 - math.exp(-2) * (1 + 2 + 2))


def test_erlang_b_by_hand_and_the_count_for_one_percent() -> None:
    assert erlang_b(spares=0, load=2.0) == 1.0
    assert erlang_b(spares=1, load=2.0) == pytest.approx(2 / 3)
    assert erlang_b(spares=2, load=2.0) == pytest.approx((4 / 2) / (1 + 2 + 4 / 2))
    k = spares_needed(load=2.0)
    assert erlang_b(spares=k, load=2.0) < 0.01 <= erlang_b(spares=k - 1, load=2.0)
    # A loss pool blocks less than the infinite-server tail the planner used before.
    assert erlang_b(spares=4, load=2.0) < poisson_sf(k=4, mean=2.0)


def test_hot_spares_split_node_failures_by_erlang_b() -> None:
    model = FailureModel(rate_per_1000_node_days=3.8, kinds=llama3_mix(), hot_spares=2)
    nodes, refill = 12_500, 4 * 3600.0
    outs = {o.kind: o for o in outcomes(model=model, nodes=nodes, refill_s=refill)}
    assert sum(o.share for o in outs.values()) == pytest.approx(1.0)
    node_rate = node_failure_rate_per_s(model=model, nodes=nodes)
    assert node_rate == pytest.approx(3.8 / 1000 * (321 / 419) * (416 / 419) * nodes / DAY)
    blocked = erlang_b(spares=2, load=node_rate * refill)
    gpu = llama3_mix()[0].share
    assert outs["gpu"].share == pytest.approx(gpu * blocked)
    assert outs["gpu+spare"].share == pytest.approx(gpu * (1 - blocked))
    assert outs["gpu+spare"].spare and not outs["gpu"].spare and outs["host+spare"].host
    many = FailureModel(rate_per_1000_node_days=3.8, kinds=llama3_mix(), hot_spares=80)
    share = {o.kind: o.share for o in outcomes(model=many, nodes=nodes, refill_s=refill)}
    assert share.get("gpu", 0.0) < 1e-9


def test_excluding_lemons_removes_their_share_of_hardware_failures() -> None:
    base = FailureModel(rate_per_1000_node_days=4.0, kinds=llama3_mix())
    lemons = FailureModel(
        rate_per_1000_node_days=4.0, kinds=llama3_mix(), lemon_share=0.25, exclude_lemons=True
    )
    hw = 321 / 419 * 416 / 419
    r0 = job_failure_rate_per_s(model=base, nodes=1000)
    r1 = job_failure_rate_per_s(model=lemons, nodes=1000)
    assert r1 == pytest.approx(r0 * (1 - 0.25 * hw))
    kept = FailureModel(rate_per_1000_node_days=4.0, kinds=llama3_mix(), lemon_share=0.25)
    assert job_failure_rate_per_s(model=kept, nodes=1000) == pytest.approx(r0)


def test_model_validation() -> None:
    with pytest.raises(ValueError, match="rate"):
        FailureModel(rate_per_1000_node_days=0, kinds=llama3_mix())
    with pytest.raises(ValueError, match="spares"):
        FailureModel(rate_per_1000_node_days=1, kinds=llama3_mix(), hot_spares=-1)


def test_spare_count_comes_from_the_product_row_when_it_has_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dataclasses import replace

    import planner.spares as sp
    from manifests.sizes import SIZES

    # The product's rows (manifests/sizes.py) carry the count; a size without a row does not.
    assert sp.product_spares(nodes=16) == (1, "manifests.sizes:16node")
    got = sp.spares_in_force(nodes=64, given=None, recommended=3)
    assert (got.count, got.origin) == (3, "recommended")
    rows = {"16node": replace(SIZES["16node"], spares=2)}  # no 2-node overlay
    monkeypatch.setattr(sp, "SIZES", rows)
    got = sp.spares_in_force(nodes=16, given=None, recommended=3)
    assert (got.count, got.origin) == (2, "manifests.sizes:16node")
    assert sp.spares_in_force(nodes=2, given=None, recommended=3).origin == "recommended"
    assert sp.spares_in_force(nodes=16, given=5, recommended=3).count == 5

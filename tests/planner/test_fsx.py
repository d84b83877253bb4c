"""Tests of planner.fsx: PERSISTENT_2 sizing in valid increments and the cdk context values.

Run: .venv/bin/python -m pytest tests/planner/test_fsx.py -q
"""

from __future__ import annotations

import itertools

import pytest

from facts import fsx as fsx_facts
from planner.fsx import given_fsx, size_fsx

GIB = 2**30


def test_sizing_by_hand() -> None:
    # 70B x 12 B = 840 GB; 3 kept + 1 in flight = 3,360 GB = 3,129.3 GiB -> 4,800 GiB floor.
    # Writing 840 GB within 80 s = 10,500 MB/s; at 1000 MB/s/TiB that is 10.25 TiB =
    # 10,752 GiB -> 12,000 GiB; at 125 MB/s/TiB 86,016 GiB -> 86,400 GiB.
    plan = size_fsx(ckpt_bytes=840e9, keep=3, write_within_s=80.0)
    assert plan.storage_need_gib == pytest.approx(3360e9 / GIB)
    assert plan.write_need_mbps == pytest.approx(10_500.0)
    assert plan.by_tier == {125: 86_400, 250: 43_200, 500: 21_600, 1000: 12_000}
    assert (plan.capacity_gib, plan.tier_mbps_per_tib) == (12_000, 1000)
    assert plan.throughput_mbps == pytest.approx(12_000 / 1024 * 1000)
    assert plan.cdk_context() == "-c fsxStorageCapacityGiB=12000 -c fsxThroughputPerUnit=1000"


def test_storage_bound_sizing_takes_the_lowest_tier() -> None:
    # 1 TB checkpoints written within an hour need 278 MB/s: 4,800 GiB of storage already gives
    # 586 MB/s at 125 MB/s/TiB, so no faster tier is needed.
    plan = size_fsx(ckpt_bytes=1e12, keep=3, write_within_s=3600.0)
    assert (plan.capacity_gib, plan.tier_mbps_per_tib) == (4_800, 125)


@pytest.mark.parametrize(
    ("ckpt", "keep", "within"),
    list(itertools.product([1e9, 84e9, 840e9, 4.86e12], [1, 3], [10.0, 60.0, 600.0])),
)
def test_every_advice_is_a_valid_file_system_that_meets_both_needs(
    ckpt: float, keep: int, within: float
) -> None:
    plan = size_fsx(ckpt_bytes=ckpt, keep=keep, write_within_s=within)
    for tier, cap in plan.by_tier.items():
        assert fsx_facts.is_valid_capacity(cap)
        assert cap >= plan.storage_need_gib
        assert fsx_facts.throughput_mbps(capacity_gib=cap, tier_mbps_per_tib=tier) >= (
            plan.write_need_mbps * (1 - 1e-9)
        )
    assert plan.capacity_gib == min(plan.by_tier.values())
    assert plan.tier_mbps_per_tib in fsx_facts.THROUGHPUT_TIERS_MBPS_PER_TIB


def test_given_file_system_is_validated() -> None:
    ok = given_fsx(capacity_gib=4800, tier_mbps_per_tib=250, ckpt_bytes=840e9, keep=3)
    assert ok.throughput_mbps == pytest.approx(4800 / 1024 * 250)
    assert ok.chosen_by == "given"
    with pytest.raises(ValueError, match=r"3686 GiB is not a PERSISTENT_2 size.*4800"):
        given_fsx(capacity_gib=3686, tier_mbps_per_tib=250, ckpt_bytes=1e9, keep=1)
    with pytest.raises(ValueError, match="tier 300"):
        given_fsx(capacity_gib=2400, tier_mbps_per_tib=300, ckpt_bytes=1e9, keep=1)
    with pytest.raises(ValueError, match="cannot hold"):
        given_fsx(capacity_gib=1200, tier_mbps_per_tib=250, ckpt_bytes=840e9, keep=3)

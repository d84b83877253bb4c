"""FSx for Lustre PERSISTENT_2 sizing in valid increments, from facts.fsx (the stack's facts).

The file system must hold the retained checkpoints plus the one being written, and its
aggregate throughput (capacity x per-TiB tier) must write a whole checkpoint within the
checkpoint interval, or the next save would wait for the previous one. ``size_fsx``: the
smallest file system that does both; among tiers giving that size, the lowest.
``fsx_options``: the valid file systems the plan weighs against each other by price (the write
time also delays each checkpoint's commit, so a faster file system can pay for itself; the
plan chooses file system and interval together, ``planner.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

from facts import fsx as fsx_facts

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class FsxPlan:
    """A valid PERSISTENT_2 file system and why."""

    capacity_gib: int
    """StorageCapacity (GiB), a valid PERSISTENT_2 size."""
    tier_mbps_per_tib: int
    """PerUnitStorageThroughput (MB/s/TiB)."""
    storage_need_gib: float
    """Space the checkpoints need."""
    write_need_mbps: float
    """Throughput to write one checkpoint within the interval (0: not sized for it)."""
    by_tier: dict[int, int]
    """Smallest valid capacity meeting both needs, per tier."""
    chosen_by: str
    """``sized`` (smallest that writes within a time), ``priced`` (one of the options the plan
    weighs by price) or ``given`` (--fsx-capacity-gib / --fsx-tier)."""

    @property
    def throughput_mbps(self) -> float:
        """Aggregate throughput, MB/s."""
        return fsx_facts.throughput_mbps(
            capacity_gib=self.capacity_gib, tier_mbps_per_tib=self.tier_mbps_per_tib
        )

    @property
    def bytes_per_s(self) -> float:
        """Aggregate throughput, bytes/s."""
        return self.throughput_mbps * fsx_facts.MB

    def cdk_context(self) -> str:
        """The ``cdk deploy`` flags for infra/config.py's context keys."""
        return (
            f"-c fsxStorageCapacityGiB={self.capacity_gib} "
            f"-c fsxThroughputPerUnit={self.tier_mbps_per_tib}"
        )


def size_fsx(*, ckpt_bytes: float, keep: int, write_within_s: float) -> FsxPlan:
    """Smallest valid file system holding ``keep`` + 1 checkpoints and writing one in time."""
    if keep < 1 or ckpt_bytes <= 0 or write_within_s <= 0:
        raise ValueError("keep >= 1, checkpoint bytes > 0 and write time > 0 are required")
    storage_gib = (keep + 1) * ckpt_bytes / GIB
    mbps = ckpt_bytes / write_within_s / fsx_facts.MB
    floor = fsx_facts.smallest_capacity_gib(at_least_gib=storage_gib)
    by_tier = {
        t: max(floor, fsx_facts.capacity_for_throughput_gib(mbps=mbps, tier_mbps_per_tib=t))
        for t in fsx_facts.THROUGHPUT_TIERS_MBPS_PER_TIB
    }
    tier = min(by_tier, key=lambda t: (by_tier[t], t))
    return FsxPlan(
        capacity_gib=by_tier[tier],
        tier_mbps_per_tib=tier,
        storage_need_gib=storage_gib,
        write_need_mbps=mbps,
        by_tier=by_tier,
        chosen_by="sized",
    )


def fsx_options(*, ckpt_bytes: float, keep: int, fastest_write_s: float = 0.5) -> list[FsxPlan]:
    """Valid file systems worth weighing: per tier, capacities from the storage floor up a
    geometric ladder until a checkpoint would write in under ``fastest_write_s``."""
    storage_gib = (keep + 1) * ckpt_bytes / GIB
    floor = fsx_facts.smallest_capacity_gib(at_least_gib=storage_gib)
    out: list[FsxPlan] = []
    for tier in fsx_facts.THROUGHPUT_TIERS_MBPS_PER_TIB:
        caps: list[int] = []
        factor = 1.0
        while True:
            cap = fsx_facts.smallest_capacity_gib(at_least_gib=floor * factor)
            if cap not in caps:
                caps.append(cap)
            mbps = fsx_facts.throughput_mbps(capacity_gib=cap, tier_mbps_per_tib=tier)
            if ckpt_bytes / (mbps * fsx_facts.MB) < fastest_write_s or len(caps) > 40:
                break
            factor *= 1.3
        out += [
            FsxPlan(
                capacity_gib=cap,
                tier_mbps_per_tib=tier,
                storage_need_gib=storage_gib,
                write_need_mbps=0.0,
                by_tier={tier: cap},
                chosen_by="priced",
            )
            for cap in caps
        ]
    return out


def given_fsx(
    *, capacity_gib: int, tier_mbps_per_tib: int, ckpt_bytes: float, keep: int
) -> FsxPlan:
    """A file system the user already has; raises ValueError naming the fix when invalid."""
    if not fsx_facts.is_valid_capacity(capacity_gib):
        nearest = fsx_facts.smallest_capacity_gib(at_least_gib=capacity_gib)
        raise ValueError(
            f"FSx capacity {capacity_gib} GiB is not a PERSISTENT_2 size: use 1200, 2400 or a "
            f"multiple of 2400 (next valid: {nearest})"
        )
    if tier_mbps_per_tib not in fsx_facts.THROUGHPUT_TIERS_MBPS_PER_TIB:
        tiers = ", ".join(map(str, fsx_facts.THROUGHPUT_TIERS_MBPS_PER_TIB))
        raise ValueError(f"FSx tier {tier_mbps_per_tib} MB/s/TiB is not offered: use {tiers}")
    storage_gib = (keep + 1) * ckpt_bytes / GIB
    if capacity_gib < storage_gib:
        raise ValueError(
            f"FSx capacity {capacity_gib} GiB cannot hold {keep} + 1 checkpoints "
            f"({storage_gib:,.0f} GiB): use at least "
            f"{fsx_facts.smallest_capacity_gib(at_least_gib=storage_gib)}"
        )
    return FsxPlan(
        capacity_gib=capacity_gib,
        tier_mbps_per_tib=tier_mbps_per_tib,
        storage_need_gib=storage_gib,
        write_need_mbps=0.0,
        by_tier={tier_mbps_per_tib: capacity_gib},
        chosen_by="given",
    )

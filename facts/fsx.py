"""FSx for Lustre PERSISTENT_2 (SSD) sizes and throughput: the stack's validation and the
planner's sizing advice both come from here.

Sources (AWS, "Amazon FSx for Lustre User Guide"):
- Storage capacity for PERSISTENT_2 SSD: 1.2 TiB, 2.4 TiB, then increments of 2.4 TiB
  (https://docs.aws.amazon.com/fsx/latest/LustreGuide/managing-storage-capacity.html and the
  CreateFileSystem API's StorageCapacity field).
- Throughput per unit of storage for PERSISTENT_2: 125, 250, 500 or 1000 MB/s per TiB; a file
  system's aggregate throughput is capacity (TiB) x that figure
  (https://docs.aws.amazon.com/fsx/latest/LustreGuide/performance.html).
"""

from __future__ import annotations

import math

MIN_CAPACITY_GIB = 1200
"""The smallest PERSISTENT_2 SSD file system."""
SECOND_CAPACITY_GIB = 2400
CAPACITY_STEP_GIB = 2400
"""Above 1,200 GiB, capacity comes in multiples of 2,400 GiB."""
THROUGHPUT_TIERS_MBPS_PER_TIB: tuple[int, ...] = (125, 250, 500, 1000)
"""`PerUnitStorageThroughput` choices (MB/s per TiB; MB = 10**6 bytes)."""
GIB_PER_TIB = 1024
MB = 1e6


def is_valid_capacity(gib: int) -> bool:
    """True for 1,200 GiB and every multiple of 2,400 GiB."""
    return gib == MIN_CAPACITY_GIB or (gib >= SECOND_CAPACITY_GIB and gib % CAPACITY_STEP_GIB == 0)


def smallest_capacity_gib(*, at_least_gib: float) -> int:
    """The smallest valid capacity holding `at_least_gib`."""
    if at_least_gib <= MIN_CAPACITY_GIB:
        return MIN_CAPACITY_GIB
    return CAPACITY_STEP_GIB * math.ceil(round(at_least_gib / CAPACITY_STEP_GIB, 9))


def throughput_mbps(*, capacity_gib: int, tier_mbps_per_tib: int) -> float:
    """Aggregate throughput (MB/s) of a file system: capacity in TiB x the per-TiB tier."""
    if tier_mbps_per_tib not in THROUGHPUT_TIERS_MBPS_PER_TIB:
        raise ValueError(
            f"throughput tier {tier_mbps_per_tib} MB/s/TiB is not offered: "
            f"use one of {', '.join(map(str, THROUGHPUT_TIERS_MBPS_PER_TIB))}"
        )
    return capacity_gib / GIB_PER_TIB * tier_mbps_per_tib


def capacity_for_throughput_gib(*, mbps: float, tier_mbps_per_tib: int) -> int:
    """The smallest valid capacity whose aggregate throughput at `tier` reaches `mbps`."""
    return smallest_capacity_gib(at_least_gib=mbps / tier_mbps_per_tib * GIB_PER_TIB)

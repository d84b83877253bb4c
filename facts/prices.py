"""Prices the planner weighs against each other: GPU time and FSx for Lustre storage.

Standard library only. Prices change and differ by region; every figure here names its page and
the planner lets a user override it (``--set gpu_hour_usd=...``,
``--set fsx_usd_per_gb_month_<tier>=...``).

Sources:
- EC2 Capacity Blocks for ML pricing (aws.amazon.com/ec2/capacityblocks/pricing/), the table
  valid until 2025-01-01: p5.48xlarge, US East (N. Virginia), effective instance hourly rate
  $39.33, effective accelerator hourly rate $4.916 (8 x H100). A capacity block is what a
  training run of this size is bought with; on-demand p5 costs more, so an idle spare or an ETTR
  point is worth at least this much.
- Amazon FSx for Lustre pricing (aws.amazon.com/fsx/lustre/pricing/), US East (N. Virginia),
  Persistent-2 SSD storage per GB-month by throughput tier: 125 MB/s/TiB $0.145, 250 $0.210,
  500 $0.340, 1000 $0.600 (throughput is included in the storage price; billed per second of
  provisioned capacity). FSx bills GB as GiB-sized units of the provisioned capacity.
"""

from __future__ import annotations

HOURS_PER_MONTH = 730.0
"""AWS's pricing pages convert monthly prices at 730 hours per month."""

P5_INSTANCE_HOUR_USD = 39.33
"""p5.48xlarge, Capacity Block effective hourly rate, us-east-1 (see the module docstring)."""
GPUS_PER_P5 = 8
GPU_HOUR_USD = P5_INSTANCE_HOUR_USD / GPUS_PER_P5
"""One H100 hour bought as part of a p5 Capacity Block (4.916 USD)."""

FSX_PERSISTENT2_USD_PER_GB_MONTH: dict[int, float] = {
    125: 0.145,
    250: 0.210,
    500: 0.340,
    1000: 0.600,
}
"""Persistent-2 SSD storage (throughput included), USD per GB-month, by MB/s/TiB tier."""


def fsx_usd_per_hour(
    *, capacity_gib: int, tier_mbps_per_tib: int, usd_per_gb_month: dict[int, float] | None = None
) -> float:
    """Hourly price of a Persistent-2 file system of this capacity and tier."""
    table = FSX_PERSISTENT2_USD_PER_GB_MONTH if usd_per_gb_month is None else usd_per_gb_month
    if tier_mbps_per_tib not in table:
        raise ValueError(
            f"no FSx price for tier {tier_mbps_per_tib} MB/s/TiB: use one of {sorted(table)}"
        )
    return capacity_gib * table[tier_mbps_per_tib] / HOURS_PER_MONTH

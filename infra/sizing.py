"""FSx for Lustre sized at synth against the largest training overlay the stack may run.

Three needs, each from one owner: checkpoint bytes and cadence from `facts/recipes.py` (12 bytes
per parameter, `facts/checkpoint.py`), the overlay's recipe and its pod grace period from
`manifests/sizes.py`, capacities and throughput tiers from `facts/fsx.py`:

- capacity: `keep_last + 1` checkpoints (the retained ones plus the save in flight);
- periodic save: one checkpoint written within its interval, or saves queue up behind each other;
- final save: one checkpoint written within `terminationGracePeriodSeconds`, or the SIGTERM save
  of a drained or reclaimed node is cut short by SIGKILL.

Throughput is the file system's aggregate (capacity x tier): the ranks of every node write their
shards at once, so the aggregate is what bounds a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from facts import fsx as fsx_facts
from facts import recipes as recipe_facts
from infra.config import ConfigError
from manifests.sizes import SIZES, OverlaySize

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class FsxNeed:
    """What one overlay asks of the file system."""

    overlay: str
    recipe: str
    checkpoint_bytes: float
    checkpoints: int
    """keep_last + 1."""
    interval_s: float
    grace_s: int

    @property
    def capacity_gib(self) -> float:
        return self.checkpoints * self.checkpoint_bytes / GIB

    @property
    def periodic_mbps(self) -> float:
        return self.checkpoint_bytes / self.interval_s / fsx_facts.MB

    @property
    def final_save_mbps(self) -> float:
        return self.checkpoint_bytes / self.grace_s / fsx_facts.MB

    @property
    def mbps(self) -> float:
        return max(self.periodic_mbps, self.final_save_mbps)

    def options(self) -> list[tuple[int, int]]:
        """(capacity GiB, tier) of the smallest file system that fits, per throughput tier."""
        floor = fsx_facts.smallest_capacity_gib(at_least_gib=self.capacity_gib)
        return [
            (
                max(
                    floor,
                    fsx_facts.capacity_for_throughput_gib(mbps=self.mbps, tier_mbps_per_tib=t),
                ),
                t,
            )
            for t in fsx_facts.THROUGHPUT_TIERS_MBPS_PER_TIB
        ]


def need_of(overlay: OverlaySize) -> FsxNeed:
    try:
        recipe = recipe_facts.RECIPES[overlay.recipe]
    except KeyError:
        raise ValueError(
            f"overlay {overlay.name} runs recipe {overlay.recipe!r}, which facts/recipes.py lacks"
        ) from None
    return FsxNeed(
        overlay=overlay.name,
        recipe=recipe.name,
        checkpoint_bytes=recipe.checkpoint_bytes,
        checkpoints=recipe.keep_last + 1,
        interval_s=recipe.checkpoint_interval_s,
        grace_s=overlay.grace_seconds,
    )


def largest_overlay(sizes: Mapping[str, OverlaySize] = SIZES) -> str:
    """The overlay with the biggest demand on FSx (capacity first, then throughput)."""
    return max(sizes, key=lambda n: (need_of(sizes[n]).capacity_gib, need_of(sizes[n]).mbps))


def check_fsx(
    *,
    capacity_gib: int,
    tier_mbps_per_tib: int,
    sized_for: str | None,
    sizes: Mapping[str, OverlaySize] = SIZES,
) -> FsxNeed:
    """Return the need of the overlay the file system is sized for (`sized_for`, default the
    largest); raise ConfigError naming the context values and what would fit when it does not."""
    if sized_for is not None and sized_for not in sizes:
        raise ConfigError(
            "fsxSizedFor",
            f"{sized_for!r} is not an overlay",
            f"use one of: {', '.join(sizes)} (or leave it unset: the largest)",
        )
    need = need_of(sizes[sized_for or largest_overlay(sizes)])
    mbps = fsx_facts.throughput_mbps(capacity_gib=capacity_gib, tier_mbps_per_tib=tier_mbps_per_tib)
    problems = []
    if capacity_gib < need.capacity_gib:
        problems.append(
            f"{need.checkpoints} checkpoints (keep_last + 1) of "
            f"{need.checkpoint_bytes / 1e9:.0f} GB need {need.capacity_gib:.0f} GiB"
        )
    if mbps < need.periodic_mbps:
        problems.append(
            f"writing one within its ~{need.interval_s:.0f} s checkpoint interval needs "
            f"{need.periodic_mbps:.0f} MB/s"
        )
    if mbps < need.final_save_mbps:
        problems.append(
            f"the final save within the {need.grace_s} s grace period needs "
            f"{need.final_save_mbps:.0f} MB/s"
        )
    if problems:
        fits = ", ".join(f"{c} GiB at {t}" for c, t in need.options())
        raise ConfigError(
            "fsxStorageCapacityGiB",
            f"{capacity_gib} GiB at fsxThroughputPerUnit={tier_mbps_per_tib} MB/s/TiB "
            f"({mbps:.0f} MB/s) does not fit overlay {need.overlay} (recipe {need.recipe}): "
            + "; ".join(problems),
            f"set -c fsxStorageCapacityGiB=C -c fsxThroughputPerUnit=T with one of ({fits}), "
            "or size for a smaller overlay with -c fsxSizedFor=NAME",
        )
    return need

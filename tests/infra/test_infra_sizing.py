"""FSx sized at synth (infra/sizing.py): capacity for keep_last + 1 checkpoints of the largest
overlay, a checkpoint written within its interval and the final save within the pod's grace
period; a clear error with what would fit.

    .venv/bin/pytest tests/infra/test_infra_sizing.py      # seconds
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cfn_emulator import offline_environ
from infra_synth import CDK_JSON_CONTEXT, synth

from facts import fsx as fsx_facts
from facts import recipes as recipe_facts
from infra import sizing
from infra.config import ConfigError
from manifests.sizes import SIZES


def test_every_overlay_recipe_is_in_the_table() -> None:
    assert {o.recipe for o in SIZES.values()} <= set(recipe_facts.RECIPES)


def test_the_largest_overlay_is_the_70b_one() -> None:
    assert sizing.largest_overlay() == "16node"
    need = sizing.need_of(SIZES["16node"])
    recipe = recipe_facts.RECIPES["p5_70b"]
    assert need.checkpoints == recipe.keep_last + 1
    assert need.checkpoint_bytes == 12 * recipe.params
    assert need.grace_s == SIZES["16node"].grace_seconds  # terminationGracePeriodSeconds


def test_cdk_json_defaults_fit_the_largest_overlay() -> None:
    capacity = CDK_JSON_CONTEXT["fsxStorageCapacityGiB"]
    tier = CDK_JSON_CONTEXT["fsxThroughputPerUnit"]
    need = sizing.check_fsx(capacity_gib=capacity, tier_mbps_per_tib=tier, sized_for=None)
    mbps = fsx_facts.throughput_mbps(capacity_gib=capacity, tier_mbps_per_tib=tier)
    assert capacity >= need.capacity_gib
    assert mbps >= need.periodic_mbps and mbps >= need.final_save_mbps
    # And the smallest valid size that fits at this tier is the default (no waste).
    assert min(c for c, t in need.options() if t == tier) == capacity


def test_too_small_names_the_context_values_and_what_fits() -> None:
    with pytest.raises(ConfigError) as caught:
        sizing.check_fsx(capacity_gib=1200, tier_mbps_per_tib=250, sized_for=None)
    message = str(caught.value)
    assert caught.value.key == "fsxStorageCapacityGiB"
    for fragment in (
        "fsxThroughputPerUnit=250",
        "overlay 16node",
        "4 checkpoints (keep_last + 1)",
        "checkpoint interval",
        "900 s grace period",
        "4800 GiB at 250",
        "-c fsxSizedFor=",
    ):
        assert fragment in message, fragment


def test_each_suggested_size_fits() -> None:
    need = sizing.need_of(SIZES["16node"])
    for capacity, tier in need.options():
        assert fsx_facts.is_valid_capacity(capacity)
        sizing.check_fsx(capacity_gib=capacity, tier_mbps_per_tib=tier, sized_for="16node")


def test_too_slow_is_refused_even_when_it_is_big_enough() -> None:
    # 4800 GiB holds four 70B checkpoints, but at 125 MB/s/TiB (586 MB/s) neither a periodic
    # save (~1 GB/s) nor the final save in 900 s fits.
    with pytest.raises(ConfigError, match="grace period"):
        sizing.check_fsx(capacity_gib=4800, tier_mbps_per_tib=125, sized_for=None)


def test_sized_for_a_smaller_overlay() -> None:
    need = sizing.check_fsx(capacity_gib=1200, tier_mbps_per_tib=500, sized_for="2node")
    assert need.overlay == "2node"
    with pytest.raises(ConfigError) as caught:
        sizing.check_fsx(capacity_gib=1200, tier_mbps_per_tib=500, sized_for="64node")
    assert caught.value.key == "fsxSizedFor"


def test_synth_refuses_a_file_system_too_small(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not fit overlay 16node"):
        synth({"fsxStorageCapacityGiB": 1200}, outdir=tmp_path)


def test_app_exits_with_the_sizing_message(tmp_path: Path) -> None:
    """app.py as the CDK CLI runs it: a file system too small stops synth, no traceback."""
    import json
    import os
    import subprocess
    import sys

    from infra_synth import REPO_ROOT

    env = {
        **offline_environ(os.environ),  # app.py reads the deployed stack: never from AWS here
        "CDK_CONTEXT_JSON": json.dumps({**CDK_JSON_CONTEXT, "fsxStorageCapacityGiB": 2400}),
        "CDK_OUTDIR": str(tmp_path),
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
    }
    result = subprocess.run(
        [sys.executable, "app.py"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode != 0
    assert "Configuration error: context 'fsxStorageCapacityGiB': 2400 GiB" in result.stderr
    assert "4800 GiB at 250" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.template.json"))

"""Configuration: every context value is validated at synth with a message that names the
context key and the fix.

    .venv/bin/pytest tests/infra/test_infra_config.py     # ~10 s (one app.py subprocess)

No AWS needed: configuration is read and checked before any construct exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cfn_emulator import offline_environ
from support import requires_tool

from infra.config import ConfigError, StackConfig, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULTS: dict[str, Any] = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
OVERLAYS = ("smoke", "2node", "16node")


def load(**overrides: Any) -> StackConfig:
    context = {**DEFAULTS, **overrides}
    return load_config(context.get, overlays=OVERLAYS)


def test_cdk_json_defaults_are_valid_and_typed() -> None:
    config = load()
    assert config.network.gpu_availability_zone in config.network.availability_zones
    assert config.cluster.kubernetes_version == "1.36"
    assert config.cluster.endpoint_allowed_cidrs == ()  # private endpoint unless CIDRs given
    assert config.gpu.capacity_type == "on-demand"
    assert config.gpu.efa_secondary_interface_type == "efa-only"
    assert config.workload.namespace == "training"
    assert not hasattr(config.workload, "train_overlay")  # the stack owns no Job
    assert config.fsx.sized_for is None  # sized for the largest overlay
    with pytest.raises(AttributeError):
        config.gpu.max_size = 99  # type: ignore[misc]  # frozen


def test_every_key_in_cdk_json_is_read_and_nothing_else() -> None:
    read: set[str] = set()

    def get(key: str) -> Any:
        read.add(key)
        return DEFAULTS.get(key)

    load_config(get, overlays=OVERLAYS)
    assert read == set(DEFAULTS), "cdk.json context and infra/config.py disagree"


def test_command_line_strings_are_parsed() -> None:
    # `-c key=value` always gives strings.
    config = load(
        gpuNodesMin="1",
        gpuNodesDesired="2",
        gpuNodesMax="4",
        availabilityZones='["us-east-2a", "us-east-2b"]',
        endpointAllowedCidrs="203.0.113.7/32, 198.51.100.0/24",
        capacityType="capacity-reservation",
        capacityReservationId="cr-0123456789abcdef0",
        train="none",
        fsxSizedFor="2node",
        adminPrincipalArn="none",
    )
    assert (config.gpu.min_size, config.gpu.desired_size, config.gpu.max_size) == (1, 2, 4)
    assert config.network.availability_zones == ("us-east-2a", "us-east-2b")
    assert config.cluster.endpoint_allowed_cidrs == ("203.0.113.7/32", "198.51.100.0/24")
    assert config.gpu.capacity_reservation_id == "cr-0123456789abcdef0"
    assert config.fsx.sized_for == "2node"
    assert config.cluster.admin_principal_arn is None


BAD_VALUES = [
    # (overrides, key named in the message, a fragment of the message)
    ({"region": ""}, "region", "is missing"),
    ({"region": "Ohio"}, "region", "not an AWS region"),
    ({"availabilityZones": ["us-east-2a"]}, "availabilityZones", "at least two"),
    ({"availabilityZones": ["us-east-2a", "us-west-2b"]}, "availabilityZones", "not an AZ"),
    ({"availabilityZones": "[us-east-2a"}, "availabilityZones", "not a valid JSON list"),
    ({"gpuAvailabilityZone": "us-east-2d"}, "gpuAvailabilityZone", "not one of"),
    ({"vpcCidr": "10.0.0.0/24"}, "vpcCidr", "does not fit"),
    ({"vpcCidr": "10.0.0/16"}, "vpcCidr", "not an IPv4 CIDR"),
    ({"clusterName": "1-bad_name"}, "clusterName", "not a valid EKS cluster name"),
    ({"kubernetesVersion": "1.29"}, "kubernetesVersion", "not supported"),
    ({"endpointAllowedCidrs": ["0.0.0.0/0"]}, "endpointAllowedCidrs", "whole internet"),
    ({"endpointAllowedCidrs": "my-laptop"}, "endpointAllowedCidrs", "not a CIDR"),
    ({"adminPrincipalArn": "Admin"}, "adminPrincipalArn", "not an IAM role or user ARN"),
    ({"systemNodeCount": 0}, "systemNodeCount", "must be >= 1"),
    ({"gpuNodesMax": "two"}, "gpuNodesMax", "must be an integer"),
    ({"gpuNodesMin": True}, "gpuNodesMin", "must be an integer"),
    ({"gpuNodesMin": 3, "gpuNodesDesired": 2}, "gpuNodesDesired", "does not hold"),
    (
        {
            "capacityType": "capacity-block",
            "capacityReservationId": "cr-0123456789abcdef0",
            "gpuNodesDesired": 2,
        },
        "gpuNodesDesired",
        "must start at 0",
    ),
    (
        {
            "capacityType": "capacity-block",
            "capacityReservationId": "cr-0123456789abcdef0",
            "gpuNodesDesired": 2,
        },
        "gpuNodesDesired",
        "-c gpuNodesDesired=2 -c capacityBlockActive=true",
    ),
    ({"capacityBlockActive": "true"}, "capacityBlockActive", "capacityType is on-demand"),
    ({"capacityBlockActive": "yes"}, "capacityBlockActive", "must be true or false"),
    ({"capacityReservationPlacementGroup": "pg-a"}, "capacityReservationPlacementGroup", "is set"),
    ({"fsxStorageCapacityGiB": 3600}, "fsxStorageCapacityGiB", "e.g. 4800"),
    ({"fsxRemovalPolicy": "snapshot"}, "fsxRemovalPolicy", "not supported"),
    ({"capacityType": "spot"}, "capacityType", "not supported"),
    ({"capacityType": "capacity-block"}, "capacityReservationId", "is required"),
    (
        {"capacityType": "capacity-reservation", "capacityReservationId": "odcr-1"},
        "capacityReservationId",
        "not a capacity reservation id",
    ),
    ({"capacityReservationId": "cr-0123456789abcdef0"}, "capacityReservationId", "on-demand"),
    ({"efaSecondaryInterfaceType": "interface"}, "efaSecondaryInterfaceType", "not supported"),
    ({"efaSecondaryInterfaceType": "efa"}, "efaSecondaryInterfaceType", "older layout"),
    ({"gpuRootVolumeGiB": 20}, "gpuRootVolumeGiB", "must be >= 100"),
    ({"fsxStorageCapacityGiB": 3600}, "fsxStorageCapacityGiB", "not a PERSISTENT_2 size"),
    ({"fsxThroughputPerUnit": 200}, "fsxThroughputPerUnit", "not offered"),
    ({"fsxS3Link": "my-bucket"}, "fsxS3Link", "not an s3:// URI"),
    ({"imageRepositoryName": "Trainer"}, "imageRepositoryName", "not an ECR repository name"),
    ({"imageUri": "example.com/trainer"}, "imageUri", "not a pinned image reference"),
    ({"trainingNamespace": "Training"}, "trainingNamespace", "not a Kubernetes namespace"),
    ({"train": "smoke"}, "train", "make train TARGET=eks OVERLAY=smoke"),
    ({"train": "64node"}, "train", "not part of the stack"),
]


@pytest.mark.parametrize(("overrides", "key", "fragment"), BAD_VALUES)
def test_bad_value_names_the_key_and_the_fix(
    overrides: dict[str, Any], key: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(**overrides)
    message = str(caught.value)
    assert caught.value.key == key
    assert message.startswith(f"context '{key}': ")
    assert fragment in message
    assert "Fix: " in message and not message.endswith("Fix: ")
    assert isinstance(caught.value, ValueError)


def test_app_exits_non_zero_with_the_message(tmp_path: Path) -> None:
    """app.py as the CDK CLI runs it (context in CDK_CONTEXT_JSON): a bad value stops synth."""
    env = {
        **offline_environ(os.environ),  # app.py reads the deployed stack: never from AWS here
        "CDK_CONTEXT_JSON": json.dumps({**DEFAULTS, "capacityType": "capacity-block"}),
        "CDK_OUTDIR": str(tmp_path),
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
    }
    result = subprocess.run(
        [sys.executable, "app.py"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Configuration error: context 'capacityReservationId': is required" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.template.json"))


def test_a_started_capacity_block_takes_nodes() -> None:
    """Once the block has started, the deploy itself scales the group (no out-of-band count)."""
    config = load(
        capacityType="capacity-block",
        capacityReservationId="cr-0123456789abcdef0",
        gpuNodesDesired="2",
        capacityBlockActive="true",
    )
    assert (config.gpu.desired_size, config.gpu.capacity_block_active) == (2, True)


def test_the_gpu_node_group_can_hold_every_overlay_with_its_spares() -> None:
    """`make gpu-nodes OVERLAY=<largest>` asks for its nodes plus its hot spares
    (manifests/sizes.py); cdk.json's gpuNodesMax must allow it, or that deploy fails synth."""
    from manifests.sizes import SIZES

    largest = max(size.node_count for size in SIZES.values())
    assert DEFAULTS["gpuNodesMax"] >= largest, (
        f"cdk.json gpuNodesMax {DEFAULTS['gpuNodesMax']} < {largest} (the largest overlay's "
        "nodes + spares): raise it"
    )


def test_an_overlay_sizes_the_gpu_group_and_gpu_nodes_desired_overrides_it() -> None:
    """`-c overlay=NAME` asks for the overlay's training nodes plus its hot spares
    (manifests/sizes.py's node_count, the one owner); `gpuNodesDesired` overrides; neither: 0."""
    from manifests.sizes import SIZES

    counts = {name: size.node_count for name, size in SIZES.items()}

    def desired(**overrides: Any) -> int:
        context = {**DEFAULTS, **overrides}
        return load_config(context.get, overlays=OVERLAYS, node_counts=counts).gpu.desired_size

    assert DEFAULTS["gpuNodesDesired"] is None and DEFAULTS["overlay"] is None
    assert desired() == 0
    assert desired(overlay="2node") == SIZES["2node"].nodes + SIZES["2node"].spares
    assert desired(overlay="2node", gpuNodesDesired="1") == 1
    with pytest.raises(ConfigError, match="context 'overlay': 'huge' is not an overlay"):
        desired(overlay="huge")


@requires_tool("aws")
def test_a_test_subprocess_cannot_reach_aws() -> None:
    """The session guard (tests/infra/conftest.py): a subprocess given this process's
    environment, as app.py and the CDK CLI are, finds no credentials, so no AWS call is made."""
    assert not [k for k in os.environ if k.startswith("AWS_") and "ENDPOINT" not in k] or (
        os.environ.get("AWS_CONFIG_FILE") == "/nonexistent"
    )
    assert "AWS_ACCESS_KEY_ID" not in os.environ and "AWS_PROFILE" not in os.environ
    proc = subprocess.run(
        ["aws", "sts", "get-caller-identity", "--region", "us-east-2"],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "credentials" in proc.stderr.lower(), proc.stderr

"""Helpers for the infra tests: synthesize the stack the way app.py does, mask asset hashes.

Synthesis runs in-process through aws-cdk-lib (jsii + Node), offline, with no AWS credentials.
Most templates are synthesized with CDK's built-in validation off (it costs ~75% of synth
time); tests/infra/test_infra_validation.py synthesizes once with it and cdk-nag on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aws_cdk as cdk

from infra import deployed, first_deploy, nag
from infra.config import STACK_NAME, load_config
from infra.stack import build_stacks
from manifests.render import OVERLAYS
from manifests.sizes import SIZES

REPO_ROOT = Path(__file__).resolve().parents[2]
CDK_JSON_CONTEXT: dict[str, Any] = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]

# A configuration that exercises every optional path: capacity block, the `ip-bandwidth`
# EFA layout, S3 link, admin access entry, public endpoint for named CIDRs and a prebuilt image
# (no training Job: the stack never owns one).
VARIANT_CONTEXT: dict[str, Any] = {
    "capacityType": "capacity-block",
    "capacityReservationId": "cr-0123456789abcdef0",
    "efaSecondaryInterfaceType": "ip-bandwidth",
    # Capacity-block node groups start at 0 and are scaled up when the block starts.
    "gpuNodesMin": 0,
    "gpuNodesDesired": 0,
    "gpuNodesMax": 2,
    "fsxStorageCapacityGiB": 4800,
    "fsxThroughputPerUnit": 500,
    "fsxS3Link": "s3://example-training-data/datasets",
    "adminPrincipalArn": "arn:aws:iam::123456789012:role/Admin",
    "endpointAllowedCidrs": "203.0.113.7/32,198.51.100.0/24",
    "imageUri": "123456789012.dkr.ecr.us-east-2.amazonaws.com/fsdp-trainer:v1",
}


def synth(
    overrides: dict[str, Any] | None = None,
    *,
    outdir: Path,
    validate: bool = False,
    last_template: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], cdk.App]:
    """Build the stack the way app.py does and return its template (and the app).

    `validate` turns on CDK's built-in CloudFormation validation and the cdk-nag plugin, so an
    unacknowledged finding raises here, as it fails `cdk synth`. `last_template`: the template
    of the last deploy, from which app.py derives what a deployed stack keeps.
    """
    context = {
        **CDK_JSON_CONTEXT,
        **(overrides or {}),
        # Stable, smaller templates for snapshots.
        "aws:cdk:enable-path-metadata": False,
    }
    app = cdk.App(
        outdir=str(outdir),
        context=context,
        analytics_reporting=False,
        builtin_cloud_formation_validation=validate,
    )
    node_counts = {name: size.node_count for name, size in SIZES.items()}
    config = load_config(app.node.try_get_context, overlays=OVERLAYS, node_counts=node_counts)
    build_stacks(
        app,
        config=config,
        keep_creator_admin=first_deploy.keeps_creator_admin(last_template),
        # What app.py stores: the settings that differ from cdk.json's defaults.
        settings=deployed.settings_to_store(context, defaults=CDK_JSON_CONTEXT),
    )
    if validate:
        nag.add_checks(app)
    assembly = app.synth()
    return assembly.get_stack_by_name(STACK_NAME).template, app


_HASH = re.compile(r"[0-9a-f]{64}")


def mask_asset_hashes(template: dict[str, Any]) -> dict[str, Any]:
    """Replace asset hashes (they change with any file in the image's build context)."""
    return json.loads(_HASH.sub("<asset-hash>", json.dumps(template)))

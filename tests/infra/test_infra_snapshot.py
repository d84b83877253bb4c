"""Snapshots of every synthesized template (asset hashes masked).

    .venv/bin/pytest tests/infra/test_infra_snapshot.py                     # compare
    .venv/bin/pytest tests/infra/test_infra_snapshot.py --snapshot-update   # after a change

A diff here is a change to what `cdk deploy` would do: review it like a `cdk diff`. The
Kubernetes objects come from manifests/render.py, so a change there updates these snapshots too.
"""

from __future__ import annotations

from typing import Any

import pytest
from infra_synth import mask_asset_hashes
from syrupy.assertion import SnapshotAssertion
from syrupy.extensions.json import JSONSnapshotExtension


@pytest.fixture
def snapshot_json(snapshot: SnapshotAssertion) -> SnapshotAssertion:
    return snapshot.use_extension(JSONSnapshotExtension)


def test_default_template(
    default_template: dict[str, Any], snapshot_json: SnapshotAssertion
) -> None:
    assert mask_asset_hashes(default_template) == snapshot_json


def test_variant_template(
    variant_template: dict[str, Any], snapshot_json: SnapshotAssertion
) -> None:
    assert mask_asset_hashes(variant_template) == snapshot_json


def test_images_template(images_template: dict[str, Any], snapshot_json: SnapshotAssertion) -> None:
    assert mask_asset_hashes(images_template) == snapshot_json


def test_masking_removes_every_asset_hash(default_template: dict[str, Any]) -> None:
    import json
    import re

    masked = json.dumps(mask_asset_hashes(default_template))
    assert "<asset-hash>" in masked
    assert not re.search(r"[0-9a-f]{64}", masked)

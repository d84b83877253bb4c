"""`cdk synth` through the pinned npm CLI (package.json), as `make synth` runs it: no AWS
credentials, no network (--no-notices --no-lookups), telemetry off, full validation on.

    make setup && .venv/bin/pytest tests/infra/test_infra_cli.py      # ~40 s on 2 cores

Skipped when node_modules/ is absent, failed under TESTS_REQUIRE_ALL=1 (`make setup` installs
it; `make test` always does).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from aws_cdk.assertions import Match, Template
from cfn_emulator import offline_environ
from support import cdk_cli_reason, requires

REPO_ROOT = Path(__file__).resolve().parents[2]
CDK = REPO_ROOT / "node_modules" / ".bin" / "cdk"


@pytest.mark.slow
@requires(cdk_cli_reason())
def test_cdk_synth_offline_without_credentials(tmp_path: Path) -> None:
    pinned = json.loads((REPO_ROOT / "package.json").read_text())["devDependencies"]["aws-cdk"]
    installed = json.loads((REPO_ROOT / "node_modules/aws-cdk/package.json").read_text())
    assert installed["version"] == pinned

    # No credentials anywhere, every endpoint local: a lookup or an AWS call would fail.
    env = offline_environ(os.environ)
    env.update(
        CDK_DISABLE_CLI_TELEMETRY="true",
        JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION="1",
    )
    env.pop("CDK_VALIDATION", None)
    out = tmp_path / "cdk.out"
    result = subprocess.run(
        [
            str(CDK),
            "synth",
            "--no-notices",
            "--no-lookups",
            "--no-version-reporting",
            "--quiet",
            "--output",
            str(out),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    template = Template.from_json(json.loads((out / "EksFsdpResilient.template.json").read_text()))
    template.has_output("GpuNodegroupName", Match.any_value())
    report = json.loads((out / "validation-report.json").read_text())
    assert {p["pluginName"]: p["conclusion"] for p in report["pluginReports"]} == {
        "AwsSolutions": "success",
        "CloudFormation Validate": "success",
    }
    # The image is fingerprinted, not built: synth ran without Docker.
    assets = json.loads((out / "EksFsdpResilient.assets.json").read_text())
    assert len(assets["dockerImages"]) == 3  # the trainer, the rendezvous store, the node fencer
    # Published to the images stack's repository, never to CDK's bootstrap repository.
    repository = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]["imageRepositoryName"]
    for image in assets["dockerImages"].values():
        for destination in image["destinations"].values():
            assert destination["repositoryName"] == repository
    assert (out / "EksFsdpResilientImages.template.json").exists()

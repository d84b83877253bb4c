"""The deploy guard app.py runs around synthesis: read the deployed stack back
(infra/deployed.py), refuse a deploy aimed at another account or region, or a pin EKS does not
offer (infra/deploy_target.py), layer the context, build the stacks, synthesize, and check the
result against the deployed stack (infra/first_deploy.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from infra import deploy_target, first_deploy
from infra.config import IMAGES_STACK_NAME, STACK_NAME, ConfigError, StackConfig, load_config
from infra.deployed import (
    USE_DEFAULT_KEY,
    deployed_context,
    given_context,
    kept_settings,
    layered,
    read,
    retained_report,
    settings_to_store,
    split_list,
)
from manifests.render import OVERLAYS
from manifests.sizes import SIZES
from training import exits

if TYPE_CHECKING:
    import aws_cdk as cdk

CHECK_KEY = "deployCheck"
"""`required` (make deploy, gpu-nodes): refuse when the deployed stack cannot be read;
`destroy` (make destroy): no check, write what the destroy keeps to cdk.out/retained.txt."""

CDK_JSON = Path(__file__).resolve().parents[1] / "cdk.json"


class Build(Protocol):
    def __call__(
        self, config: StackConfig, *, keep_creator_admin: bool, settings: dict[str, Any]
    ) -> None: ...


def guard(app: cdk.App, *, build: Build) -> None:
    """Read the deployed stack back, layer the context, `build` the stacks, synthesize, and
    check the result against the deployed stack (infra/first_deploy.py).

    The context is cdk.json's defaults, under the deployed settings, under the `-c` values given
    now. Exits with one line on a configuration error, on a refused change, and (with
    `-c deployCheck=required`) when the deployed stack cannot be read; prints what the deploy
    changes otherwise. `-c deployCheck=destroy` writes cdk.out/retained.txt instead.
    """
    get = app.node.try_get_context
    defaults = json.loads(CDK_JSON.read_text())["context"]
    given = given_context(get, defaults=defaults)
    region = str(given.get("region", defaults["region"]))
    mode = get(CHECK_KEY) or "report"
    stack = read(stack_name=STACK_NAME, other_stacks=(IMAGES_STACK_NAME,), region=region)
    if stack.status == "unknown":
        if mode == "required":
            sys.exit(
                f"Refused: could not read the deployed stack {STACK_NAME} ({stack.reason}). Fix: "
                "give the AWS CLI credentials for the account (aws sts get-caller-identity), then "
                "deploy again"
            )
        print(
            f"Not checked against the deployed stack: {stack.reason} (offline: synthesized from "
            "cdk.json and your -c values only)",
            file=sys.stderr,
        )
    kept_raw, source = kept_settings(stack.template)
    if mode == "required":
        try:
            deploy_target.check(
                stack_status=stack.status,
                stack_name=STACK_NAME,
                region=region,
                deployed_region=str(kept_raw.get("region", defaults["region"])),
                expected_account=os.environ.get("CDK_DEFAULT_ACCOUNT"),
                first_deploy=str(get(deploy_target.FIRST_DEPLOY_KEY)).lower() == "true",
                kubernetes_version=str(
                    given.get("kubernetesVersion")
                    or kept_raw.get("kubernetesVersion")
                    or defaults["kubernetesVersion"]
                ),
            )
        except deploy_target.DeployRefused as err:
            sys.exit(f"Refused: {err}")
    context = layered(
        defaults=defaults,
        # `cdk destroy` deletes the stacks by name: the kept settings shape nothing it does, and
        # one that today's validation refuses must not stop it.
        kept={} if mode == "destroy" else kept_raw,
        given=given,
        use_default=split_list(get(USE_DEFAULT_KEY)),
    )
    node_counts = {name: size.node_count for name, size in SIZES.items()}
    try:
        config = load_config(context.get, overlays=OVERLAYS, node_counts=node_counts)
        kept = None
        if stack.template is not None and mode != "destroy":
            # The guarded settings as deployed, from the resources: a changed cdk.json default
            # of one is refused like any change (infra/deployed.py).
            before = deployed_context(stack.template, defaults=defaults)
            try:
                kept = first_deploy.settings(
                    load_config(before.get, overlays=OVERLAYS, node_counts=node_counts)
                )
            except ConfigError as err:  # settings today's validation refuses: the diff still runs
                print(f"Deployed settings not compared ({err})", file=sys.stderr)
        # The stack checks FSx against the overlays' checkpoints first (infra/sizing.py).
        build(
            config,
            keep_creator_admin=first_deploy.keeps_creator_admin(stack.template),
            settings=settings_to_store(context, defaults=defaults),
        )
    except ConfigError as err:
        sys.exit(f"Configuration error: {err}")
    assembly = app.synth()

    if mode == "destroy":
        (Path(assembly.directory) / "retained.txt").write_text(
            retained_report(stack_name=STACK_NAME, region=region) + "\n"
        )
        sys.exit(exits.OK)
    if stack.template is not None:
        different = {
            k: v
            for k, v in kept_raw.items()
            if k in defaults and k not in given and v != defaults[k]
        }
        print(
            f"Kept from {source}: "
            + (", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(different.items())) or "nothing")
            + (f"; given now: {', '.join(sorted(given))}" if given else ""),
            file=sys.stderr,
        )
    try:
        report = first_deploy.check(
            kept=kept,
            now=first_deploy.settings(config),
            last_template=stack.template,
            template=assembly.get_stack_by_name(STACK_NAME).template,
            acknowledged=first_deploy.acknowledged(get),
            region=config.network.region,
            other_stacks={
                name: (before_t, assembly.get_stack_by_name(name).template)
                for name, before_t in stack.other_templates.items()
            },
        )
    except first_deploy.ReplacementRefused as err:
        print(
            f"What this deploy changes, against the deployed stack:\n{err.report}", file=sys.stderr
        )
        sys.exit(f"Refused: {err}")
    print(f"What this deploy changes, against the deployed stack:\n{report}", file=sys.stderr)

#!/usr/bin/env python3
"""CDK app: reads the deployed stack back, layers the context, validates it, builds the stacks.

make synth                      # offline: templates in cdk.out/
make diff                       # what the next deploy changes, against the deployed stack
make deploy ARGS="-c adminPrincipalArn=arn:aws:iam::123456789012:role/Admin"
make gpu-nodes OVERLAY=2node    # the overlay's nodes + hot spares; every other setting kept
make train TARGET=eks OVERLAY=smoke   # the training Job: never a stack resource

Before synthesis the app reads the deployed stack through the AWS CLI (infra/deployed.py): its
template and the settings it was deployed with. The context is cdk.json's defaults, under the
deployed settings, under the `-c` values given now; so a deploy from any clone keeps what it is
not told to change. After synthesis it prints what the deploy changes against the deployed
template and refuses what would lose state or access unless acknowledged
(infra/first_deploy.py). Without credentials it says, in one line, that it could not check;
`make deploy` (`-c deployCheck=required`) then refuses, and also refuses another account or
region than the stack's, a missing stack unless `-c firstDeploy=true`, and add-on pins EKS
does not offer (infra/deploy_target.py).
"""

import json
import os
import sys
from pathlib import Path

import aws_cdk as cdk

from infra import deploy_target, deployed, first_deploy, nag
from infra.config import STACK_NAME, ConfigError, load_config
from infra.stack import IMAGES_STACK_NAME, build_stacks
from manifests.render import OVERLAYS
from manifests.sizes import SIZES

CHECK_KEY = "deployCheck"
"""`required` (make deploy, gpu-nodes): refuse when the deployed stack cannot be read;
`destroy` (make destroy): no check, write what the destroy keeps to cdk.out/retained.txt."""

app = cdk.App()
get = app.node.try_get_context
defaults = json.loads((Path(__file__).resolve().parent / "cdk.json").read_text())["context"]
given = deployed.given_context(get, defaults=defaults)
region = str(given.get("region", defaults["region"]))
mode = get(CHECK_KEY) or "report"
stack = deployed.read(stack_name=STACK_NAME, other_stacks=(IMAGES_STACK_NAME,), region=region)
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
kept_raw, source = deployed.kept_settings(stack.template)
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
context = deployed.layered(
    defaults=defaults,
    # `cdk destroy` deletes the stacks by name: the kept settings shape nothing it does, and
    # one that today's validation refuses must not stop it.
    kept={} if mode == "destroy" else kept_raw,
    given=given,
    use_default=deployed.split_list(get(deployed.USE_DEFAULT_KEY)),
)
node_counts = {name: size.node_count for name, size in SIZES.items()}
try:
    config = load_config(context.get, overlays=OVERLAYS, node_counts=node_counts)
    kept = None
    if stack.template is not None and mode != "destroy":
        before = {**defaults, **{k: v for k, v in kept_raw.items() if k in defaults}}
        try:
            kept = first_deploy.settings(
                load_config(before.get, overlays=OVERLAYS, node_counts=node_counts)
            )
        except ConfigError as err:  # settings today's validation refuses: the diff still runs
            print(f"Deployed settings not compared ({err})", file=sys.stderr)
    # The stack checks FSx against the overlays' checkpoints first (infra/sizing.py).
    build_stacks(
        app,
        config=config,
        keep_creator_admin=first_deploy.keeps_creator_admin(stack.template),
        settings=deployed.settings_to_store(context, defaults=defaults),
    )
except ConfigError as err:
    sys.exit(f"Configuration error: {err}")
nag.add_checks(app)
assembly = app.synth()

if mode == "destroy":
    (Path(assembly.directory) / "retained.txt").write_text(
        deployed.retained_report(stack_name=STACK_NAME, region=region) + "\n"
    )
    sys.exit(0)
if stack.template is not None:
    different = {
        k: v for k, v in kept_raw.items() if k in defaults and k not in given and v != defaults[k]
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
    print(f"What this deploy changes, against the deployed stack:\n{err.report}", file=sys.stderr)
    sys.exit(f"Refused: {err}")
print(f"What this deploy changes, against the deployed stack:\n{report}", file=sys.stderr)

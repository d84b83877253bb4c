#!/usr/bin/env python3
"""CDK app: builds the stacks inside the deploy guard (infra/guard.py).

make synth                      # offline: templates in cdk.out/
make diff                       # what the next deploy changes, against the deployed stack
make deploy ARGS="-c firstDeploy=true -c adminPrincipalArn=arn:aws:iam::123456789012:role/Admin"
make gpu-nodes OVERLAY=2node    # the overlay's nodes + hot spares; every other setting kept
make train TARGET=eks OVERLAY=smoke   # the training Job: never a stack resource

Before synthesis the guard reads the deployed stack through the AWS CLI (infra/deployed.py): its
template and the settings it was deployed with. The context is cdk.json's defaults, under the
deployed settings, under the `-c` values given now; so a deploy from any clone keeps what it is
not told to change. After synthesis it prints what the deploy changes against the deployed
template and refuses what would lose state or access unless acknowledged
(infra/first_deploy.py). Without credentials it says, in one line, that it could not check;
`make deploy` (`-c deployCheck=required`) then refuses, and also refuses another account or
region than the stack's, a missing stack unless `-c firstDeploy=true`, and add-on pins EKS
does not offer (infra/deploy_target.py).
"""

from typing import Any

import aws_cdk as cdk

from infra import nag
from infra.config import StackConfig
from infra.guard import guard
from infra.stack import build_stacks

app = cdk.App()


def build(config: StackConfig, *, keep_creator_admin: bool, settings: dict[str, Any]) -> None:
    """The two stacks of `config`, and the IaC checks on them (infra/nag.py)."""
    build_stacks(app, config=config, keep_creator_admin=keep_creator_admin, settings=settings)
    nag.add_checks(app)


guard(app, build=build)

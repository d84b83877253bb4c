#!/usr/bin/env python3
"""CDK app: reads the context into a validated configuration and builds the stack.

make synth                      # offline: templates in cdk.out/
make deploy ARGS="-c adminPrincipalArn=arn:aws:iam::123456789012:role/Admin"
make train TARGET=eks OVERLAY=smoke   # the training Job: never a stack resource
"""

import sys

import aws_cdk as cdk

from infra import nag
from infra.config import STACK_NAME, ConfigError, load_config
from infra.stack import TrainingClusterStack
from manifests.render import OVERLAYS

app = cdk.App()
try:
    config = load_config(app.node.try_get_context, overlays=OVERLAYS)
    # The stack checks FSx against the overlays' checkpoints first (infra/sizing.py).
    TrainingClusterStack(
        app,
        STACK_NAME,
        config=config,
        # Region only: the account comes from the credentials at deploy time, and with no
        # account synth never looks anything up (AZs are given in the context).
        env=cdk.Environment(region=config.network.region),
        description="EKS + p5.48xlarge/EFA + FSx for Lustre for fault-tolerant FSDP2 training",
    )
except ConfigError as err:
    sys.exit(f"Configuration error: {err}")
nag.add_checks(app)
app.synth()

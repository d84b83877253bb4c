#!/usr/bin/env python3
"""CDK app: reads the context into a validated configuration and builds the stack.

make synth                      # offline: templates in cdk.out/
make diff                       # offline: what the next deploy replaces, against the last one
make deploy ARGS="-c adminPrincipalArn=arn:aws:iam::123456789012:role/Admin"
make train TARGET=eks OVERLAY=smoke   # the training Job: never a stack resource

After synthesis the app compares the template with the last deploy's (infra/first_deploy.py):
it prints what the deploy would replace, and refuses a changed first-deploy setting or a lost
resource that the user has not acknowledged (-c acknowledgeReplacement=...).
"""

import sys
from pathlib import Path

import aws_cdk as cdk

from infra import first_deploy, nag
from infra.config import STACK_NAME, ConfigError, load_config
from infra.stack import build_stacks
from manifests.render import OVERLAYS

app = cdk.App()
try:
    config = load_config(app.node.try_get_context, overlays=OVERLAYS)
    state = first_deploy.state_dir(app.node.try_get_context)
    kept, last_template, last_others = first_deploy.load_kept(state)
    # The stack checks FSx against the overlays' checkpoints first (infra/sizing.py).
    build_stacks(
        app,
        config=config,
        keep_creator_admin=first_deploy.keeps_creator_admin(last_template),
    )
except ConfigError as err:
    sys.exit(f"Configuration error: {err}")
nag.add_checks(app)
assembly = app.synth()

now = first_deploy.settings(config)
# `make deploy` keeps this file (and the template) once the deploy succeeds.
(Path(assembly.directory) / first_deploy.SETTINGS_FILE.lstrip(".")).write_text(
    first_deploy.render(now)
)
try:
    report = first_deploy.check(
        kept=kept,
        now=now,
        last_template=last_template,
        template=assembly.get_stack_by_name(STACK_NAME).template,
        acknowledged=first_deploy.acknowledged(app.node.try_get_context),
        region=config.network.region,
        other_stacks={
            stack: (before, assembly.get_stack_by_name(stack).template)
            for stack, before in last_others.items()
        },
    )
except first_deploy.ReplacementRefused as err:
    print(f"What this deploy changes, against the last deploy:\n{err.report}", file=sys.stderr)
    sys.exit(f"Refused: {err}")
print(f"What this deploy changes, against the last deploy:\n{report}", file=sys.stderr)

"""Before `make deploy` (`-c deployCheck=required`) changes anything: is this the account, the
region and the stack the user means, and does EKS offer the pinned add-on versions?

A wrong region or account reads as "no stack" (DescribeStacks: "does not exist"), and a deploy
would then create a second stack instead of updating the first; so each is refused:

- the AWS CLI's account (`aws sts get-caller-identity`) differs from CDK_DEFAULT_ACCOUNT, the
  account the CDK CLI resolved and gives the app (it passes only CDK_DEFAULT_ACCOUNT/REGION,
  not `--profile`: a profile reaches the AWS CLI as AWS_PROFILE in the environment);
- `-c region` differs from the region of the deployed settings or cdk.json's;
- no stack found and no `-c firstDeploy=true` (a first deploy is said, never assumed);
- an add-on pin EKS does not offer for the cluster's Kubernetes version (EKS would refuse it
  mid-deploy and CloudFormation roll back): `aws eks describe-addon-versions`, the same CLI.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from infra import addon_versions
from infra.deployed import AwsCliError, Runner, aws_cli

FIRST_DEPLOY_KEY = "firstDeploy"


class DeployRefused(Exception):
    """One line: what is wrong and the fix."""


def caller_account(*, region: str, run: Runner = subprocess.run) -> str:
    return str(aws_cli(["sts", "get-caller-identity"], region=region, run=run)["Account"])


def offered_addon_versions(
    name: str, *, kubernetes_version: str, region: str, run: Runner = subprocess.run
) -> set[str]:
    """DescribeAddonVersions through the AWS CLI (which follows nextToken itself)."""
    answer = aws_cli(
        [
            "eks",
            "describe-addon-versions",
            "--addon-name",
            name,
            "--kubernetes-version",
            kubernetes_version,
        ],
        region=region,
        run=run,
    )
    return {v["addonVersion"] for a in answer.get("addons", []) for v in a.get("addonVersions", [])}


def check(
    *,
    stack_status: str,
    stack_name: str,
    region: str,
    deployed_region: str,
    expected_account: str | None,
    first_deploy: bool,
    kubernetes_version: str,
    pins: Mapping[str, str] = addon_versions.EKS_ADDON_VERSIONS,
    run: Runner = subprocess.run,
) -> None:
    """Raise DeployRefused with the first problem found (the cheapest checks first)."""
    if region != deployed_region:
        raise DeployRefused(
            f"-c region={region} differs from {deployed_region}, the region of the deployed "
            f"settings (or cdk.json): {stack_name} there would not be updated, another one would "
            f"be created. Fix: drop -c region, or set region in cdk.json for a new stack"
        )
    try:
        account = caller_account(region=region, run=run)
    except (AwsCliError, OSError, subprocess.TimeoutExpired, KeyError, ValueError) as err:
        raise DeployRefused(
            f"could not confirm the AWS account ({err}). Fix: aws sts get-caller-identity must "
            "work with the credentials the deploy uses (AWS_PROFILE=name, not --profile)"
        ) from None
    if expected_account and account != expected_account:
        raise DeployRefused(
            f"the AWS CLI's credentials are for account {account}, the CDK deploys to "
            f"{expected_account}. Fix: give both the same credentials (AWS_PROFILE=name make "
            "deploy; the CDK CLI's --profile does not reach the AWS CLI the app runs)"
        )
    if stack_status == "none" and not first_deploy:
        raise DeployRefused(
            f"no stack {stack_name} in account {account}, region {region}. Fix: if this is the "
            f'first deploy, say so: make deploy ARGS="-c {FIRST_DEPLOY_KEY}=true ..."; '
            "otherwise use the account and region it was deployed to"
        )
    names = list(pins)
    try:
        with ThreadPoolExecutor(max_workers=len(names) or 1) as pool:
            offered = dict(
                zip(
                    names,
                    pool.map(
                        lambda n: offered_addon_versions(
                            n, kubernetes_version=kubernetes_version, region=region, run=run
                        ),
                        names,
                    ),
                    strict=True,
                )
            )
    except (AwsCliError, OSError, subprocess.TimeoutExpired, KeyError, ValueError) as err:
        raise DeployRefused(
            f"could not check the add-on versions with EKS ({err}). Fix: the deploy's "
            "credentials need eks:DescribeAddonVersions"
        ) from None
    missing = [f"{n} {pins[n]}" for n in names if pins[n] not in offered[n]]
    if missing:
        raise DeployRefused(
            f"EKS does not offer {', '.join(missing)} for Kubernetes {kubernetes_version} in "
            f"{region}. Fix: pick one from `aws eks describe-addon-versions --region {region} "
            f"--kubernetes-version {kubernetes_version} --addon-name NAME` and set it in "
            "infra/addon_versions.py"
        )

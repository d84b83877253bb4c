"""The EKS managed add-ons the stack installs, each pinned to one version (the Helm charts are
pinned in infra/addons.py): a redeploy installs the same software, and a version change is a
reviewed diff, not whatever EKS defaults to on the day.

EKS accepts only versions it offers for the cluster's Kubernetes version. Nothing here can ask
it, so the pins carry where they were read, and `python -m infra.addon_versions check --region
R` asks EKS (DescribeAddonVersions, `GET /addons/supported-versions`, EKS API reference) before a
deploy: one line per pin, non-zero exit naming any version EKS does not offer, with the command
that lists the ones it does. Run it before the first deploy and after changing a pin.
"""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from collections.abc import Mapping

from training import exits

KUBERNETES_VERSION = "1.36"
"""The Kubernetes version the pins were chosen for (cdk.json `kubernetesVersion`; a test keeps
the two equal, so a version bump asks for new pins)."""

EKS_ADDON_VERSIONS: Mapping[str, str] = {
    # Read as "the AWS default for Kubernetes 1.36 in eu-west-2 on 2026-08-31" (`aws eks
    # describe-addon-versions --kubernetes-version 1.36`) in a public Terraform configuration;
    # not checked against EKS from here.
    "vpc-cni": "v1.22.4-eksbuild.3",
    "eks-pod-identity-agent": "v1.3.10-eksbuild.3",
    # Read from a public 1.36 configuration (its date unknown); not checked against EKS.
    "eks-node-monitoring-agent": "v1.6.6-eksbuild.1",
    # The least certain pin: the upstream driver's release v1.9.0 (kubernetes-sigs/
    # aws-fsx-csi-driver) with EKS's first build suffix; run the check before deploying.
    "aws-fsx-csi-driver": "v1.9.0-eksbuild.1",
}


def addon_version(name: str) -> str:
    """The pinned version of add-on `name` (KeyError names the table for a new add-on)."""
    try:
        return EKS_ADDON_VERSIONS[name]
    except KeyError:
        raise KeyError(f"EKS add-on {name}: no pinned version in infra/addon_versions.py") from None


def offered_versions(name: str, *, region: str, endpoint: str | None = None) -> set[str]:
    """The versions EKS offers for `name` on KUBERNETES_VERSION (DescribeAddonVersions)."""
    from infra.aws_call import signed_request

    base = endpoint or f"https://eks.{region}.amazonaws.com"
    query = urllib.parse.urlencode({"addonName": name, "kubernetesVersion": KUBERNETES_VERSION})
    versions: set[str] = set()
    token = ""
    while True:
        url = f"{base}/addons/supported-versions?{query}"
        if token:
            url += "&" + urllib.parse.urlencode({"nextToken": token})
        answer = signed_request("GET", url, service="eks", region=region) or {}
        for addon in answer.get("addons", []):
            versions |= {v["addonVersion"] for v in addon.get("addonVersions", [])}
        token = answer.get("nextToken") or ""
        if not token:
            return versions


def check(*, region: str, endpoint: str | None = None) -> list[str]:
    """One line per pin; the lines of pins EKS does not offer start with 'not offered'."""
    lines = []
    for name, version in EKS_ADDON_VERSIONS.items():
        offered = offered_versions(name, region=region, endpoint=endpoint)
        if version in offered:
            lines.append(f"ok {name} {version}")
        else:
            lines.append(
                f"not offered: {name} {version} on Kubernetes {KUBERNETES_VERSION} in {region}; "
                f"pick one from `aws eks describe-addon-versions --region {region} "
                f"--kubernetes-version {KUBERNETES_VERSION} --addon-name {name}` and set it in "
                "infra/addon_versions.py"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.addon_versions", description=__doc__)
    parser.add_argument("command", choices=["check"])
    parser.add_argument("--region", required=True)
    parser.add_argument("--endpoint", help="EKS endpoint (tests)")
    args = parser.parse_args(argv)
    from infra.aws_call import AwsCallError

    try:
        lines = check(region=args.region, endpoint=args.endpoint)
    except AwsCallError as err:
        print(f"addon-versions: {err}", file=sys.stderr)
        return exits.FAILED
    print("\n".join(lines))
    return exits.FAILED if any(line.startswith("not offered") for line in lines) else exits.OK


if __name__ == "__main__":
    sys.exit(main())

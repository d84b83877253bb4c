"""The stack outputs the Job launcher reads (training/launch/eks.py).

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

from aws_cdk.assertions import Match, Template


def test_outputs_for_the_job_launcher(default_assertions: Template) -> None:
    for name in (
        "ClusterName",
        "UpdateKubeconfigCommand",
        "FsxFileSystemId",
        "FsxDnsName",
        "FsxMountName",
        "ImageUri",
        "TrainingNamespace",
        "Region",
    ):
        default_assertions.has_output(name, Match.any_value())
    default_assertions.has_output("ClusterName", {"Value": "fsdp-resilient"})
    default_assertions.has_output("TrainingNamespace", {"Value": "training"})
    default_assertions.has_output(
        "UpdateKubeconfigCommand",
        {"Value": "aws eks update-kubeconfig --region us-east-2 --name fsdp-resilient"},
    )

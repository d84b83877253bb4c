"""The JobSet controller (the replica groups' JobSet, manifests/replica.py) is installed by the
stack from its published OCI chart at the pinned version, on the system nodes, and the stack
waits for it.

What only a cluster confirms: the chart's pull from registry.k8s.io by the CDK kubectl handler
(``helm pull oci://... --version``) and its webhook answering the API server.
"""

from __future__ import annotations

from aws_cdk.assertions import Match, Template
from infra_template import HELM_CHART, NODEGROUP, only_one_has

from infra.addons import JOBSET, SYSTEM_NODE_SELECTOR
from manifests.replica import JOBSET_API_VERSION


def test_the_jobset_chart_is_pulled_from_its_oci_reference_at_the_pinned_version(
    default_assertions: Template,
) -> None:
    only_one_has(
        default_assertions,
        HELM_CHART,
        {
            # An OCI chart: the handler pulls `Repository` itself (the chart's full reference).
            "Repository": "oci://registry.k8s.io/jobset/charts/jobset",
            "Version": "0.12.0",
            "Namespace": "jobset-system",
            "Release": "jobset",
            # A JobSet submitted before the webhook answers is refused: the stack waits.
            "Wait": True,
        },
        selector={"Chart": JOBSET.name},
    )
    # The release whose CRD serves the API version the manifests use (chart 0.12.0's
    # crds/jobset.x-k8s.io_jobsets.yaml serves v1alpha2).
    assert JOBSET_API_VERSION == "jobset.x-k8s.io/v1alpha2"


def test_the_controller_runs_on_the_system_nodes(default_assertions: Template) -> None:
    values = {"controller": {"nodeSelector": Match.exact(SYSTEM_NODE_SELECTOR)}}
    only_one_has(
        default_assertions,
        HELM_CHART,
        {"Values": Match.serialized_json(Match.object_like(values))},
        selector={"Chart": JOBSET.name},
    )
    # The selector names a label the system node group really has, and the chart (which waits
    # for its pod) is installed after that node group.
    groups = default_assertions.find_resources(NODEGROUP)
    labelled = [
        name for name, g in groups.items() if g["Properties"].get("Labels") == SYSTEM_NODE_SELECTOR
    ]
    assert len(labelled) == 1, [g["Properties"].get("Labels") for g in groups.values()]
    (chart,) = default_assertions.find_resources(HELM_CHART, {"Properties": {"Chart": "jobset"}})
    depends = default_assertions.to_json()["Resources"][chart]["DependsOn"]
    assert labelled[0] in depends, depends

"""The ``replica`` run on EKS: one JobSet of the overlay's Job per group, and the Lighthouse.

No API server here: the core objects are validated against the Kubernetes schema
(kubernetes-validate, strict), the JobSet (a CRD) by what it must hold. The Lighthouse's
command is the one the local launcher starts (``lighthouse_command``), which
``tests/training/replica/test_replica_fault.py`` runs.
"""

from __future__ import annotations

import kubernetes_validate

from manifests import render
from manifests.objects.common import labels
from manifests.replica import (
    JOB_INDEX_LABEL,
    LIGHTHOUSE_PORT,
    jobset_objects,
    lighthouse_address,
)
from training.command import trainer_args_of
from training.overrides import build_config
from training.replica.topology import GROUP_ENV, LIGHTHOUSE_ENV, lighthouse_command


def _objects(groups: int = 2) -> list[dict]:
    return jobset_objects(overlay="2node", namespace="training", image="img:1", groups=groups)


def test_the_lighthouse_is_deployed_like_the_rendezvous_store() -> None:
    objects = _objects(groups=3)
    kinds = [o["kind"] for o in objects]
    assert kinds == [
        "PriorityClass",
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Service",
        "JobSet",
    ]
    for obj in objects[:-1]:
        kubernetes_validate.validate(obj, render.KUBERNETES_VERSION, strict=True)
    deployment = objects[1]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    min_replicas = build_config(["--restart=replica", "--resilience.replica_groups=3"])[
        0
    ].resilience.replica_min_groups
    assert container["command"] == lighthouse_command(
        min_replicas=min_replicas, port=LIGHTHOUSE_PORT
    )
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    policy = objects[3]["spec"]
    assert policy["egress"] == []
    assert policy["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": labels(render.TRAINER)}}
    ]


def test_each_group_is_the_overlays_job_with_its_own_index_directories_and_rendezvous() -> None:
    jobset = _objects()[-1]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 2
    pod = replicated["template"]["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == render.CONTAINER]
    env = {e["name"]: e for e in container["env"]}
    assert env[GROUP_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.labels['{JOB_INDEX_LABEL}']"
    )
    assert env[LIGHTHOUSE_ENV]["value"] == lighthouse_address("training")
    command = [*container.get("command", []), *container.get("args", [])]
    # Each child Job's own uid: one rendezvous per group.
    assert any(a == "--rdzv-id=$(JOB_UID)" for a in command)
    config, _ = build_config([a.replace("$(RECIPE)", "p5_8b") for a in trainer_args_of(command)])
    assert config.resilience.restart == "replica"
    assert config.resilience.replica_groups == 2
    assert config.run_dir.endswith(f"/group-$({GROUP_ENV})")
    assert config.checkpoint_dir.endswith(f"/group-$({GROUP_ENV})")
    # The pod is the plain Job's in every other respect (same image, resources, volumes).
    plain = next(
        o
        for o in render.job_objects(overlay="2node", namespace="training", image="img:1")
        if o["kind"] == "Job"
    )
    plain_pod = plain["spec"]["template"]["spec"]
    assert pod["volumes"] == plain_pod["volumes"]
    assert [c["resources"] for c in pod["containers"]] == [
        c["resources"] for c in plain_pod["containers"]
    ]


def test_a_plain_indexed_job_refuses_the_replica_mode() -> None:
    """Its ranks would start without a group or a Lighthouse: the overlay's Job is refused
    with the modes it can run (``sizes.RESTART_MODES``), before anything is rendered."""
    import pytest

    with pytest.raises(ValueError, match="restart must be one of injob, inprocess, nested"):
        render.job_objects(overlay="2node", namespace="training", image="img:1", restart="replica")

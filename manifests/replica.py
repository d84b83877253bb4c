"""The Kubernetes objects of a ``replica`` run: one Job per replica group as a JobSet, and the
torchft Lighthouse the groups meet at.

Each group's Job is the overlay's ordinary training Job (``manifests.objects.job``: the
same pod, launcher command and restart layers), made a JobSet's replicated Job with
``replicas = groups`` (the JobSet API, ``jobset.x-k8s.io/v1alpha2``: kubernetes-sigs/jobset,
``api/jobset/v1alpha2/jobset_types.go``). What a group's failure restarts:

- a dead or hung rank: the group's own ``ft_launcher`` restarts the group's workers in their
  pods (the in-job layer); the other groups' pods and processes are untouched;
- a lost pod: the group's Job replaces it (its own ``podFailurePolicy``/``backoffLimit``),
  other Jobs are untouched;
- a group's Job failing outright: the JobSet's failure policy recreates that Job alone
  (``RestartJob``, "recreate only the failed Job without touching the other Jobs", JobSet
  v0.12.0's ``FailurePolicyAction``, the release the stack installs: ``infra/addons.py``
  ``JOBSET``); its new pods restore from the group's tiers and heal from a live peer group. Past
  ``JOBSET_MAX_RESTARTS`` the JobSet fails.

Per group: its rendezvous is its Job's own (``$(JOB_UID)``, each child Job's uid), its run and
checkpoint directories are ``.../group-$(REPLICA_GROUP_ID)`` (later flags win), and
``REPLICA_GROUP_ID`` is the Job's index in the JobSet (the ``jobset.sigs.k8s.io/job-index``
label JobSet puts on each Job's pods).

Not run against a cluster here (no API server with the JobSet CRD): the core objects are
checked with kubernetes-validate, the JobSet by its structure.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from manifests.objects.common import FSX_MOUNT, size_of
from manifests.objects.job import job_for_args, trainer_args
from manifests.objects.system_service import system_service_objects
from training.config import ResilienceConfig, replica_min_groups
from training.overrides import build_config
from training.replica.topology import GROUP_ENV, LIGHTHOUSE_ENV, lighthouse_command

LIGHTHOUSE = "fsdp-lighthouse"
LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's default --bind port
LIGHTHOUSE_PRIORITY_CLASS = "fsdp-lighthouse"
LIGHTHOUSE_PRIORITY = 1_000_000
"""As the rendezvous store's (``objects.rdzv_store.RDZV_PRIORITY``): above every trainer pod."""
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
REPLICATED_JOB = "group"
JOBSET_MAX_RESTARTS = 3
"""Recreations of failed groups' Jobs (all groups together) before the JobSet fails."""
JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
"""The JobSet API (kubernetes-sigs/jobset ``api/jobset/v1alpha2``), served by the chart the stack
installs."""


def group_job_name(job_name: str, group: int) -> str:
    """The name JobSet gives group ``group``'s Job (kubernetes-sigs/jobset
    ``pkg/util/placement/placement.go`` ``GenJobName``: ``<jobset>-<replicatedJob>-<index>``)."""
    return f"{job_name}-{REPLICATED_JOB}-{group}"


def _resilience_of(*, overlay: str, train_args: Sequence[str]) -> ResilienceConfig:
    size = size_of(overlay)
    config, _ = build_config([f"--recipe={size.recipe}", "--restart=replica", *train_args])
    return config.resilience


def replica_groups_of(*, overlay: str, train_args: Sequence[str]) -> int:
    """The run's replica groups: what the trainer makes of its arguments
    (``--resilience.replica_groups``, else the recipe's or the config's default)."""
    return _resilience_of(overlay=overlay, train_args=train_args).replica_groups


def lighthouse_address(namespace: str) -> str:
    return f"http://{LIGHTHOUSE}.{namespace}:{LIGHTHOUSE_PORT}"


def lighthouse_objects(*, namespace: str, image: str, min_replicas: int) -> list[dict]:
    """The Lighthouse as the rendezvous store is deployed (``system_service_objects``): one
    replica on the system nodes, recreated not rolled, above the trainers' priority, no
    voluntary eviction, reachable only from trainer pods, no egress (it only answers)."""
    return system_service_objects(
        name=LIGHTHOUSE,
        namespace=namespace,
        component="lighthouse",
        priority_class_name=LIGHTHOUSE_PRIORITY_CLASS,
        priority=LIGHTHOUSE_PRIORITY,
        description="The replica groups' torchft Lighthouse: every step's quorum needs it.",
        container={
            "name": "lighthouse",
            "image": image,
            "command": lighthouse_command(min_replicas=min_replicas, port=LIGHTHOUSE_PORT),
        },
        port=LIGHTHOUSE_PORT,
        port_name="lighthouse",
    )


def group_train_args(*, job_name: str, groups: int, train_args: Sequence[str]) -> list[str]:
    group = f"group-$({GROUP_ENV})"
    return [
        *train_args,
        f"--resilience.replica_groups={groups}",
        f"--run-dir={FSX_MOUNT}/runs/{job_name}/{group}",
        f"--checkpoint.dir={FSX_MOUNT}/checkpoints/{job_name}/{group}",
    ]


def jobset_objects(
    *,
    overlay: str,
    namespace: str,
    image: str,
    groups: int | None = None,
    train_args: Sequence[str] | None = None,
) -> list[dict]:
    """The Lighthouse's objects and the JobSet of ``groups`` copies of the overlay's Job (by
    default as many as the trainer arguments say, ``replica_groups_of``): each group has the
    overlay's nodes, so the run holds ``groups x nodes`` nodes."""
    size = size_of(overlay)
    train_args = size.train_args if train_args is None else train_args
    if groups is None:
        groups = replica_groups_of(overlay=overlay, train_args=train_args)
    args = group_train_args(job_name=size.job_name, groups=groups, train_args=train_args)
    # The overlay's Job as ``job_objects`` builds it, for the replica mode, which
    # ``job_objects`` refuses (a plain Indexed Job cannot run it: ``sizes.RESTART_MODES``).
    trainer = trainer_args(size=size, restart="replica", train_args=args)
    job = job_for_args(size=size, namespace=namespace, image=image, args=trainer)
    spec = copy.deepcopy(job["spec"])
    pod = spec["template"]["spec"]
    for container in pod["containers"]:
        container["env"] = [
            {
                "name": GROUP_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_INDEX_LABEL}']"}},
            },
            {"name": LIGHTHOUSE_ENV, "value": lighthouse_address(namespace)},
            *container.get("env", []),
        ]
    jobset = {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": {
            "name": size.job_name,
            "namespace": namespace,
            "labels": job["metadata"].get("labels", {}),
        },
        "spec": {
            "failurePolicy": {
                "maxRestarts": JOBSET_MAX_RESTARTS,
                # Without a matching rule JobSet restarts every Job (RestartJobSet).
                "rules": [
                    {
                        "name": "restartTheFailedGroupOnly",
                        "action": "RestartJob",
                        "targetReplicatedJobs": [REPLICATED_JOB],
                    }
                ],
            },
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": groups,
                    "template": {
                        "metadata": {"labels": job["metadata"].get("labels", {})},
                        "spec": spec,
                    },
                }
            ],
        },
    }
    # The Lighthouse's --min_replicas as the trainer derives it (``replica_min_groups``): the
    # semantics from the same arguments, for these groups.
    semantics = _resilience_of(overlay=overlay, train_args=train_args).replica_semantics
    min_replicas = replica_min_groups(groups=groups, semantics=semantics)
    lighthouse = lighthouse_objects(namespace=namespace, image=image, min_replicas=min_replicas)
    return [*lighthouse, jobset]

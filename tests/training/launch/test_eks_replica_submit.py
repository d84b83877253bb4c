"""``make train TARGET=eks RESTART=replica``: the EKS launcher submits the replica groups (the
torchft Lighthouse's objects and one JobSet of a Job per group, manifests/replica.py) instead of
the plain Job, up to HTTP.

The same boundary as test_eks_launcher.py (its fake API server on 127.0.0.1, the real
kubernetes client): server-side apply of every object, the JobSet through the custom objects
API at ``/apis/jobset.x-k8s.io/v1alpha2/.../jobsets/<name>``, in order. What a real API server
with JobSet's CRD and webhook would answer (admission, the controller creating each group's
Job) needs a cluster.
"""

from __future__ import annotations

import subprocess

import pytest
import test_eks_launcher as base
from support import REPO_ROOT, requires_tool
from test_eks_launcher import IMAGE, JOB, NS, SPARE_CLASS, SPARES, _healthy, _pod, _run

from manifests import render, replica
from training.launch import eks
from training.overrides import build_config

JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
fake = base.fake  # the fake API server and the stack outputs (fixtures, found by these names)
outputs = base.outputs
LIGHTHOUSE_CLASS = f"/apis/scheduling.k8s.io/v1/priorityclasses/{replica.LIGHTHOUSE_PRIORITY_CLASS}"
LIGHTHOUSE = [
    ("PATCH", LIGHTHOUSE_CLASS),
    ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{replica.LIGHTHOUSE}"),
    ("PATCH", f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{replica.LIGHTHOUSE}"),
    ("PATCH", f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/{replica.LIGHTHOUSE}"),
    ("PATCH", f"/api/v1/namespaces/{NS}/services/{replica.LIGHTHOUSE}"),
]


def _replica_routes(fake) -> None:
    _healthy(fake)
    for _, path in LIGHTHOUSE:
        fake.route("PATCH", path, lambda r: (200, r.body))
    fake.route("PATCH", f"{JOBSETS}/fsdp-smoke", lambda r: (200, r.body))


def test_submit_applies_spares_the_lighthouse_then_the_jobset(fake, outputs):
    _replica_routes(fake)
    code, text = _run(
        fake, outputs, "submit", "--overlay", "smoke", "--restart", "replica", "--train.steps=5"
    )
    assert code == 0, text
    assert fake.calls() == [
        ("GET", f"/api/v1/namespaces/{NS}"),
        ("GET", f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{render.PVC_NAME}"),
        ("PATCH", SPARE_CLASS),
        ("PATCH", SPARES),
        *LIGHTHOUSE,
        ("PATCH", f"{JOBSETS}/fsdp-smoke"),
    ]
    assert not any(r.path.startswith(JOB) for r in fake.requests)  # no plain Job
    expected = [
        *render.spare_objects(overlay="smoke", namespace=NS, image=IMAGE),
        *replica.jobset_objects(
            overlay="smoke", namespace=NS, image=IMAGE, groups=2, train_args=["--train.steps=5"]
        ),
    ]
    for req, obj in zip(fake.requests[2:], expected, strict=True):
        assert req.content_type == "application/apply-patch+yaml"
        assert req.query["fieldManager"] == [render.PROJECT]
        assert req.query["force"] == ["true"]
        assert req.body == obj
    jobset = fake.requests[-1].body
    assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 2  # the config's default groups
    # A failed group's Job is recreated alone (JobSet's RestartJob), not every group's.
    (rule,) = jobset["spec"]["failurePolicy"]["rules"]
    assert rule["action"] == "RestartJob"
    assert rule["targetReplicatedJobs"] == [replica.REPLICATED_JOB]
    assert "2 replica groups x 1 node(s)" in text


def test_the_groups_come_from_the_trainer_arguments(fake, outputs):
    """One owner: the JobSet's replicas and every group's --resilience.replica_groups agree."""
    _replica_routes(fake)
    code, _ = _run(
        fake,
        outputs,
        "submit",
        "--restart",
        "replica",
        "--resilience.replica_groups=3",
    )
    assert code == 0
    (group,) = fake.requests[-1].body["spec"]["replicatedJobs"]
    assert group["replicas"] == 3
    args = group["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--resilience.replica_groups=3" in " ".join(args)
    lighthouse = next(r.body for r in fake.requests if r.path == LIGHTHOUSE[1][1])
    command = lighthouse["spec"]["template"]["spec"]["containers"][0]["command"]
    # As the trainer derives it from the same arguments (resilience.replica_semantics).
    config, _ = build_config(["--restart=replica", "--resilience.replica_groups=3"])
    assert f"--min_replicas={config.resilience.replica_min_groups}" in command


def test_a_changed_jobset_says_stop_first(fake, outputs):
    _replica_routes(fake)
    invalid = {"kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422}
    fake.route("PATCH", f"{JOBSETS}/fsdp-smoke", (422, invalid))
    with pytest.raises(eks.UsageError, match=r"jobset training/fsdp-smoke already exists"):
        _run(fake, outputs, "submit", "--restart", "replica")


def test_follow_watches_group_0s_job(fake, outputs):
    _replica_routes(fake)
    child = replica.group_job_name("fsdp-smoke", 0)
    assert child == "fsdp-smoke-group-0"  # JobSet's <jobset>-<replicatedJob>-<index>
    done = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    fake.route("GET", f"{JOB}/{child}", (200, {"spec": {"completions": 1}, "status": done}))
    pod = _pod(f"{child}-0-aaaaa", 0, "Succeeded", "2026-01-01T00:00:00Z")
    fake.route("GET", f"/api/v1/namespaces/{NS}/pods", (200, {"items": [pod]}))
    fake.route("GET", f"/api/v1/namespaces/{NS}/pods/{child}-0-aaaaa/log", (200, "step 9\n"))
    code, text = _run(fake, outputs, "submit", "--restart", "replica", "--follow")
    assert code == 0, text
    assert "Complete" in text
    pod_lists = [r for r in fake.requests if r.path.endswith("/pods")]
    assert pod_lists[0].query["labelSelector"] == [f"batch.kubernetes.io/job-name={child}"]


def test_status_of_another_group(fake, outputs):
    child = replica.group_job_name("fsdp-smoke", 1)
    fake.route("GET", f"{JOB}/{child}", (200, {"spec": {"completions": 1}, "status": {}}))
    fake.route("GET", f"/api/v1/namespaces/{NS}/pods", (200, {"items": []}))
    code, text = _run(fake, outputs, "status", "--group", "1")
    assert code == 0
    assert child in text


def test_stop_deletes_the_jobset_with_its_jobs_never_the_data(fake, outputs):
    fake.route("DELETE", f"{JOBSETS}/fsdp-smoke", (200, {"kind": "Status", "status": "Success"}))
    code, text = _run(fake, outputs, "stop")
    assert code == 0
    deletes = [r for r in fake.requests if r.method == "DELETE"]
    assert deletes[0].path == f"{JOBSETS}/fsdp-smoke"
    assert deletes[0].query["propagationPolicy"] == ["Foreground"]
    assert "deleted JobSet/fsdp-smoke (FSx data kept)" in text
    assert not any("persistentvolume" in r.path for r in fake.requests)


@requires_tool("make")
def test_make_train_on_eks_passes_the_restart_mode() -> None:
    """The Makefile's command line (``make -n``: printed, not run) parses to a replica
    submission; a plain ``make train TARGET=eks`` keeps the overlay's mode."""

    def submit_argv(*assignments: str) -> list[str]:
        printed = subprocess.run(
            ["make", "-n", "--no-print-directory", "train", "TARGET=eks", *assignments],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.replace("\\\n", " ")
        (line,) = [ln for ln in printed.splitlines() if "training.launch.eks" in ln]
        return line.split("training.launch.eks", 1)[1].split()

    ns, _ = eks.parse(submit_argv("RESTART=replica"))
    assert (ns.command, ns.restart, ns.follow) == ("submit", "replica", True)
    ns, _ = eks.parse(submit_argv())
    assert ns.restart is None

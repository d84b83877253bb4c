"""Tests of `python -m training.launch.eks` (submit, follow, status, logs, stop) up to HTTP.

Run: .venv/bin/pytest tests/training/launch/test_eks_launcher.py

No Kubernetes API server can run on this machine, so these tests stop at the HTTP boundary: the
real kubernetes Python client talks to a small fake API server on 127.0.0.1 (a thread in this
process) that records every request (method, path, query, content type, body) and answers with
canned JSON. What is tested is therefore the real serialization: server-side apply as PATCH
with `application/apply-patch+yaml`, `fieldManager` and `force`, the objects and their order,
idempotency, and the error messages. What is not tested: a real API server's answers (field
ownership, admission, scheduling), which need a cluster.
"""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client

from manifests import render
from ops import cluster as ops_cluster
from training.launch import eks

NS = "training"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/eks-fsdp-resilient:abc123"
JOB = "/apis/batch/v1/namespaces/training/jobs"
SVC = "/api/v1/namespaces/training/services"
SPARES = f"/apis/apps/v1/namespaces/training/deployments/{render.SPARES}"
SPARE_CLASS = f"/apis/scheduling.k8s.io/v1/priorityclasses/{render.SPARE_PRIORITY_CLASS}"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: dict | None


Reply = tuple[int, object]  # status, JSON body (or str for logs)


@dataclass
class FakeApiServer:
    """Routes (method, path) to a reply function; unknown routes answer 404 like the server."""

    routes: dict[tuple[str, str], Callable[[Request], Reply]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)

    def route(self, method: str, path: str, reply: Callable[[Request], Reply] | Reply) -> None:
        self.routes[(method, path)] = reply if callable(reply) else (lambda _r, v=reply: v)

    def handle(self, req: Request) -> Reply:
        self.requests.append(req)
        fn = self.routes.get((req.method, req.path))
        if fn is None:
            return 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
        return fn(req)

    def calls(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]


@pytest.fixture
def fake():
    server = FakeApiServer()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self):
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            req = Request(
                method=self.command,
                path=url.path,
                query=parse_qs(url.query),
                content_type=self.headers.get("Content-Type", ""),
                body=json.loads(raw) if raw else None,
            )
            status, body = server.handle(req)
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header(
                "Content-Type", "text/plain" if isinstance(body, str) else "application/json"
            )
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_DELETE = _serve

        def log_message(self, *args):  # keep pytest's output clean
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield server
    httpd.shutdown()
    httpd.server_close()


def _cluster(url: str) -> ops_cluster.Cluster:
    cfg = client.Configuration(host=url)
    cfg.retries = 0
    return ops_cluster.Cluster.from_api_client(client.ApiClient(cfg))


@pytest.fixture
def outputs(tmp_path) -> Path:
    path = tmp_path / "cdk-outputs.json"
    path.write_text(
        json.dumps(
            {
                "EksFsdpResilient": {
                    "ClusterName": "fsdp",
                    "UpdateKubeconfigCommand": "aws eks update-kubeconfig --name fsdp",
                    "FsxFileSystemId": "fs-1",
                    "FsxDnsName": "fs-1.fsx",
                    "FsxMountName": "abc",
                    "ImageUri": IMAGE,
                    "TrainingNamespace": NS,
                    "Region": "us-east-1",
                }
            }
        )
    )
    return path


def _healthy(fake: FakeApiServer) -> None:
    """The stack's shared objects exist; applies echo the object back."""
    fake.route("GET", f"/api/v1/namespaces/{NS}", (200, {"metadata": {"name": NS}}))
    pvc = f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{render.PVC_NAME}"
    fake.route("GET", pvc, (200, {"metadata": {"name": render.PVC_NAME}}))
    for overlay in render.OVERLAYS:
        fake.route("PATCH", f"{SVC}/fsdp-{overlay}", lambda r: (200, r.body))
        fake.route("PATCH", f"{JOB}/fsdp-{overlay}", lambda r: (200, r.body))
    fake.route("PATCH", SPARES, lambda r: (200, r.body))
    fake.route("PATCH", SPARE_CLASS, lambda r: (200, r.body))


def _run(fake, outputs, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = eks.run(
        [*argv, "--outputs", str(outputs)],
        out=out,
        cluster=_cluster(fake.url),
        sleep=lambda s: None,
    )
    return code, out.getvalue()


def test_submit_server_side_applies_spares_service_then_job(fake, outputs):
    _healthy(fake)
    code, text = _run(fake, outputs, "submit", "--overlay", "smoke", "--train.steps=5")
    assert code == 0
    assert fake.calls() == [
        ("GET", f"/api/v1/namespaces/{NS}"),
        ("GET", f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{render.PVC_NAME}"),
        ("PATCH", SPARE_CLASS),
        ("PATCH", SPARES),
        ("PATCH", f"{SVC}/fsdp-smoke"),
        ("PATCH", f"{JOB}/fsdp-smoke"),
    ]
    expected = [
        *render.spare_objects(overlay="smoke", namespace=NS, image=IMAGE),
        *render.job_objects(
            overlay="smoke", namespace=NS, image=IMAGE, train_args=["--train.steps=5"]
        ),
    ]
    for req, obj in zip(fake.requests[2:], expected, strict=True):
        assert req.content_type == "application/apply-patch+yaml"
        assert req.query["fieldManager"] == [render.PROJECT]
        assert req.query["force"] == ["true"]
        assert req.body == obj
    assert "world size 8" in text


def test_submit_twice_sends_identical_requests(fake, outputs):
    """Idempotent: apply carries the full desired state, so a re-submit changes nothing."""
    _healthy(fake)
    _run(fake, outputs, "submit", "--overlay", "smoke")
    first = list(fake.requests)
    fake.requests.clear()
    _run(fake, outputs, "submit", "--overlay", "smoke")
    assert fake.requests == first


def test_submit_never_touches_the_stack_objects(fake, outputs):
    _healthy(fake)
    _run(fake, outputs, "submit", "--overlay", "smoke")
    writes = [r for r in fake.requests if r.method != "GET"]
    assert {r.body["kind"] for r in writes} == {"PriorityClass", "Deployment", "Service", "Job"}


def test_submit_keeps_the_overlays_hot_spares(fake, outputs):
    """The 2-node overlay's spare placeholders go out with its Job (the count from
    manifests/sizes.py, the one owner); the smoke overlay scales them to none."""
    _healthy(fake)
    _run(fake, outputs, "submit", "--overlay", "2node")
    (deployment,) = [r.body for r in fake.requests if r.path == SPARES]
    assert deployment["spec"]["replicas"] == render.size_of("2node").spares >= 1
    fake.requests.clear()
    _run(fake, outputs, "submit", "--overlay", "smoke")
    (deployment,) = [r.body for r in fake.requests if r.path == SPARES]
    assert deployment["spec"]["replicas"] == 0


def test_missing_namespace_is_one_clear_message(fake, outputs, capsys):
    code = _main(fake, outputs, "submit", "--overlay", "smoke")
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"namespace {NS} not found" in err and "make deploy" in err
    assert all(m == "GET" for m, _ in fake.calls())


def test_missing_fsx_claim_is_one_clear_message(fake, outputs, capsys):
    fake.route("GET", f"/api/v1/namespaces/{NS}", (200, {"metadata": {"name": NS}}))
    assert _main(fake, outputs, "submit", "--overlay", "smoke") == 2
    assert f"FSx claim {NS}/{render.PVC_NAME} not found" in capsys.readouterr().err


def test_changed_spec_of_existing_job_says_stop_first(fake, outputs):
    _healthy(fake)
    invalid = {"kind": "Status", "code": 422, "reason": "Invalid", "message": "field is immutable"}
    fake.route("PATCH", f"{JOB}/fsdp-smoke", (422, invalid))
    with pytest.raises(eks.UsageError, match=r"already exists with a different spec.*eks-stop"):
        _run(fake, outputs, "submit", "--overlay", "smoke")


def _main(fake, outputs, *argv: str) -> int:
    """eks.main's error handling around eks.run, wired to the fake server."""
    original = eks.run

    def run(args):
        return original(args, cluster=_cluster(fake.url), sleep=lambda s: None)

    eks_run, eks.run = eks.run, run
    try:
        return eks.main([*argv, "--outputs", str(outputs)])
    finally:
        eks.run = eks_run


def test_missing_outputs_file_exits_2_naming_make_deploy(tmp_path, capsys):
    code = eks.main(["submit", "--overlay", "smoke", "--outputs", str(tmp_path / "none.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert "not found: run `make deploy`" in err and err.count("\n") == 1


def test_missing_kubeconfig_names_the_update_kubeconfig_command(tmp_path, outputs, capsys):
    code = eks.main(
        [
            "status",
            "--outputs",
            str(outputs),
            "--kubeconfig",
            str(tmp_path / "no-kubeconfig"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "no usable kubeconfig" in err
    assert "run `aws eks update-kubeconfig --name fsdp`" in err


def test_unreachable_cluster_names_the_fix(outputs, capsys):
    import socket

    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = _cluster(f"http://127.0.0.1:{port}")
    with pytest.raises(eks.UsageError, match=r"cannot reach the cluster.*update-kubeconfig"):
        eks.run(["status", "--outputs", str(outputs)], out=io.StringIO(), cluster=cluster)


def test_unknown_overlay_exits_2_naming_the_choices(outputs, capsys):
    assert eks.main(["status", "--overlay", "huge", "--outputs", str(outputs)]) == 2
    assert "smoke, 2node, 16node" in capsys.readouterr().err


def test_trainer_overrides_only_for_submit():
    ns, rest = eks.parse(["submit", "--overlay", "2node", "--train.steps=9", "--follow"])
    assert (ns.overlay, ns.follow, rest) == ("2node", True, ["--train.steps=9"])
    with pytest.raises(eks.UsageError, match="unrecognized argument"):
        eks.parse(["submit", "--bogus"])
    with pytest.raises(eks.UsageError, match="`submit` only"):
        eks.parse(["stop", "--train.steps=9"])


def test_flags_override_the_outputs_file(tmp_path):
    ns, _ = eks.parse(["submit", "--namespace", "other", "--image", "img:1", "--outputs", "/none"])
    target = eks.resolve_target(ns)
    assert (target.namespace, target.image, target.job_name) == ("other", "img:1", "fsdp-smoke")


def test_outputs_file_needs_one_stack_with_our_outputs(tmp_path):
    path = tmp_path / "o.json"
    path.write_text(json.dumps({"A": {"TrainingNamespace": "x"}, "B": {"TrainingNamespace": "y"}}))
    with pytest.raises(eks.UsageError, match="exactly one stack"):
        ops_cluster.StackOutputs.from_file(path)
    path.write_text(json.dumps({"A": {"TrainingNamespace": "x"}}))
    with pytest.raises(eks.UsageError, match="ImageUri missing"):
        ops_cluster.StackOutputs.from_file(path)


def _pod(name: str, index: int, phase: str, created: str) -> dict:
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": created,
            "annotations": {ops_cluster.INDEX_ANNOTATION: str(index)},
        },
        "spec": {"nodeName": "ip-10-0-0-1"},
        "status": {"phase": phase, "containerStatuses": [{"name": "trainer", "restartCount": 0}]},
    }


def test_follow_streams_rank0_again_after_replacement_and_reports_completion(fake, outputs):
    _healthy(fake)
    polls = {"n": 0}
    first = _pod("fsdp-smoke-0-aaaaa", 0, "Failed", "2026-01-01T00:00:00Z")
    second = _pod("fsdp-smoke-0-bbbbb", 0, "Running", "2026-01-01T00:05:00Z")

    def job(_req):
        polls["n"] += 1
        status = {"active": 1, "failed": 1}
        if polls["n"] >= 4:
            status = {
                "succeeded": 1,
                "failed": 1,
                "conditions": [{"type": "Complete", "status": "True"}],
            }
        return 200, {"spec": {"completions": 1}, "status": status}

    def pods(_req):
        return 200, {"items": [first] if polls["n"] < 3 else [first, second]}

    fake.route("GET", f"{JOB}/fsdp-smoke", job)
    fake.route("GET", f"/api/v1/namespaces/{NS}/pods", pods)
    fake.route("GET", f"/api/v1/namespaces/{NS}/pods/fsdp-smoke-0-aaaaa/log", (200, "step 1\n"))
    fake.route("GET", f"/api/v1/namespaces/{NS}/pods/fsdp-smoke-0-bbbbb/log", (200, "step 2\n"))

    code, text = _run(fake, outputs, "submit", "--overlay", "smoke", "--follow")
    assert code == 0
    assert text.index("step 1") < text.index("rank 0 restarted in a new pod") < text.index("step 2")
    assert "Complete" in text and "failed 1" in text
    logs = [r for r in fake.requests if r.path.endswith("/log")]
    assert all(r.query["follow"] == ["true"] and r.query["container"] == ["trainer"] for r in logs)
    pod_lists = [r for r in fake.requests if r.path.endswith("/pods")]
    assert pod_lists[0].query["labelSelector"] == ["batch.kubernetes.io/job-name=fsdp-smoke"]


def test_follow_returns_1_when_the_job_fails(fake, outputs):
    failed = {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]}
    fake.route("GET", f"{JOB}/fsdp-smoke", (200, {"spec": {"completions": 1}, "status": failed}))
    fake.route("GET", f"/api/v1/namespaces/{NS}/pods", (200, {"items": []}))
    code, text = _run(fake, outputs, "logs")
    assert code == 1
    assert "Failed (PodFailurePolicy)" in text


def test_status_shows_pending_reason(fake, outputs):
    pending = _pod("fsdp-smoke-0-x", 0, "Pending", "t")
    pending["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "message": "0/3 nodes: Insufficient nvidia.com/gpu",
        }
    ]
    fake.route(
        "GET", f"{JOB}/fsdp-smoke", (200, {"spec": {"completions": 1}, "status": {"active": 1}})
    )
    fake.route("GET", f"/api/v1/namespaces/{NS}/pods", (200, {"items": [pending]}))
    code, text = _run(fake, outputs, "status")
    assert code == 0
    assert "running" in text and "Insufficient nvidia.com/gpu" in text


def test_stop_deletes_job_and_service_never_the_data(fake, outputs):
    fake.route("DELETE", f"{JOB}/fsdp-smoke", (200, {"kind": "Status", "status": "Success"}))
    code, text = _run(fake, outputs, "stop")
    assert code == 0
    deletes = [r for r in fake.requests if r.method == "DELETE"]
    jobset = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/fsdp-smoke"
    assert [r.path for r in deletes] == [jobset, f"{JOB}/fsdp-smoke", f"{SVC}/fsdp-smoke"]
    assert all(r.query["propagationPolicy"] == ["Foreground"] for r in deletes)
    assert "deleted Job/fsdp-smoke (FSx data kept)" in text
    assert "Service/fsdp-smoke not found: nothing to stop" in text  # second stop is a no-op
    assert not any("persistentvolume" in r.path for r in fake.requests)

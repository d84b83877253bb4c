"""Tests of the preflight Job (manifests/preflight.py) and `python -m manifests.preflight`.

Run: .venv/bin/pytest tests/manifests/test_preflight.py

The Job is checked against the overlay's training Job (same pod template but the container's
command and arguments), its torchrun command against torchrun's own parser and the check's, and
the objects against the Kubernetes schema. The submit path talks to a small fake API server on
127.0.0.1 (as in test_eks_launcher.py): real kubernetes-client requests, canned answers. What
only a cluster shows: scheduling, NCCL over EFA, the bandwidth figures themselves.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes import client
from support import REPO_ROOT, subprocess_env

from manifests import preflight, render
from ops import cluster as ops_cluster
from training import allreduce_check, exits

NS = "training"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/eks-fsdp-resilient:abc123"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"


def _training_job(overlay: str) -> dict:
    objects = render.job_objects(overlay=overlay, namespace=NS, image=IMAGE)
    return next(o for o in objects if o["kind"] == "Job")


def _container(job: dict) -> dict:
    (c,) = [
        c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == render.CONTAINER
    ]
    return c


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_pod_template_is_the_training_one_but_the_command(overlay: str) -> None:
    train = _training_job(overlay)
    job = preflight.preflight_job(overlay=overlay, namespace=NS, image=IMAGE)
    assert job["metadata"]["name"] == f"{train['metadata']['name']}-preflight"
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] == preflight.ACTIVE_DEADLINE_SECONDS
    ours, theirs = copy.deepcopy(job), copy.deepcopy(train)
    for j in (ours, theirs):
        c = _container(j)
        c.pop("command"), c.pop("args")
        j["metadata"].pop("name")
        j["spec"].pop("backoffLimit")
        j["spec"].pop("activeDeadlineSeconds", None)
    assert ours == theirs  # nodes, GPUs, EFA, huge pages, volumes, env, init container
    # and the training Job itself is untouched by rendering its preflight
    assert train == _training_job(overlay)


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_command_is_a_valid_torchrun_command_with_the_training_rendezvous(overlay: str) -> None:
    from torch.distributed.run import get_args_parser

    size = render.size_of(overlay)
    extra = ["--min-busbw-gbs=150", "--iters=10"]
    job = preflight.preflight_job(overlay=overlay, namespace=NS, image=IMAGE, check_args=extra)
    c = _container(job)
    assert c["command"] == ["torchrun"]
    args = get_args_parser().parse_args(c["args"])
    assert args.module and args.training_script == preflight.CHECK_MODULE
    assert args.training_script_args == extra
    allreduce_check.parser().parse_args(args.training_script_args)
    assert (args.nnodes, args.nproc_per_node) == ("$(NNODES)", "$(NPROC_PER_NODE)")
    assert args.max_restarts == 0  # a failed check stays failed
    assert args.rdzv_endpoint == f"{render.RDZV_STORE}.{NS}:{render.RDZV_STORE_PORT}"
    assert (args.rdzv_id, args.local_addr) == ("$(JOB_UID)", "$(POD_IP)")
    assert "is_host=0" in args.rdzv_conf  # the shared store: no pod hosts the rendezvous
    # The same rendezvous flags as the training launcher's (ft_launcher or torchrun).
    keep = ("--nnodes=", "--nproc-per-node=", "--rdzv-", "--local-addr=")
    train_args = _container(_training_job(overlay))["args"]
    assert [a for a in c["args"] if a.startswith(keep)] == [
        a for a in train_args if a.startswith(keep)
    ]
    # Every $(VAR) is one the kubelet can expand from the container's environment.
    env = {e["name"] for e in c["env"]}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(c["args"]))) <= env
    values = {e["name"]: e.get("value") for e in c["env"]}
    assert (values["NNODES"], values["NPROC_PER_NODE"]) == (str(size.nodes), "8")


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_preflight_job_validates_strictly(overlay: str) -> None:
    job = preflight.preflight_job(overlay=overlay, namespace=NS, image=IMAGE)
    kubernetes_validate.validate(job, render.KUBERNETES_VERSION, strict=True)


def test_a_bad_check_flag_fails_at_render_time() -> None:
    with pytest.raises(SystemExit):
        preflight.preflight_job(overlay="2node", namespace=NS, image=IMAGE, check_args=["--x"])


def test_dry_run_prints_the_job(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "none.json")
    out = io.StringIO()
    code = preflight.run(["--overlay", "2node", "--dry-run", "--outputs", missing], out=out)
    assert code == exits.OK
    job = yaml.safe_load(out.getvalue())
    assert job == preflight.preflight_job(
        overlay="2node", namespace=render.DEFAULT_NAMESPACE, image=render.PLACEHOLDER_IMAGE
    )
    out = io.StringIO()
    argv = ["--overlay=16node", "--dry-run", "--namespace=ns", "--image=img", "--iters=7"]
    assert preflight.run(argv, out=out) == exits.OK
    job = yaml.safe_load(out.getvalue())
    assert job["metadata"] == {
        **job["metadata"],
        "name": "fsdp-16node-preflight",
        "namespace": "ns",
    }
    assert _container(job)["args"][-1] == "--iters=7"


def test_cli_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert preflight.main(["--overlay", "huge", "--dry-run"]) == exits.USAGE
    assert "smoke, 2node, 16node" in capsys.readouterr().err
    assert preflight.main(["--overlay", "2node", "--dry-run", "--bogus"]) == exits.USAGE
    assert "--bogus" in capsys.readouterr().err
    missing = tmp_path / "none.json"
    assert preflight.main(["--overlay", "2node", "--outputs", str(missing)]) == exits.USAGE
    assert "make deploy" in capsys.readouterr().err


# --- submitting, against a fake API server --------------------------------------------------


class FakeApi:
    """(method, path) -> reply; unknown routes answer 404 like the API server."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Callable[[dict | None], tuple[int, object]]] = {}
        self.calls: list[tuple[str, str, dict | None]] = []
        self.url = ""

    def route(self, method: str, path: str, reply: object) -> None:
        self.routes[(method, path)] = reply if callable(reply) else (lambda _b, v=reply: v)

    def handle(self, method: str, path: str, body: dict | None) -> tuple[int, object]:
        self.calls.append((method, path, body))
        fn = self.routes.get((method, path))
        return fn(body) if fn else (404, {"kind": "Status", "reason": "NotFound", "code": 404})


@pytest.fixture
def api():
    fake = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, body = fake.handle(
                self.command, urlsplit(self.path).path, json.loads(raw) if raw else None
            )
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_DELETE = _serve

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    fake.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield fake
    httpd.shutdown()
    httpd.server_close()


def _cluster(url: str) -> ops_cluster.Cluster:
    cfg = client.Configuration(host=url)
    cfg.retries = 0
    return ops_cluster.Cluster.from_api_client(client.ApiClient(cfg))


def _stack(api: FakeApi) -> None:
    api.route("GET", f"/api/v1/namespaces/{NS}", (200, {"metadata": {"name": NS}}))
    pvc = f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{render.PVC_NAME}"
    api.route("GET", pvc, (200, {"metadata": {"name": render.PVC_NAME}}))


def _finished_preflight(api: FakeApi, *, log: str, condition: str) -> None:
    name = "fsdp-2node-preflight"
    applied: list[dict] = []

    def patch(body: dict | None) -> tuple[int, object]:
        applied.append(body or {})
        return 200, body

    def read(_body: dict | None) -> tuple[int, object]:
        if not applied:
            return 404, {"kind": "Status", "code": 404}
        status = {"conditions": [{"type": condition, "status": "True"}]}
        return 200, {"spec": {"completions": 2}, "status": status}

    pod = {
        "metadata": {
            "name": f"{name}-0-abcde",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "annotations": {ops_cluster.INDEX_ANNOTATION: "0"},
        },
        "spec": {"nodeName": "ip-10-0-0-1"},
        "status": {"phase": "Succeeded" if condition == "Complete" else "Failed"},
    }
    api.route("PATCH", f"{JOBS}/{name}", patch)
    api.route("GET", f"{JOBS}/{name}", read)
    api.route("GET", f"/api/v1/namespaces/{NS}/pods", (200, {"items": [pod]}))
    api.route("GET", f"/api/v1/namespaces/{NS}/pods/{name}-0-abcde/log", (200, log))


def _submit(api: FakeApi, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    argv = ("--overlay=2node", f"--namespace={NS}", f"--image={IMAGE}", *argv)
    code = preflight.run(list(argv), out=out, cluster=_cluster(api.url), sleep=lambda _s: None)
    return code, out.getvalue()


def _log(report: dict) -> str:
    return "table...\n" + allreduce_check.REPORT_PREFIX + json.dumps(report) + "\n"


PASS = {
    "ok": True,
    "exit_code": 0,
    "slow_nodes": [],
    "slow_pairs": [],
    "broken": [],
    "problems": [],
}


def test_submit_applies_the_job_follows_rank0_and_passes(api: FakeApi) -> None:
    _stack(api)
    _finished_preflight(api, log=_log(PASS), condition="Complete")
    code, text = _submit(api, "--iters=5")
    assert code == exits.OK, text
    assert "preflight PASSED" in text and "table..." in text
    (patch,) = [c for c in api.calls if c[0] == "PATCH"]
    assert patch[2] == preflight.preflight_job(
        overlay="2node", namespace=NS, image=IMAGE, check_args=["--iters=5"]
    )


def test_submit_names_the_slow_node_and_exits_environment(api: FakeApi) -> None:
    _stack(api)
    slow = {
        **PASS,
        "ok": False,
        "exit_code": exits.ENVIRONMENT,
        "slow_nodes": ["fsdp-2node-preflight-1/node1"],
    }
    _finished_preflight(api, log=_log(slow), condition="Failed")
    code, text = _submit(api)
    assert code == exits.ENVIRONMENT
    assert "preflight FAILED: slow node fsdp-2node-preflight-1/node1" in text


def test_submit_without_a_report_fails(api: FakeApi) -> None:
    _stack(api)
    _finished_preflight(api, log="NCCL error\n", condition="Failed")
    code, text = _submit(api)
    assert code == exits.FAILED and "no report from rank 0" in text


def test_submit_refuses_while_the_training_job_holds_the_nodes(api: FakeApi) -> None:
    _stack(api)
    running = {"spec": {"completions": 2}, "status": {"active": 2}}
    api.route("GET", f"{JOBS}/fsdp-2node", (200, running))
    api.route("GET", f"/api/v1/namespaces/{NS}/pods", (200, {"items": []}))
    with pytest.raises(ops_cluster.UsageError, match="make eks-stop OVERLAY=2node"):
        _submit(api)
    assert not [c for c in api.calls if c[0] == "PATCH"]


def test_submit_replaces_an_earlier_preflight(api: FakeApi) -> None:
    _stack(api)
    _finished_preflight(api, log=_log(PASS), condition="Complete")
    api.route("DELETE", f"{JOBS}/fsdp-2node-preflight", (200, {}))
    code, text = _submit(api)
    assert code == exits.OK and "deleted the previous fsdp-2node-preflight" in text
    methods = [m for m, p, _ in api.calls if p == f"{JOBS}/fsdp-2node-preflight"]
    assert methods.index("DELETE") < methods.index("PATCH")


def test_unreachable_cluster_says_so() -> None:
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ops_cluster.UsageError, match="cannot reach the cluster"):
        preflight.run(
            ["--overlay=2node", f"--namespace={NS}", f"--image={IMAGE}"],
            out=io.StringIO(),
            cluster=_cluster(f"http://127.0.0.1:{port}"),
        )


def test_no_kubeconfig_says_how_to_get_one(tmp_path: Path, capsys) -> None:
    argv = ["--overlay=2node", f"--namespace={NS}", f"--image={IMAGE}"]
    assert preflight.main([*argv, "--kubeconfig", str(tmp_path / "none")]) == exits.USAGE
    assert "no usable kubeconfig" in capsys.readouterr().err


def test_make_eks_preflight_runs_the_cli() -> None:
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "eks-preflight", "OVERLAY=2node", "ARGS=--dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines()[-1].endswith("-m manifests.preflight --overlay 2node --dry-run")


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_pod_command_runs_two_nodes_through_the_shared_store(tmp_path: Path) -> None:
    """The Job's exact torchrun command, two "pods" on CPU: the kubelet's $(VAR) expansion,
    the rendezvous at an external store (is_host=0), node ranks from torchrun, the report."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = subprocess.Popen(
        [sys.executable, "-m", "training.launch.rdzv_store", f"--port={port}"],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    check = ["--sizes=64K", "--pair-bytes=64K", "--iters=2", "--warmup=1", "--min-fraction=0"]
    job = preflight.preflight_job(overlay="2node", namespace=NS, image=IMAGE, check_args=check)
    c = _container(job)
    env = {"NNODES": "2", "NPROC_PER_NODE": "2", "JOB_UID": "uid-1", "POD_IP": "127.0.0.1"}

    def expand(arg: str) -> str:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
        return f"--rdzv-endpoint=127.0.0.1:{port}" if arg.startswith("--rdzv-endpoint=") else arg

    command = [str(Path(sys.executable).parent / c["command"][0]), *map(expand, c["args"])]
    pods = []
    try:
        for _ in range(2):
            pods.append(
                subprocess.Popen(
                    command,
                    cwd=REPO_ROOT,
                    env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [p.communicate(timeout=150)[0] for p in pods]
    finally:
        for p in pods:  # each "pod" is its own session: torchrun and its workers
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        store.kill()
        store.wait()
    assert [p.returncode for p in pods] == [0, 0], outputs
    reports = [preflight.read_report(o) for o in outputs]
    assert all(r is not None for r in reports), outputs
    assert reports[0]["world_size"] == 4 and len(reports[0]["nodes"]) == 2
    assert [m["phase"] for m in reports[0]["measurements"]] == ["world", "node", "node", "pair"]
    assert preflight.verdict(report=reports[0], job_code=0)[0] == exits.OK


def test_verdict_names_what_failed() -> None:
    broken = {**PASS, "ok": False, "exit_code": exits.FAILED, "broken": ["pair a + b: timeout"]}
    assert preflight.verdict(report=broken, job_code=1) == (
        exits.FAILED,
        "preflight FAILED: broken: pair a + b: timeout",
    )
    pair = {**PASS, "ok": False, "exit_code": exits.ENVIRONMENT, "slow_pairs": [["a", "b"]]}
    assert preflight.verdict(report=pair, job_code=1) == (
        exits.ENVIRONMENT,
        "preflight FAILED: slow pair a + b",
    )
    # A passing report from a Job that still failed (a pod lost after the check) is no pass.
    code, line = preflight.verdict(report=PASS, job_code=1)
    assert code == exits.FAILED and "the Job did not" in line

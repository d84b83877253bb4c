"""The cloud under the emulated nodes, for the fencer's pod test: an EC2 API stand-in that speaks
the real API (moto in server mode), one instance per emulated node, and the cloud's side of a
termination: once EC2 reports an instance terminated, every process of its node dies.

Emulated because no AWS account can be used here. The fencer's side is real: its own EC2 calls
(infra/fencer/ec2.py: SigV4-signed Query API requests, awscrt) go over HTTP to moto; its
Kubernetes side reads and patches Node objects that `NodeApi` builds from the emulated control
plane (the shapes of the API's JSON: ``status.conditions[Ready]``, ``spec.providerID``,
``spec.taints``, ``spec.unschedulable``, the product's unfit label) and lists the Job's running
pods as the API server answers the fencer's field selector. Moto cannot share the project's
venv (botocore pins python-dateutil<3, kubernetes needs >=3): it runs from its own,
``.venv-moto`` (``make moto-venv``). The fencer
reaches moto through `ec2_front`, where the hypervisor's side of a termination happens.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

from infra.fencer.ec2 import Ec2
from ops.cordon import UNFIT_LABEL
from podsim.control_plane import ControlPlane

REPO = Path(__file__).resolve().parents[1]
MOTO_SERVER = REPO / ".venv-moto" / "bin" / "moto_server"
CLUSTER = "fsdp-emulated"
NODEGROUP = "gpu"
ZONE = "us-east-2a"
NAMESPACE = "training"
"""The emulated Job's namespace (podsim/kube_api.py's ServiceAccount namespace file)."""
SELECTOR = f"eks.amazonaws.com/nodegroup={NODEGROUP}"
"""The label EKS managed node groups put on their nodes (EKS User Guide, "Managed node
groups": ``eks.amazonaws.com/nodegroup``)."""


def moto_reason() -> str | None:
    if MOTO_SERVER.exists():
        return None
    return f"{MOTO_SERVER} missing: the EC2 stand-in (make moto-venv)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(root: Path) -> Iterator[str]:
    """moto in server mode on 127.0.0.1; its endpoint URL. Credentials: moto accepts any."""
    port = _free_port()
    log = (root / "moto.log").open("ab")
    process = subprocess.Popen(
        [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"moto did not start: see {root / 'moto.log'}") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


@contextlib.contextmanager
def aws_environment(endpoint: str) -> Iterator[None]:
    """What the fencer's SDK-style configuration reads: region, the stand-in's endpoint
    (``AWS_ENDPOINT_URL_EC2``) and static credentials (moto checks none)."""
    values = {
        "AWS_REGION": "us-east-2",
        "AWS_ENDPOINT_URL_EC2": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def ec2_front(moto_url: str, *, on_terminate: Callable[[list[str]], None]) -> Iterator[str]:
    """The EC2 endpoint the fencer is given: every request goes on to moto unchanged, but a
    TerminateInstances first calls `on_terminate(instance ids)`, the hypervisor stopping those
    instances. So the instances are gone before EC2 can report them ``terminated`` (moto moves
    ``shutting-down`` to ``terminated`` at the next DescribeInstances, which may be the
    fencer's own), as on EC2, where ``terminated`` is reported only once the instance has
    stopped (EC2 User Guide, "Instance state changes")."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            form = urllib.parse.parse_qs(body.decode())
            if form.get("Action") == ["TerminateInstances"]:
                on_terminate([v[0] for k, v in form.items() if k.startswith("InstanceId.")])
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
            }
            request = urllib.request.Request(
                moto_url + self.path, data=body, method="POST", headers=headers
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    code, data = response.status, response.read()
            except urllib.error.HTTPError as err:
                code, data = err.code, err.read()
            self.send_response(code)
            self.send_header("Content-Type", "text/xml")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Cloud:
    """One EC2 instance per emulated node (launched as the node group would have, with its
    tags), and the hypervisor's side of TerminateInstances (`terminated`, called by
    `ec2_front`): every process of the instance's node dies (EC2 User Guide, "Terminate Amazon
    EC2 instances")."""

    plane: ControlPlane
    ec2: Ec2
    instances: dict[str, str] = field(default_factory=dict)
    """Node name -> instance id."""
    killed: dict[str, float] = field(default_factory=dict)
    """Node name -> time.time() its processes were killed by the termination."""

    def instance(self, node: str) -> str:
        if node not in self.instances:
            tags = {
                "eks:cluster-name": CLUSTER,
                "eks:nodegroup-name": NODEGROUP,
                "kubernetes.io/cluster/" + CLUSTER: "owned",
            }
            params = {
                "ImageId": "ami-12c6146b",
                "MinCount": "1",
                "MaxCount": "1",
                "InstanceType": "p5.48xlarge",
                "TagSpecification.1.ResourceType": "instance",
            }
            for i, (k, v) in enumerate(tags.items(), start=1):
                params[f"TagSpecification.1.Tag.{i}.Key"] = k
                params[f"TagSpecification.1.Tag.{i}.Value"] = v
            root = self.ec2.call("RunInstances", params)
            self.instances[node] = root.findtext(".//{*}instancesSet/{*}item/{*}instanceId")
        return self.instances[node]

    def terminated(self, instance_ids: list[str]) -> None:
        for node, iid in self.instances.items():
            if iid in instance_ids and node not in self.killed:
                (emulated,) = [n for n in self.plane.cluster.nodes if n.name == node]
                self.plane.cluster.kill_netns(emulated.netns)
                self.killed[node] = time.time()
                self.plane._event(f"EC2: {iid} terminating: {node}'s processes killed")


@dataclass
class NodeApi:
    """``list_node`` and ``patch_node`` of ``kubernetes.client.CoreV1Api`` over the emulated
    control plane's nodes, in the API's JSON shapes. Only the out-of-service taint is accepted
    as a patch, the one write the fencer's RBAC exists for."""

    plane: ControlPlane
    cloud: Cloud
    patches: list[tuple[str, dict]] = field(default_factory=list)

    def list_node(self, *, label_selector: str, **_: object) -> SimpleNamespace:
        assert label_selector == SELECTOR, label_selector
        items = []
        for name, ready, since, taints in self.plane.node_states():
            labels = {SELECTOR.split("=")[0]: NODEGROUP}
            if name in self.plane.unfit:
                labels[UNFIT_LABEL] = self.plane.unfit[name]
            items.append(
                {
                    "metadata": {"name": name, "labels": labels},
                    "spec": {
                        "providerID": f"aws:///{ZONE}/{self.cloud.instance(name)}",
                        "taints": taints,
                        "unschedulable": name in self.plane.cordoned,
                    },
                    "status": {
                        "conditions": [
                            {"type": "Ready", "status": ready, "lastTransitionTime": since}
                        ]
                    },
                }
            )
        return SimpleNamespace(items=items)

    def list_namespaced_pod(
        self, namespace: str, *, field_selector: str, **_: object
    ) -> SimpleNamespace:
        """The Job's pods that still run, as the API server answers the fencer's field selector
        (``status.phase!=Succeeded,status.phase!=Failed``): every Job pod is in `NAMESPACE`."""
        assert field_selector == "status.phase!=Succeeded,status.phase!=Failed", field_selector
        if namespace != NAMESPACE:
            return SimpleNamespace(items=[])
        items = [
            {"metadata": {"name": pod}, "spec": {"nodeName": node}, "status": {"phase": "Running"}}
            for pod, node in self.plane.running_pods()
        ]
        return SimpleNamespace(items=items)

    def patch_node(self, name: str, body: dict, **_: object) -> dict:
        self.patches.append((name, body))
        keys = {t["key"] for t in body["spec"]["taints"]}
        assert "node.kubernetes.io/out-of-service" in keys, body
        self.plane.out_of_service(name)
        return body

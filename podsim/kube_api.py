"""The smallest fake of the Kubernetes API that a trainer pod calls: ``PATCH /api/v1/nodes/NAME``
(the cordon, ops/cordon.py) and ``GET /api/v1/namespaces/NS/pods?labelSelector=...`` (the
Ready hot spares, ``ops.cordon.ready_spares``), served over HTTPS on the emulated
cluster's bridge.

Emulated because no API server can run here (design notes). The pod side is real: the
``kubernetes`` client with its in-cluster configuration, reading what the kubelet gives a pod
whose spec mounts a ServiceAccount token (kubernetes.io, "Accessing the Kubernetes API from a
Pod"): ``KUBERNETES_SERVICE_HOST``/``_PORT`` and ``token``, ``ca.crt`` and ``namespace`` under
``/var/run/secrets/kubernetes.io/serviceaccount`` (cluster.start_pod mounts them). This fake
checks the bearer token and hands the node name and the unfit reason to `on_cordon` (the
emulated scheduler then
skips the node, as the NodeUnschedulable filter does); it answers any other request 404. It
does not emulate RBAC or the admission policy (manifests/render.py, node_cordon_objects).
"""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ops.cordon import REASONS, UNFIT_LABEL, cordon_patch

TOKEN = "emulated-service-account-token"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class ApiEndpoint:
    host: str
    port: int
    secrets: Path
    """What the kubelet mounts at SERVICE_ACCOUNT_DIR."""

    def pod_env(self) -> dict[str, str]:
        return {"KUBERNETES_SERVICE_HOST": self.host, "KUBERNETES_SERVICE_PORT": str(self.port)}


def _certificate(directory: Path, *, ip: str) -> tuple[Path, Path]:
    """A self-signed certificate for `ip` (the client verifies the server against ca.crt)."""
    cert, key = directory / "ca.crt", directory / "server.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=kubernetes", "-addext", f"subjectAltName=IP:{ip}"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@contextmanager
def serve(
    root: Path,
    *,
    ip: str,
    on_cordon: Callable[[str, str], None],
    spare_nodes: Callable[[], list[str]] = list,
    spare_labels: dict[str, str] | None = None,
) -> Iterator[ApiEndpoint]:
    """The fake API server on `ip` (an address of this machine the pods reach). A pod list
    answers one Ready pod per node in `spare_nodes()` when the request's label selector
    (equality terms, kubernetes.io "Labels and Selectors") matches `spare_labels`, else none."""
    secrets = root / "serviceaccount"
    secrets.mkdir(parents=True, exist_ok=True)
    cert, key = _certificate(root, ip=ip)
    (secrets / "ca.crt").write_bytes(cert.read_bytes())
    (secrets / "token").write_text(TOKEN)
    (secrets / "namespace").write_text("training")

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            prefix = "/api/v1/nodes/"
            # The scheme is case-insensitive (RFC 7235 2.1; the API server's bearer-token
            # authenticator compares it with strings.EqualFold: k8s.io/apiserver
            # pkg/authentication/request/bearertoken); the Python client sends "bearer".
            scheme, _, token = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token.strip() != TOKEN:
                return self._reply(401, {"kind": "Status", "code": 401})
            # The trainer's one node write (ops.cordon.cordon_patch: the cordon and the
            # product's unfit label); the admission policy admits no other body either.
            if not self.path.startswith(prefix) or body not in [cordon_patch(r) for r in REASONS]:
                return self._reply(404, {"kind": "Status", "code": 404})
            name = self.path[len(prefix) :].split("?")[0]
            on_cordon(name, body["metadata"]["labels"][UNFIT_LABEL])
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": body["metadata"]["labels"]},
                "spec": {"unschedulable": True},
            }
            self._reply(200, node)

        def do_GET(self) -> None:
            scheme, _, token = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token.strip() != TOKEN:
                return self._reply(401, {"kind": "Status", "code": 401})
            url = urllib.parse.urlsplit(self.path)
            if not (url.path.startswith("/api/v1/namespaces/") and url.path.endswith("/pods")):
                return self._reply(404, {"kind": "Status", "code": 404})
            selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
            terms = dict(term.split("=", 1) for term in selector.split(",") if term)
            labels = spare_labels or {}
            matches = all(labels.get(k) == v for k, v in terms.items())
            items = [
                {
                    "metadata": {"name": f"fsdp-spares-{node}", "labels": labels},
                    "spec": {"nodeName": node, "containers": [{"name": "spare"}]},
                    "status": {"conditions": [{"type": "Ready", "status": "True"}]},
                }
                for node in (spare_nodes() if matches else [])
            ]
            self._reply(
                200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
            )

        def _reply(self, code: int, doc: dict) -> None:
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((ip, 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ApiEndpoint(host=ip, port=server.server_address[1], secrets=secrets)
    finally:
        server.shutdown()
        server.server_close()

"""Everything the stack installs carries an explicit version: EKS add-ons
(infra/addon_versions.py), Helm charts (infra/addons.py) and the images of the Kubernetes
objects it applies. A new add-on, chart or image without one fails here.

`python -m infra.addon_versions check` runs against a local stand-in of EKS DescribeAddonVersions
(EKS API reference: `GET /addons/supported-versions?addonName=&kubernetesVersion=`, answer
`{"addons": [{"addonName", "addonVersions": [{"addonVersion", ...}]}], "nextToken"}`); EKS itself
cannot be reached here, so whether EKS offers each pinned version is only known when the check
runs with credentials.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from infra import addon_versions, addons, replacements

REPO_ROOT = Path(__file__).resolve().parents[2]


def _resources(template: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [r["Properties"] for r in template["Resources"].values() if r["Type"] == kind]


@pytest.mark.parametrize("which", ["default_template", "variant_template"])
def test_every_eks_addon_is_pinned(which: str, request: pytest.FixtureRequest) -> None:
    template = request.getfixturevalue(which)
    installed = {
        p["AddonName"]: p.get("AddonVersion") for p in _resources(template, "AWS::EKS::Addon")
    }
    assert installed == dict(addon_versions.EKS_ADDON_VERSIONS)  # each pinned, none stale


def test_every_chart_is_pinned(default_template: dict[str, Any]) -> None:
    charts = {
        p["Chart"]: p.get("Version")
        for p in _resources(default_template, "Custom::AWSCDK-EKS-HelmChart")
    }
    assert charts == {c.name: c.version for c in addons.CHARTS}
    assert all(v and v != "latest" for v in charts.values())


def test_every_image_the_stack_applies_has_a_tag(default_template: dict[str, Any]) -> None:
    images = []
    for props in _resources(default_template, replacements.MANIFEST_TYPE):
        text = json.dumps(replacements._flatten(props["Manifest"], frozenset()))
        for obj in json.loads(json.loads(text)):
            spec = obj.get("spec", {}).get("template", {}).get("spec", {})
            images += [c["image"] for c in spec.get("containers", [])]
    assert images  # the rendezvous store
    for image in images:
        name = image.rsplit("/", 1)[-1]
        assert ("@sha256:" in image or ":" in name) and not name.endswith(":latest"), image


def test_the_pins_are_for_the_stacks_kubernetes_version() -> None:
    context = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
    assert context["kubernetesVersion"] == addon_versions.KUBERNETES_VERSION


def test_an_unpinned_addon_is_named() -> None:
    with pytest.raises(KeyError, match="coredns: no pinned version"):
        addon_versions.addon_version("coredns")


def _eks_stand_in(offered: dict[str, list[str]]) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            args = dict(urllib.parse.parse_qsl(query))
            ok = (
                path == "/addons/supported-versions"
                and args.get("kubernetesVersion") == addon_versions.KUBERNETES_VERSION
                and "/eks/aws4_request" in self.headers.get("Authorization", "")
            )
            name = args.get("addonName", "")
            versions = offered.get(name, [])
            # Two pages when there is more than one version (nextToken paging).
            page = versions[1:] if args.get("nextToken") else versions[:1]
            body = {
                "addons": [
                    {
                        "addonName": name,
                        "addonVersions": [{"addonVersion": v} for v in page],
                    }
                ]
            }
            if not args.get("nextToken") and len(versions) > 1:
                body["nextToken"] = "page2"
            data = json.dumps(body if ok else {"message": "bad request"}).encode()
            self.send_response(200 if ok else 400)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSTANDIN")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "standin-secret")
    monkeypatch.setenv("HOME", str(tmp_path))


@pytest.mark.usefixtures("aws_env")
def test_the_check_passes_when_eks_offers_every_pin(capsys: pytest.CaptureFixture) -> None:
    offered = {n: ["v0.0.1-eksbuild.1", v] for n, v in addon_versions.EKS_ADDON_VERSIONS.items()}
    server = _eks_stand_in(offered)
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        code = addon_versions.main(["check", "--region", "us-east-2", "--endpoint", endpoint])
    finally:
        server.shutdown()
    assert code == 0
    assert capsys.readouterr().out.count("ok ") == len(addon_versions.EKS_ADDON_VERSIONS)


@pytest.mark.usefixtures("aws_env")
def test_the_check_names_a_pin_eks_does_not_offer(capsys: pytest.CaptureFixture) -> None:
    offered = {n: [v] for n, v in addon_versions.EKS_ADDON_VERSIONS.items()}
    offered["vpc-cni"] = ["v9.9.9-eksbuild.1"]
    server = _eks_stand_in(offered)
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        code = addon_versions.main(["check", "--region", "us-east-2", "--endpoint", endpoint])
    finally:
        server.shutdown()
    out = capsys.readouterr().out
    assert code == 1
    (bad,) = [line for line in out.splitlines() if line.startswith("not offered")]
    assert "vpc-cni" in bad and "--addon-name vpc-cni" in bad

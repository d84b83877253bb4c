"""An emulated CloudFormation endpoint on localhost for the deployed-stack reads.

The product's own code (infra/deployed.py) runs the real AWS CLI, pointed here with
`AWS_ENDPOINT_URL_CLOUDFORMATION` (botocore's service-specific endpoint variable) and dummy
credentials: nothing reaches AWS. Only the three read actions the product calls exist, with the
query protocol's form-encoded requests and XML responses as the CloudFormation API reference
gives them (https://docs.aws.amazon.com/AWSCloudFormation/latest/APIReference/ : DescribeStacks,
GetTemplate, ListStackResources (paged), DescribeStackResources; errors: "Common Errors",
ValidationError "Stack with id NAME does not exist", HTTP 400), and FSx's DescribeFileSystems
(AWS JSON 1.1, the file systems a test puts), STS GetCallerIdentity and EKS
DescribeAddonVersions (REST JSON). What it cannot show: IAM, throttling, real
stack events.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

NS = "http://cloudformation.amazonaws.com/doc/2010-05-15/"


@dataclass
class EmulatedCloudFormation:
    """Stacks by name: template, status, physical ids; `calls` records each action."""

    stacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    url: str = ""
    file_systems: list[dict[str, Any]] = field(default_factory=list)
    """FSx DescribeFileSystems' answer (FSx API reference: FileSystemId, Tags)."""
    page_size: int = 100
    account: str = "123456789012"
    """STS GetCallerIdentity's account."""
    addon_versions: dict[str, list[str]] | None = None
    """EKS DescribeAddonVersions: name -> versions offered (None: exactly the pins)."""
    """ListStackResources' page size (the API returns at most 100 per call, then NextToken)."""

    def put(
        self,
        name: str,
        template: Mapping[str, Any],
        *,
        status: str = "UPDATE_COMPLETE",
        physical_ids: Mapping[str, str] | None = None,
        outputs: Mapping[str, str] | None = None,
    ) -> None:
        self.stacks[name] = {
            "template": json.loads(json.dumps(template)),
            "status": status,
            "physical_ids": dict(physical_ids or {}),
            "outputs": dict(outputs or {}),
        }

    def env(self) -> dict[str, str]:
        """Environment for the AWS CLI: this endpoint, dummy credentials, no other config."""
        return {
            "AWS_ENDPOINT_URL_CLOUDFORMATION": self.url,
            "AWS_ENDPOINT_URL_FSX": self.url,
            "AWS_ENDPOINT_URL_STS": self.url,
            "AWS_ENDPOINT_URL_EKS": self.url,
            "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
            "AWS_SECRET_ACCESS_KEY": "emulated",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true",
            # Anything else the CLI might call lands on a closed local port, never on AWS.
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        }


def no_credentials_env() -> dict[str, str]:
    """A clone with no AWS credentials (and every endpoint local, should one be called)."""
    return {
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    }


def offline_environ(base: Mapping[str, str]) -> dict[str, str]:
    """`base` without any AWS_* variable (keys, profile, SSO, container or web-identity
    credentials, endpoints), plus no_credentials_env(): what a test's app.py, CDK CLI or AWS CLI
    subprocess runs with unless an emulator gives its own endpoint and dummy keys."""
    return {k: v for k, v in base.items() if not k.startswith("AWS_")} | no_credentials_env()


def _member_list(items: list[str]) -> str:
    return "".join(f"<member>{item}</member>" for item in items)


class _Handler(BaseHTTPRequestHandler):
    cfn: EmulatedCloudFormation

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _fsx(self, target: str) -> None:
        # FSx speaks AWS JSON 1.1: X-Amz-Target AWSSimbaAPIService_v20180301.<Action>.
        action = target.rsplit(".", 1)[-1]
        self.cfn.calls.append((action, ""))
        if action != "DescribeFileSystems":
            self._send_json(400, {"__type": "BadRequest", "message": action})
            return
        self._send_json(200, {"FileSystems": self.cfn.file_systems})

    def do_GET(self) -> None:
        # EKS DescribeAddonVersions: GET /addons/supported-versions?addonName=&kubernetesVersion=
        # (REST JSON; EKS API reference).
        from infra.addon_versions import EKS_ADDON_VERSIONS

        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        self.cfn.calls.append(("DescribeAddonVersions", query.get("addonName", "")))
        if url.path != "/addons/supported-versions":
            self._send_json(404, {"message": url.path})
            return
        offered = self.cfn.addon_versions
        if offered is None:
            offered = {name: [version] for name, version in EKS_ADDON_VERSIONS.items()}
        name = query.get("addonName", "")
        versions = [{"addonVersion": v} for v in offered.get(name, [])]
        self._send_json(200, {"addons": [{"addonName": name, "addonVersions": versions}]})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length).decode()
        target = self.headers.get("X-Amz-Target", "")
        if target.startswith("AWSSimbaAPIService"):
            self._fsx(target)
            return
        form = {k: v[0] for k, v in parse_qs(raw).items()}
        if form.get("Action") == "GetCallerIdentity":  # STS, the query protocol too
            self.cfn.calls.append(("GetCallerIdentity", ""))
            self._send(
                200,
                '<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
                f"<GetCallerIdentityResult><Arn>arn:aws:iam::{self.cfn.account}:user/emulated"
                f"</Arn><UserId>AIDAEMULATED</UserId><Account>{self.cfn.account}</Account>"
                "</GetCallerIdentityResult><ResponseMetadata><RequestId>emulated</RequestId>"
                "</ResponseMetadata></GetCallerIdentityResponse>",
            )
            return
        action, name = form.get("Action", ""), form.get("StackName", "")
        self.cfn.calls.append((action, name))
        stack = self.cfn.stacks.get(name)
        if stack is None:
            self._send(
                400,
                f'<ErrorResponse xmlns="{NS}"><Error><Type>Sender</Type>'
                f"<Code>ValidationError</Code><Message>Stack with id {escape(name)} does not "
                "exist</Message></Error><RequestId>emulated</RequestId></ErrorResponse>",
            )
            return
        if action == "DescribeStacks":
            result = (
                f"<Stacks><member><StackName>{escape(name)}</StackName>"
                f"<StackId>arn:aws:cloudformation:us-east-2:123456789012:stack/{name}/1</StackId>"
                "<CreationTime>2026-01-01T00:00:00Z</CreationTime>"
                f"<StackStatus>{stack['status']}</StackStatus><Outputs>"
                + "".join(
                    f"<member><OutputKey>{escape(k)}</OutputKey>"
                    f"<OutputValue>{escape(v)}</OutputValue></member>"
                    for k, v in stack["outputs"].items()
                )
                + "</Outputs></member></Stacks>"
            )
        elif action == "GetTemplate":
            body = escape(json.dumps(stack["template"]))
            result = (
                f"<TemplateBody>{body}</TemplateBody><StagesAvailable>"
                f"{_member_list(['Original', 'Processed'])}</StagesAvailable>"
            )
        elif action == "ListStackResources":
            # Paged: at most page_size summaries, then NextToken (the CLI follows it).
            items = list(stack["template"].get("Resources", {}).items())
            start = int(form.get("NextToken") or 0)
            page = items[start : start + self.cfn.page_size]
            members = "".join(
                f"<member><LogicalResourceId>{lid}</LogicalResourceId>"
                f"<PhysicalResourceId>{escape(stack['physical_ids'].get(lid, lid.lower()))}"
                f"</PhysicalResourceId><ResourceType>{r['Type']}</ResourceType>"
                "<LastUpdatedTimestamp>2026-01-01T00:00:00Z</LastUpdatedTimestamp>"
                "<ResourceStatus>UPDATE_COMPLETE</ResourceStatus></member>"
                for lid, r in page
            )
            after = start + len(page)
            token = f"<NextToken>{after}</NextToken>" if after < len(items) else ""
            result = f"<StackResourceSummaries>{members}</StackResourceSummaries>{token}"
        elif action == "DescribeStackResources":
            members = "".join(
                f"<member><StackName>{escape(name)}</StackName>"
                f"<LogicalResourceId>{lid}</LogicalResourceId>"
                f"<PhysicalResourceId>{escape(stack['physical_ids'].get(lid, lid.lower()))}"
                f"</PhysicalResourceId><ResourceType>{r['Type']}</ResourceType>"
                "<Timestamp>2026-01-01T00:00:00Z</Timestamp>"
                "<ResourceStatus>UPDATE_COMPLETE</ResourceStatus></member>"
                for lid, r in stack["template"].get("Resources", {}).items()
            )
            result = f"<StackResources>{members}</StackResources>"
        else:
            self._send(
                400,
                f'<ErrorResponse xmlns="{NS}"><Error><Code>InvalidAction</Code>'
                f"<Message>{escape(action)}</Message></Error></ErrorResponse>",
            )
            return
        self._send(
            200,
            f'<{action}Response xmlns="{NS}"><{action}Result>{result}</{action}Result>'
            f"<ResponseMetadata><RequestId>emulated</RequestId></ResponseMetadata>"
            f"</{action}Response>",
        )


@contextmanager
def emulated_cloudformation() -> Iterator[EmulatedCloudFormation]:
    cfn = EmulatedCloudFormation()
    handler = type("Handler", (_Handler,), {"cfn": cfn})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    cfn.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield cfn
    finally:
        server.shutdown()
        server.server_close()

"""The fencer's two EC2 calls, over EC2's Query API, signed by awscrt (infra/aws_call.py).

``TerminateInstances`` and ``DescribeInstances`` (EC2 API Reference; Query requests: a
form-encoded POST with ``Action`` and ``Version``, an XML answer in the
``http://ec2.amazonaws.com/doc/2016-11-15/`` namespace; elements are matched in any namespace,
``{*}``, since moto writes it without the final slash). The endpoint is the regional one, or
``AWS_ENDPOINT_URL_EC2`` / ``AWS_ENDPOINT_URL`` when set (the AWS SDKs' service-specific
endpoint variables, "Service-specific endpoints" in the AWS SDKs and Tools reference guide):
the tests point it at an EC2 stand-in (moto in server mode). Credentials: awscrt's default
chain, which reads EKS Pod Identity's container credentials
(``AWS_CONTAINER_CREDENTIALS_FULL_URI`` + ``AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE``).
"""

from __future__ import annotations

import os
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from infra.aws_call import signed_bytes

API_VERSION = "2016-11-15"
GONE = frozenset({"terminated"})
"""The instance states in which nothing of the instance runs any more (EC2 User Guide,
"Instance state changes": ``shutting-down`` still runs the shutdown; ``terminated`` does not)."""


@dataclass(frozen=True, kw_only=True)
class Ec2:
    region: str
    endpoint: str = ""
    """Empty: ``AWS_ENDPOINT_URL_EC2``, ``AWS_ENDPOINT_URL``, else the regional endpoint."""

    def url(self) -> str:
        return (
            self.endpoint
            or os.environ.get("AWS_ENDPOINT_URL_EC2")
            or os.environ.get("AWS_ENDPOINT_URL")
            or f"https://ec2.{self.region}.amazonaws.com"
        ).rstrip("/") + "/"

    def call(self, action: str, params: dict[str, str]) -> ET.Element:
        """One Query API call; the parsed XML answer."""
        body = urllib.parse.urlencode({"Action": action, "Version": API_VERSION, **params})
        text = signed_bytes(
            "POST",
            self.url(),
            service="ec2",
            region=self.region,
            body=body.encode(),
            headers={"content-type": "application/x-www-form-urlencoded; charset=utf-8"},
        )
        return ET.fromstring(text)

    def terminate(self, instance_id: str) -> str:
        """TerminateInstances for one instance; its current state name."""
        root = self.call("TerminateInstances", {"InstanceId.1": instance_id})
        state = root.find(".//{*}instancesSet/{*}item/{*}currentState/{*}name")
        return state.text if state is not None and state.text else "unknown"

    def states(self, instance_ids: list[str]) -> dict[str, str]:
        """DescribeInstances: instance id -> state name, for the ids EC2 still knows."""
        if not instance_ids:
            return {}
        params = {f"InstanceId.{i}": iid for i, iid in enumerate(instance_ids, start=1)}
        root = self.call("DescribeInstances", params)
        out = {}
        for item in root.findall(".//{*}reservationSet/{*}item/{*}instancesSet/{*}item"):
            iid = item.findtext("{*}instanceId", default="")
            out[iid] = item.findtext("{*}instanceState/{*}name", default="")
        return out

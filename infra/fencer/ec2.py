"""The fencer's EC2 calls, over EC2's Query API, signed by awscrt (infra/aws_call.py).

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
from datetime import datetime

from infra.aws_call import signed_bytes
from infra.fencer.decide import Instance

API_VERSION = "2016-11-15"
GONE = frozenset({"terminated"})
"""The instance states in which nothing of the instance runs any more (EC2 User Guide,
"Instance state changes": ``shutting-down`` still runs the shutdown; ``terminated`` does not)."""


LIVE = ("pending", "running", "shutting-down")
"""The states `group_instances` asks for: booting, up, or on their way out."""


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

    def terminate(self, instance_id: str, *, skip_os_shutdown: bool = False) -> str:
        """TerminateInstances for one instance; its current state name. `skip_os_shutdown`:
        the fence of a silent node (EC2 User Guide, "Methods for terminating an instance",
        *Terminate with skip OS shutdown*; the API's ``SkipOsShutdown``, botocore's ec2
        2016-11-15 model): a hung kernel never completes the graceful shutdown EC2 would first
        attempt, and nothing on the node is worth flushing (its pods are being failed; the
        root volume is deleted). An unfit or never-joined node still answers: it gets the
        graceful shutdown, its Lustre client unmounting cleanly, off the job's critical path."""
        params = {"InstanceId.1": instance_id}
        if skip_os_shutdown:
            params["SkipOsShutdown"] = "true"
        root = self.call("TerminateInstances", params)
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

    def group_instances(self, *, cluster: str, nodegroup: str) -> list[Instance]:
        """DescribeInstances of this node group's live instances: the tags EKS puts on a
        managed node group's instances (``eks:cluster-name``, ``eks:nodegroup-name``; the same
        tags the fencer's IAM condition names) and `LIVE` states, every page (``NextToken``)."""
        params = {
            "Filter.1.Name": "tag:eks:cluster-name",
            "Filter.1.Value.1": cluster,
            "Filter.2.Name": "tag:eks:nodegroup-name",
            "Filter.2.Value.1": nodegroup,
            "Filter.3.Name": "instance-state-name",
            **{f"Filter.3.Value.{i}": state for i, state in enumerate(LIVE, start=1)},
        }
        out: list[Instance] = []
        token = ""
        while True:
            root = self.call(
                "DescribeInstances", {**params, **({"NextToken": token} if token else {})}
            )
            for item in root.findall(".//{*}reservationSet/{*}item/{*}instancesSet/{*}item"):
                launched = item.findtext("{*}launchTime", default="")
                out.append(
                    Instance(
                        instance_id=item.findtext("{*}instanceId", default=""),
                        state=item.findtext("{*}instanceState/{*}name", default=""),
                        launched=datetime.fromisoformat(
                            launched.replace("Z", "+00:00")
                        ).timestamp(),
                    )
                )
            token = root.findtext("{*}nextToken", default="")
            if not token:
                return out

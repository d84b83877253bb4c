"""`make alert-test`: send one test alert through the deployed path (the workspace's alert
manager -> the SNS topic) and say whether it arrived.

1. CreateAlertManagerAlerts: POST `<PrometheusQueryUrl>alertmanager/api/v2/alerts`, one alert
   with a unique `training_job` label, ending in 10 minutes (AMP user guide,
   AMP-APIReference-CreateAlertManagerAlerts.html; IAM action aps:CreateAlertManagerAlerts).
2. ListAlertManagerAlerts: GET the same path with `filter=training_job="..."` until the alert
   manager holds it (AMP-APIReference-ListAlertManagerAlerts.html; the Alertmanager v2 API's
   `filter` matchers).
3. GetMetricData on the topic's `AWS/SNS` `NumberOfMessagesPublished` (dimension TopicName,
   1-minute sums; SNS developer guide, "Monitoring Amazon SNS topics using CloudWatch") until a
   message is counted after the alert was sent: AMP published it. A missing key permission
   (KMS), topic policy or receiver shows here as no message, while AMP's API accepted the alert.
   Delivered/failed notifications to subscribers are reported beside it.

CloudWatch is called with its AWS JSON 1.0 protocol (target prefix
`GraniteServiceVersion20100801`, one of the protocols its service model lists). Requests are
signed by infra/aws_call.py (SigV4 through awscrt; credentials as the AWS CLI finds them).

Exit status: 0 arrived; 1 not arrived (or an API refused, with its message); 2 bad input.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

from infra.aws_call import AwsCallError, signed_request
from training import exits

STACK_NAME = "EksFsdpResilient"
"""infra.config.STACK_NAME (not imported: this tool needs no CDK)."""
ALERT_NAME = "AlertPipelineTest"
CLOUDWATCH_TARGET = "GraniteServiceVersion20100801.GetMetricData"
OUTPUT_KEYS = ("Region", "PrometheusQueryUrl", "AlertTopicArn")


@dataclass(frozen=True)
class Target:
    region: str
    alerts_url: str
    topic_arn: str
    monitoring_url: str

    @property
    def topic_name(self) -> str:
        return self.topic_arn.rsplit(":", 1)[-1]


def deployed_outputs(*, stack: str, region: str) -> dict[str, str]:
    """The stack's outputs as CloudFormation holds them (`aws cloudformation describe-stacks`,
    the AWS CLI path infra/deployed.py reads the stack through): any clone has them, while
    cdk-outputs.json exists only in the clone that deployed."""
    from infra.deployed import AwsCliError, aws_cli

    try:
        answer = aws_cli(
            ["cloudformation", "describe-stacks", "--stack-name", stack], region=region
        )
        found = answer["Stacks"][0].get("Outputs", [])
        return {o["OutputKey"]: o["OutputValue"] for o in found}
    except (AwsCliError, OSError, KeyError, IndexError, TypeError, ValueError) as err:
        raise ValueError(
            f"the outputs of stack {stack} in {region} could not be read ({err}); check the "
            "credentials (aws sts get-caller-identity) and --region"
        ) from None


def load_target(
    *, outputs: Path | None, stack: str, region: str, monitoring_url: str | None
) -> Target:
    """The workspace and topic of the deployed stack: from CloudFormation, or from a
    `cdk deploy --outputs-file` file when one is given."""
    source = str(outputs) if outputs else f"stack {stack} in {region}"
    if outputs is None:
        values = deployed_outputs(stack=stack, region=region)
    else:
        try:
            values = json.loads(outputs.read_text())[stack]
        except FileNotFoundError:
            raise ValueError(f"{outputs}: not found; `make deploy` writes it") from None
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{outputs}: no outputs of stack {stack}; run `make deploy`") from None
    missing = [k for k in OUTPUT_KEYS if not values.get(k)]
    if missing:
        raise ValueError(
            f"{source}: stack {stack} has no {', '.join(missing)}; deploy the current stack "
            "(`make deploy`) first"
        )
    region = values["Region"]
    return Target(
        region=region,
        alerts_url=values["PrometheusQueryUrl"].rstrip("/") + "/alertmanager/api/v2/alerts",
        topic_arn=values["AlertTopicArn"],
        monitoring_url=monitoring_url or f"https://monitoring.{region}.amazonaws.com/",
    )


def _iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def send_alert(target: Target, *, run: str, now: dt.datetime) -> None:
    alert = {
        "labels": {"alertname": ALERT_NAME, "training_job": run, "severity": "none"},
        "annotations": {"summary": "make alert-test: a test alert, no action needed"},
        "startsAt": _iso(now),
        "endsAt": _iso(now + dt.timedelta(minutes=10)),
    }
    signed_request(
        "POST",
        target.alerts_url,
        service="aps",
        region=target.region,
        body=json.dumps([alert]).encode(),
        headers={"content-type": "application/json"},
    )


def alert_held(target: Target, *, run: str) -> bool:
    query = urllib.parse.urlencode({"filter": f'training_job="{run}"'})
    url = f"{target.alerts_url}?{query}"
    alerts = signed_request("GET", url, service="aps", region=target.region)
    return any((a.get("labels") or {}).get("training_job") == run for a in alerts or [])


def topic_counts(target: Target, *, since: dt.datetime, now: dt.datetime) -> dict[str, float]:
    """Sums since `since` of the topic's published / delivered / failed counts."""
    names = {
        "published": "NumberOfMessagesPublished",
        "delivered": "NumberOfNotificationsDelivered",
        "failed": "NumberOfNotificationsFailed",
    }
    queries = [
        {
            "Id": key,
            "MetricStat": {
                "Metric": {
                    "Namespace": "AWS/SNS",
                    "MetricName": metric,
                    "Dimensions": [{"Name": "TopicName", "Value": target.topic_name}],
                },
                "Period": 60,
                "Stat": "Sum",
            },
            "ReturnData": True,
        }
        for key, metric in names.items()
    ]
    body = {
        "MetricDataQueries": queries,
        # Minute-aligned sums: start at the minute the alert was sent in.
        "StartTime": int(since.timestamp()) // 60 * 60,
        "EndTime": int(now.timestamp()) // 60 * 60 + 60,
    }
    answer = signed_request(
        "POST",
        target.monitoring_url,
        service="monitoring",
        region=target.region,
        body=json.dumps(body).encode(),
        headers={
            "content-type": "application/x-amz-json-1.0",
            "x-amz-target": CLOUDWATCH_TARGET,
        },
    )
    results = {r["Id"]: r.get("Values", []) for r in (answer or {}).get("MetricDataResults", [])}
    return {key: float(sum(results.get(key, []))) for key in names}


def probe(target: Target, *, timeout_s: float, poll_s: float) -> tuple[bool, str]:
    """Send the alert and wait for the topic to count it: (arrived, what happened)."""
    run = f"alert-test-{uuid.uuid4().hex[:8]}"
    sent = dt.datetime.now(dt.UTC)
    send_alert(target, run=run, now=sent)
    deadline = time.monotonic() + timeout_s
    while not alert_held(target, run=run):
        if time.monotonic() > deadline:
            return False, (
                f"the alert manager accepted {run} but does not list it: check the workspace's "
                "alert manager definition (aws amp describe-alert-manager-definition)"
            )
        time.sleep(poll_s)
    print(f"sent {ALERT_NAME} {run}; the alert manager holds it; waiting for {target.topic_name}")
    while True:
        counts = topic_counts(target, since=sent, now=dt.datetime.now(dt.UTC))
        if counts["published"] >= 1:
            return True, (
                f"arrived: AMP published to {target.topic_arn} "
                f"({counts['published']:.0f} message(s) since {_iso(sent)}; to subscribers: "
                f"{counts['delivered']:.0f} delivered, {counts['failed']:.0f} failed)"
            )
        if time.monotonic() > deadline:
            return False, (
                f"not arrived: no message published to {target.topic_arn} within "
                f"{timeout_s:.0f} s of {run}: check the topic's KMS key policy (aps.amazonaws.com "
                "needs kms:GenerateDataKey* and kms:Decrypt), the topic policy and the alert "
                "manager's receiver; AMP logs the reason when the workspace has logging on"
            )
        time.sleep(poll_s)


def _cdk_json_region() -> str:
    cdk_json = Path(__file__).resolve().parents[1] / "cdk.json"
    return str(json.loads(cdk_json.read_text())["context"]["region"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.alert_probe", description=__doc__)
    parser.add_argument(
        "--outputs", type=Path, help="a cdk-outputs.json (default: the deployed stack's outputs)"
    )
    parser.add_argument("--stack", default=STACK_NAME)
    parser.add_argument("--region", default=_cdk_json_region(), help="default: cdk.json's")
    # Alert manager group_wait (30 s) + CloudWatch's 1-minute metrics: usually 2-4 minutes.
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")
    parser.add_argument("--poll", type=float, default=20.0, help="seconds between checks")
    parser.add_argument("--monitoring-endpoint", help="CloudWatch endpoint (tests)")
    args = parser.parse_args(argv)
    try:
        target = load_target(
            outputs=args.outputs,
            stack=args.stack,
            region=args.region,
            monitoring_url=args.monitoring_endpoint,
        )
    except ValueError as err:
        print(f"alert-test: {err}", file=sys.stderr)
        return exits.USAGE
    try:
        arrived, message = probe(target, timeout_s=args.timeout, poll_s=args.poll)
    except AwsCallError as err:
        print(f"alert-test: {err}", file=sys.stderr)
        return exits.FAILED
    if not arrived:
        print(f"alert-test: {message}", file=sys.stderr)
        return exits.FAILED
    print(message)
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())

"""The metrics workspace, its managed scraper, the alert rules and the alerts topic in the
synthesized stack (infra/observability.py), and the `alertEmail` setting.

    .venv/bin/pytest tests/infra/test_infra_observability.py -q     # ~40 s (two syntheses)

cfn-lint and cdk-nag run over these resources with the whole stack in
tests/infra/test_infra_validation.py. `promtool check config` (Debian's prometheus) checks the
scraper's configuration where it is installed. What only AWS can show: that the scraper reaches
the pods, that AMP creates its access entry, and that alerts arrive by e-mail.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from infra_synth import synth
from support import prometheus_server, requires_aws_cli, requires_tool

from infra import observability
from infra.config import ConfigError, load_config
from manifests import render
from training.observe import catalog

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULTS: dict[str, Any] = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
K8S_RESOURCE = "Custom::AWSCDK-EKS-KubernetesResource"


def _of_type(template: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == kind}


def _one(template: dict[str, Any], kind: str) -> tuple[str, dict[str, Any]]:
    (item,) = _of_type(template, kind).items()
    return item


def test_the_rule_groups_are_the_projects_rule_file(default_template: dict[str, Any]) -> None:
    ws_id, _ = _one(default_template, "AWS::APS::Workspace")
    _, rules = _one(default_template, "AWS::APS::RuleGroupsNamespace")
    props = rules["Properties"]
    assert props["Data"] == (REPO_ROOT / "observability" / "alerts.yaml").read_text()
    assert props["Workspace"] == {"Fn::GetAtt": [ws_id, "Arn"]}


def _scrape_config(template: dict[str, Any]) -> dict[str, Any]:
    _, scraper = _one(template, "AWS::APS::Scraper")
    blob = scraper["Properties"]["ScrapeConfiguration"]["ConfigurationBlob"]
    return yaml.safe_load(blob["Fn::Base64"])


def test_the_scraper_reads_the_cluster_privately(default_template: dict[str, Any]) -> None:
    ws_id, _ = _one(default_template, "AWS::APS::Workspace")
    cluster_id, _ = _one(default_template, "AWS::EKS::Cluster")
    _, scraper = _one(default_template, "AWS::APS::Scraper")
    props = scraper["Properties"]
    eks_source = props["Source"]["EksConfiguration"]
    assert eks_source["ClusterArn"] == {"Fn::GetAtt": [cluster_id, "Arn"]}
    assert eks_source["SecurityGroupIds"] == [
        {"Fn::GetAtt": [cluster_id, "ClusterSecurityGroupId"]}
    ]
    # The private subnets, one per AZ (AMP needs two AZs at least).
    subnets = {ref["Ref"] for ref in eks_source["SubnetIds"]}
    assert len(subnets) == len(DEFAULTS["availabilityZones"]) >= 2
    resources = default_template["Resources"]
    assert all(not resources[s]["Properties"]["MapPublicIpOnLaunch"] for s in subnets)
    assert props["Destination"]["AmpConfiguration"]["WorkspaceArn"] == {
        "Fn::GetAtt": [ws_id, "Arn"]
    }
    assert _scrape_config(default_template) == observability.scrape_config(
        training_namespace=DEFAULTS["trainingNamespace"]
    )


def test_the_scrape_config_keeps_the_trainer_pods_metrics_port() -> None:
    """What the scraper keeps is what the rendered Job declares (port name, component label)."""
    config = observability.scrape_config(training_namespace="training")
    trainer = next(c for c in config["scrape_configs"] if c["job_name"] == "trainer")
    keep = {r["source_labels"][0]: r["regex"] for r in trainer["relabel_configs"] if "action" in r}
    _, job = render.job_objects(overlay="smoke", namespace="training", image="img:1")
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["ports"] == [
        {"name": catalog.METRICS_PORT_NAME, "containerPort": catalog.METRICS_PORT}
    ]
    assert keep["__meta_kubernetes_pod_container_port_name"] == catalog.METRICS_PORT_NAME
    component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
    assert keep["__meta_kubernetes_pod_label_app_kubernetes_io_component"] == component
    assert config["global"]["scrape_interval"] == f"{catalog.SCRAPE_INTERVAL_S}s"


def _with_static_targets(config: dict[str, Any], targets: dict[str, dict[str, str]]) -> dict:
    """The scrape config with each job's Kubernetes discovery replaced by static targets that
    carry the `__meta_kubernetes_pod_*` labels the discovery would give them. Debian's
    Prometheus is built without Kubernetes discovery; relabeling is the same code either way."""
    config = json.loads(json.dumps(config))
    for job in config["scrape_configs"]:
        job.pop("kubernetes_sd_configs")
        job["static_configs"] = [
            {"targets": [address], "labels": labels} for address, labels in targets.items()
        ]
    return config


def _pod(name: str, port_name: str, **labels: str) -> dict[str, str]:
    meta = {
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_node_name": f"node-of-{name}",
        "__meta_kubernetes_pod_container_port_name": port_name,
    }
    meta.update({f"__meta_kubernetes_pod_label_{k}": v for k, v in labels.items()})
    return meta


@requires_tool("prometheus")
@pytest.mark.timeout(120)
def test_a_real_prometheus_keeps_only_the_metrics_ports(tmp_path: Path) -> None:
    """The scraper's relabeling, run by Prometheus itself: the trainer pod's `metrics` port, the
    DCGM exporter's and the node fencer's are kept (with the pod's and node's names), the rest
    dropped."""
    trainer = {"app_kubernetes_io_component": "trainer"}
    targets = {
        "127.0.0.1:1": _pod("llama-0", catalog.METRICS_PORT_NAME, **trainer),
        "127.0.0.1:2": _pod("llama-0", "other", **trainer),
        "127.0.0.1:3": _pod(
            "rdzv-store", catalog.METRICS_PORT_NAME, app_kubernetes_io_component="rdzv"
        ),
        "127.0.0.1:4": _pod("dcgm-exporter-x", "metrics", app_kubernetes_io_name="dcgm-exporter"),
        "127.0.0.1:5": _pod("node-fencer-x", "metrics", app_kubernetes_io_name="node-fencer"),
        "127.0.0.1:6": _pod("node-fencer-x", "other", app_kubernetes_io_name="node-fencer"),
    }
    config = _with_static_targets(
        observability.scrape_config(training_namespace="training"), targets
    )
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(
        ["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    with prometheus_server(path, data_dir=tmp_path / "prometheus") as port:
        active = _active_targets(port)
    kept = {(t["scrapePool"], t["labels"]["instance"], t["labels"]["pod"]) for t in active}
    assert kept == {
        ("trainer", "127.0.0.1:1", "llama-0"),
        ("dcgm-exporter", "127.0.0.1:4", "dcgm-exporter-x"),
        ("node-fencer", "127.0.0.1:5", "node-fencer-x"),
    }
    assert all(t["labels"]["kubernetes_node"].startswith("node-of-") for t in active)


def _active_targets(port: int) -> list[dict[str, Any]]:
    import time
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=2) as r:
                active = json.loads(r.read())["data"]["activeTargets"]
            if len(active) >= 2 or time.monotonic() > deadline:
                return active
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.3)


def test_alerts_go_to_an_encrypted_topic_only_this_workspace_publishes_to(
    default_template: dict[str, Any],
) -> None:
    topic_id, topic = _one(default_template, "AWS::SNS::Topic")
    key_id = topic["Properties"]["KmsMasterKeyId"]["Fn::GetAtt"][0]
    key = default_template["Resources"][key_id]
    assert key["Type"] == "AWS::KMS::Key" and key["Properties"]["EnableKeyRotation"] is True
    ws_id, workspace = _one(default_template, "AWS::APS::Workspace")
    definition = workspace["Properties"]["AlertManagerDefinition"]["Fn::Join"][1]
    assert {"Ref": topic_id} in definition
    text = "".join(part if isinstance(part, str) else "TOPIC" for part in definition)
    alertmanager = yaml.safe_load(yaml.safe_load(text)["alertmanager_config"])
    (receiver,) = alertmanager["receivers"]
    assert alertmanager["route"]["receiver"] == receiver["name"]
    assert receiver["sns_configs"][0]["topic_arn"] == "TOPIC"
    _, policy = _one(default_template, "AWS::SNS::TopicPolicy")
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    publish = next(s for s in statements if s.get("Principal") == {"Service": "aps.amazonaws.com"})
    assert publish["Condition"]["ArnEquals"]["aws:SourceArn"] == {"Fn::GetAtt": [ws_id, "Arn"]}
    # The key statement is AMP's documented one, without a condition (AMP user guide,
    # AMP-alertmanager-receiver-AMPpermission.html): any condition key missing from the KMS
    # request SNS makes for AMP would drop every alert.
    key_statements = key["Properties"]["KeyPolicy"]["Statement"]
    (for_aps,) = [
        s for s in key_statements if s.get("Principal") == {"Service": "aps.amazonaws.com"}
    ]
    assert for_aps == {
        "Action": ["kms:GenerateDataKey*", "kms:Decrypt"],
        "Effect": "Allow",
        "Principal": {"Service": "aps.amazonaws.com"},
        "Resource": "*",
    }
    assert any(  # TLS only
        s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        for s in statements
    )


def test_no_subscription_without_an_alert_email(default_template: dict[str, Any]) -> None:
    assert _of_type(default_template, "AWS::SNS::Subscription") == {}


def test_the_alert_email_is_subscribed(tmp_path: Path) -> None:
    template, _ = synth({"alertEmail": "oncall@example.com"}, outdir=tmp_path)
    _, subscription = _one(template, "AWS::SNS::Subscription")
    assert subscription["Properties"]["Protocol"] == "email"
    assert subscription["Properties"]["Endpoint"] == "oncall@example.com"


@pytest.mark.parametrize("bad", ["oncall", "a@b", "two@example.com,three@example.com", 7])
def test_a_bad_alert_email_names_the_key(bad: Any) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({**DEFAULTS, "alertEmail": bad}.get, overlays=("smoke",))
    message = str(err.value)
    assert message.startswith("context 'alertEmail':") and "\n" not in message


def test_the_stack_grants_the_scraper_nothing_of_its_own(
    default_template: dict[str, Any],
) -> None:
    """AMP creates the scraper's access entry, cluster-wide read, itself (auth mode API): a Role
    of ours for its user would add nothing and suggest a narrower scope than it has."""
    _, cluster = _one(default_template, "AWS::EKS::Cluster")
    assert cluster["Properties"]["AccessConfig"]["AuthenticationMode"] == "API"
    manifests = [
        doc
        for resource in _of_type(default_template, K8S_RESOURCE).values()
        for doc in _manifest_docs(resource)
    ]
    assert manifests  # the workloads' objects are read
    assert not [m for m in manifests if "aps-collector" in json.dumps(m)]
    entries = _of_type(default_template, "AWS::EKS::AccessEntry").values()
    assert not [e for e in entries if "aps" in json.dumps(e["Properties"]).lower()]


def _manifest_docs(resource: dict[str, Any]) -> list[dict[str, Any]]:
    manifest = resource["Properties"]["Manifest"]
    if not isinstance(manifest, str):
        return []  # a manifest with tokens (none of ours)
    return json.loads(manifest)


def test_the_outputs_name_the_workspace_and_the_topic(default_template: dict[str, Any]) -> None:
    assert {"PrometheusWorkspaceId", "PrometheusQueryUrl", "AlertTopicArn"} <= set(
        default_template["Outputs"]
    )


def test_dcgm_values_serve_the_listed_fields(default_template: dict[str, Any]) -> None:
    """The exporter reads its field list from the file `-f` names, which is the chart's
    ConfigMap (made from `customMetrics`) mounted there; and the stack gives the chart these
    values."""
    values = observability.dcgm_exporter_values()
    flag, path = values["arguments"]
    assert flag == "-f"
    (volume,) = values["extraConfigMapVolumes"]
    (mount,) = values["extraVolumeMounts"]
    assert volume["configMap"]["name"] == "exporter-metrics-config-map"
    assert mount["name"] == volume["name"] and mount["mountPath"] == path
    assert mount["subPath"] == volume["configMap"]["items"][0]["path"]
    assert volume["configMap"]["items"][0]["key"] == "metrics"
    charts = [
        r["Properties"]
        for r in default_template["Resources"].values()
        if r["Type"] == "Custom::AWSCDK-EKS-HelmChart"
        and r["Properties"].get("Chart") == "dcgm-exporter"
    ]
    (chart,) = charts
    deployed = json.loads(chart["Values"])
    for key, value in values.items():
        assert deployed[key] == value, key
    enabled = [
        line.split(",")[0]
        for line in values["customMetrics"].splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" in enabled
    assert "DCGM_FI_DEV_XID_ERRORS" in enabled


def test_a_broken_rule_file_fails_synth_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "alerts.yaml"
    broken.write_text("groups:\n  - name: training\n    rules:\n      - alert: X\n")
    monkeypatch.setattr(observability, "ALERT_RULES_FILE", broken)
    with pytest.raises(ValueError) as err:
        observability.alert_rules()
    assert str(broken) in str(err.value) and "\n" not in str(err.value)


@requires_tool("amtool")
def test_amtool_accepts_the_alert_manager_configuration(
    default_template: dict[str, Any], tmp_path: Path
) -> None:
    """The workspace's definition is AMP's wrapper around a plain Alertmanager file: the file,
    with a topic ARN in place of the CloudFormation reference, passes Alertmanager's own check."""
    _, workspace = _one(default_template, "AWS::APS::Workspace")
    parts = workspace["Properties"]["AlertManagerDefinition"]["Fn::Join"][1]
    arn = "arn:aws:sns:us-east-2:123456789012:alerts"
    text = "".join(part if isinstance(part, str) else arn for part in parts)
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_load(text)["alertmanager_config"])
    result = subprocess.run(
        ["amtool", "check-config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 receivers" in result.stdout


# --- `make alert-test` (infra/alert_probe.py) against a local stand-in of the APIs it calls ---
#
# What cannot run here: AMP, SNS and CloudWatch. The stand-in answers the three calls as their
# references describe them: CreateAlertManagerAlerts / ListAlertManagerAlerts (AMP user guide,
# AMP-APIReference-*.html: the Alertmanager v2 alerts API under the workspace's URL) and
# CloudWatch GetMetricData in the AWS JSON 1.0 protocol (CloudWatch API reference; the target
# prefix from its service model), and checks every request's SigV4 signature the way AWS does
# (IAM user guide, "Create a signed AWS API request": canonical request, string to sign,
# derived key), so the probe's real signing code (awscrt) is exercised, not bypassed.

KEY_ID, SECRET = "AKIDSTANDIN", "standin-secret"
REGION = "us-east-2"


def _sigv4_ok(handler: Any, body: bytes, *, secret: str) -> bool:
    import hashlib
    import hmac
    import urllib.parse

    auth = handler.headers.get("Authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return False
    fields = dict(p.strip().split("=", 1) for p in auth[len("AWS4-HMAC-SHA256 ") :].split(","))
    _, date, region, service, _ = fields["Credential"].split("/")
    signed_headers = fields["SignedHeaders"].split(";")
    path, _, query = handler.path.partition("?")
    pairs = sorted(urllib.parse.parse_qsl(query, keep_blank_values=True))
    canonical_query = "&".join(
        f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
        for k, v in pairs
    )
    headers = "".join(f"{h}:{handler.headers.get(h, '').strip()}\n" for h in signed_headers)
    payload = hashlib.sha256(body).hexdigest()
    canonical = "\n".join(
        [handler.command, path, canonical_query, headers, ";".join(signed_headers), payload]
    )
    scope = f"{date}/{region}/{service}/aws4_request"
    to_sign = "\n".join(
        [
            "AWS4-HMAC-SHA256",
            handler.headers["X-Amz-Date"],
            scope,
            hashlib.sha256(canonical.encode()).hexdigest(),
        ]
    )
    key = f"AWS4{secret}".encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    expected = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    handler.server.scopes.add((region, service))
    return hmac.compare_digest(expected, fields["Signature"])


def _stand_in(*, publishes: bool, secret: str = SECRET) -> Any:
    """AMP's alert manager API + CloudWatch GetMetricData on 127.0.0.1 (a thread)."""
    import http.server
    import threading
    import urllib.parse

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, code: int, payload: Any = None) -> None:
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self, body: bytes) -> bool:
            if _sigv4_ok(self, body, secret=secret):
                return True
            self._answer(403, {"message": "The request signature we calculated does not match"})
            return False

        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            if not self._authorized(b""):
                return
            assert path == "/workspaces/ws-standin/alertmanager/api/v2/alerts", path
            (matcher,) = urllib.parse.parse_qs(query)["filter"]
            name, _, value = matcher.partition("=")
            alerts = [a for a in self.server.alerts if a["labels"].get(name) == value.strip('"')]
            self._answer(200, [{**a, "status": {"state": "active"}} for a in alerts])

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if not self._authorized(body):
                return
            if self.path == "/workspaces/ws-standin/alertmanager/api/v2/alerts":
                self.server.alerts += json.loads(body)
                self._answer(200)
                return
            assert self.headers["X-Amz-Target"] == "GraniteServiceVersion20100801.GetMetricData"
            assert self.headers["Content-Type"] == "application/x-amz-json-1.0"
            request = json.loads(body)
            counted = publishes and bool(self.server.alerts)
            results = []
            for query in request["MetricDataQueries"]:
                metric = query["MetricStat"]["Metric"]
                assert metric["Namespace"] == "AWS/SNS"
                assert metric["Dimensions"] == [{"Name": "TopicName", "Value": "training-alerts"}]
                value = {"NumberOfMessagesPublished": 1.0, "NumberOfNotificationsDelivered": 1.0}
                hit = counted and metric["MetricName"] in value
                results.append(
                    {
                        "Id": query["Id"],
                        "Timestamps": [request["StartTime"]] if hit else [],
                        "Values": [value[metric["MetricName"]]] if hit else [],
                        "StatusCode": "Complete",
                    }
                )
            self._answer(200, {"MetricDataResults": results, "Messages": []})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.alerts, server.scopes = [], set()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _run_probe(tmp_path: Path, port: int, *extra: str) -> subprocess.CompletedProcess:
    """`make alert-test` from any clone: the outputs come from the (emulated) CloudFormation
    through the AWS CLI, as infra/deployed.py reads the stack; AMP and CloudWatch are the
    stand-in above."""
    import os
    import sys

    from cfn_emulator import emulated_cloudformation

    base = f"http://127.0.0.1:{port}"
    outputs = {
        "Region": REGION,
        "PrometheusQueryUrl": f"{base}/workspaces/ws-standin/",
        "AlertTopicArn": f"arn:aws:sns:{REGION}:123456789012:training-alerts",
    }
    with emulated_cloudformation() as cfn:
        cfn.put("EksFsdpResilient", {"Resources": {}}, outputs=outputs)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            **cfn.env(),
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
        }
        return subprocess.run(
            [
                *(sys.executable, "-m", "infra.alert_probe", "--region", REGION),
                *("--monitoring-endpoint", f"{base}/", "--poll", "0.2", "--timeout", "3", *extra),
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )


@requires_aws_cli()
def test_alert_test_says_the_alert_arrived(tmp_path: Path) -> None:
    server = _stand_in(publishes=True)
    try:
        result = _run_probe(tmp_path, server.server_address[1])
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    assert "arrived: AMP published to arn:aws:sns:" in result.stdout
    assert "1 delivered, 0 failed" in result.stdout
    (alert,) = server.alerts
    assert alert["labels"]["alertname"] == "AlertPipelineTest"
    assert alert["labels"]["training_job"].startswith("alert-test-")
    assert server.scopes == {(REGION, "aps"), (REGION, "monitoring")}


@requires_aws_cli()
def test_alert_test_says_when_the_topic_never_gets_it(tmp_path: Path) -> None:
    """What a KMS key policy AMP cannot use looks like from outside: AMP takes the alert, the
    topic publishes nothing."""
    server = _stand_in(publishes=False)
    try:
        result = _run_probe(tmp_path, server.server_address[1])
    finally:
        server.shutdown()
    assert result.returncode == 1
    assert result.stderr.startswith("alert-test: not arrived: no message published to")
    assert "kms:GenerateDataKey*" in result.stderr and len(server.alerts) == 1


@requires_aws_cli()
def test_alert_test_reports_a_refused_signature(tmp_path: Path) -> None:
    server = _stand_in(publishes=True, secret="another-secret")
    try:
        result = _run_probe(tmp_path, server.server_address[1])
    finally:
        server.shutdown()
    assert result.returncode == 1 and server.alerts == []
    assert "HTTP 403" in result.stderr and "signature" in result.stderr


def test_alert_test_without_outputs_says_what_to_run(tmp_path: Path) -> None:
    from infra import alert_probe

    assert alert_probe.main(["--outputs", str(tmp_path / "none.json")]) == 2
    # No stack readable (the test session has no credentials): one message, exit 2.
    assert alert_probe.main(["--region", REGION]) == 2


def test_make_alert_test_runs_the_probe() -> None:
    dry = subprocess.run(
        ["make", "-n", "alert-test"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert "-m infra.alert_probe" in dry.stdout and "cdk-outputs.json" not in dry.stdout

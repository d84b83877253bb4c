"""Metrics collection and alerts: an Amazon Managed Service for Prometheus (AMP) workspace, its
managed (agentless) scraper for the trainer pods, the DCGM exporter and the node fencer, the
project's alert rules, and an SNS topic the alerts go to (docs/observability.md says why).

- Scraper (`AWS::APS::Scraper`): runs in AWS, reaches the pods through its own network
  interfaces in the cluster's private subnets with the cluster security group (which every
  node's primary interface carries), discovers pods through the cluster's private endpoint and
  writes to the workspace. It needs no agent, no IAM role of ours and no public endpoint. Its
  rights in the cluster are AMP's, not ours: with the cluster's `API` authentication mode AMP
  creates the scraper's EKS access entry itself, with cluster-wide read access (get/list/watch
  nodes, nodes/proxy, nodes/metrics, services, endpoints, pods, ingresses, configmaps, and the
  /metrics paths; AMP user guide, "Set up managed collectors for Amazon EKS",
  AMP-collector-how-to.html). The scrape configuration below only chooses what it reads; the
  service offers no narrower entry, so the stack adds no RBAC of its own for it.
- Rules (`AWS::APS::RuleGroupsNamespace`): `observability/alerts.yaml`, deployed as written.
- Alert manager: the workspace's definition sends every alert to the SNS topic (KMS-encrypted,
  TLS only, publishable by AMP for this workspace only); `alertEmail` subscribes one address.

Attributes: `workspace` (CfnWorkspace), `rules`, `scraper`, `topic`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml
from aws_cdk import Fn, Stack
from aws_cdk import aws_aps as aps
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from infra import node_fencer

OBSERVABILITY_DIR = Path(__file__).resolve().parents[1] / "observability"
ALERT_RULES_FILE = OBSERVABILITY_DIR / "alerts.yaml"
DCGM_COUNTERS_FILE = OBSERVABILITY_DIR / "dcgm-counters.csv"

SCRAPE_INTERVAL = "30s"
"""training/observe/catalog.py SCRAPE_INTERVAL_S says the same (tests/observability check)."""
TRAINER_PORT_NAME = "metrics"
"""The trainer container's metrics port name (training/observe/catalog.py METRICS_PORT_NAME)."""
TRAINER_COMPONENT = "trainer"
"""The trainer pods' app.kubernetes.io/component label (manifests/render.py)."""
DCGM_NAMESPACE = "kube-system"
"""Where infra/addons.py installs the DCGM exporter chart."""


def scrape_config(*, training_namespace: str) -> dict[str, Any]:
    """The scraper's Prometheus configuration: every trainer pod's `metrics` port and every DCGM
    exporter pod; targets carry the pod's name and its node's name."""

    def pods(*, job: str, namespace: str, keep: dict[str, str]) -> dict[str, Any]:
        relabel = [
            {"action": "keep", "source_labels": [f"__meta_kubernetes_pod_{label}"], "regex": value}
            for label, value in keep.items()
        ]
        relabel += [
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {
                "source_labels": ["__meta_kubernetes_pod_node_name"],
                "target_label": "kubernetes_node",
            },
        ]
        return {
            "job_name": job,
            "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [namespace]}}],
            "relabel_configs": relabel,
        }

    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": "10s"},
        "scrape_configs": [
            pods(
                job="trainer",
                namespace=training_namespace,
                keep={
                    "label_app_kubernetes_io_component": TRAINER_COMPONENT,
                    "container_port_name": TRAINER_PORT_NAME,
                },
            ),
            pods(
                job="dcgm-exporter",
                namespace=DCGM_NAMESPACE,
                keep={
                    "label_app_kubernetes_io_name": "dcgm-exporter",
                    "container_port_name": "metrics",
                },
            ),
            # The node fencer's state (infra/fencer/metrics.py): the FencingHalted alert.
            pods(
                job=node_fencer.NAME,
                namespace=node_fencer.NAMESPACE,
                keep={
                    "label_app_kubernetes_io_name": node_fencer.NAME,
                    "container_port_name": node_fencer.METRICS_PORT_NAME,
                },
            ),
        ],
    }


def alert_rules() -> str:
    """The rule file's text, checked for the shape AMP needs (groups of named rules with an
    expression); promtool checks the rest in tests/observability. A broken file fails synth
    with one line naming it, not the deploy."""
    text = ALERT_RULES_FILE.read_text()
    doc = yaml.safe_load(text)
    groups = doc.get("groups") if isinstance(doc, dict) else None
    rules = [r for g in groups or [] for r in (g.get("rules") or [])]
    bad = [r for r in rules if not (r.get("alert") or r.get("record")) or not r.get("expr")]
    if not rules or bad:
        raise ValueError(
            f"{ALERT_RULES_FILE}: not a Prometheus rule file (groups of rules, each with alert "
            "and expr); check it with: promtool check rules observability/alerts.yaml"
        )
    return text


def dcgm_exporter_values() -> dict[str, Any]:
    """Helm values for the DCGM exporter chart (infra/addons.py) that make it serve the fields
    in `observability/dcgm-counters.csv` (the chart's defaults plus the volatile ECC counters):
    the chart puts `customMetrics` in its ConfigMap (`exporter-metrics-config-map`, key
    `metrics`), which is mounted over the file the exporter's `-f` reads, as NVIDIA's
    gpu-telemetry guide shows (extraConfigMapVolumes + extraVolumeMounts). A file, not `-m`:
    `-m` reads the ConfigMap through the API server and needs a Role the chart does not make."""
    counters = "/etc/dcgm-exporter/dcp-metrics-included.csv"
    return {
        "customMetrics": DCGM_COUNTERS_FILE.read_text(),
        "arguments": ["-f", counters],
        "extraConfigMapVolumes": [
            {
                "name": "exporter-metrics-volume",
                "configMap": {
                    "name": "exporter-metrics-config-map",
                    "items": [{"key": "metrics", "path": "dcp-metrics-included.csv"}],
                },
            }
        ],
        "extraVolumeMounts": [
            {
                "name": "exporter-metrics-volume",
                "mountPath": counters,
                "subPath": "dcp-metrics-included.csv",
                "readOnly": True,
            }
        ],
    }


def _alertmanager_definition(*, topic_arn: str, region: str) -> str:
    """The workspace's alert manager configuration (AMP's format: the Alertmanager file under
    `alertmanager_config`): every alert to the SNS topic, grouped per alert and run or node."""
    config = {
        "route": {
            "receiver": "sns",
            "group_by": ["alertname", "training_job", "Hostname"],
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
        },
        "receivers": [
            {
                "name": "sns",
                "sns_configs": [
                    {
                        "topic_arn": topic_arn,
                        "sigv4": {"region": region},
                        "subject": "{{ .CommonLabels.alertname }} {{ .CommonLabels.training_job }}",
                    }
                ],
            }
        ],
    }
    # Wide lines: YAML must not fold the topic ARN (a CloudFormation token until deploy).
    body = yaml.safe_dump(config, sort_keys=False, width=1_000_000)
    return "alertmanager_config: |\n" + textwrap.indent(body, "  ")


class Observability(Construct):
    """AMP workspace + managed scraper + alert rules + SNS alerts (module docstring)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster: eks.Cluster,
        vpc: ec2.IVpc,
        training_namespace: str,
        alert_email: str | None,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        key = kms.Key(
            self,
            "AlertsKey",
            description="Encrypts the training alerts topic",
            enable_key_rotation=True,
        )
        aps_principal = iam.ServicePrincipal("aps.amazonaws.com")
        # AMP publishes to an encrypted topic only with the key's data-key permissions, and the
        # statement is exactly AMP's documented one, with no condition (AMP user guide, "Giving
        # Amazon Managed Service for Prometheus permission to send alert messages to your Amazon
        # SNS topic", AMP-alertmanager-receiver-AMPpermission.html, the optional SSE step): a
        # condition key the KMS request SNS makes on AMP's behalf does not carry fails every
        # publish, and AMP drops the alert with nothing but a log line. The topic policy below
        # keeps the confused-deputy conditions (workspace ARN, account) AMP documents there.
        key.add_to_resource_policy(
            iam.PolicyStatement(
                actions=["kms:GenerateDataKey*", "kms:Decrypt"],
                principals=[aps_principal],
                resources=["*"],
            )
        )
        self.topic = sns.Topic(
            self, "AlertsTopic", display_name="Training alerts", master_key=key, enforce_ssl=True
        )
        if alert_email:
            self.topic.add_subscription(subscriptions.EmailSubscription(alert_email))

        self.workspace = aps.CfnWorkspace(self, "Workspace", alias=f"{stack.stack_name}-metrics")
        self.workspace.alert_manager_definition = _alertmanager_definition(
            topic_arn=self.topic.topic_arn, region=stack.region
        )
        self.topic.add_to_resource_policy(
            iam.PolicyStatement(
                actions=["sns:Publish", "sns:GetTopicAttributes"],
                principals=[aps_principal],
                resources=[self.topic.topic_arn],
                conditions={
                    "ArnEquals": {"aws:SourceArn": self.workspace.attr_arn},
                    "StringEquals": {"aws:SourceAccount": stack.account},
                },
            )
        )
        self.rules = aps.CfnRuleGroupsNamespace(
            self,
            "AlertRules",
            name="training",
            workspace=self.workspace.attr_arn,
            data=alert_rules(),
        )
        self.scraper = aps.CfnScraper(
            self,
            "Scraper",
            alias=f"{stack.stack_name}-scraper",
            source=aps.CfnScraper.SourceProperty(
                eks_configuration=aps.CfnScraper.EksConfigurationProperty(
                    cluster_arn=cluster.cluster_arn,
                    subnet_ids=[s.subnet_id for s in vpc.private_subnets],
                    security_group_ids=[cluster.cluster_security_group_id],
                )
            ),
            scrape_configuration=aps.CfnScraper.ScrapeConfigurationProperty(
                configuration_blob=Fn.base64(
                    yaml.safe_dump(
                        scrape_config(training_namespace=training_namespace),
                        sort_keys=False,
                        width=1_000_000,
                    )
                )
            ),
            destination=aps.CfnScraper.DestinationProperty(
                amp_configuration=aps.CfnScraper.AmpConfigurationProperty(
                    workspace_arn=self.workspace.attr_arn
                )
            ),
        )

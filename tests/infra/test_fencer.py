"""The node fencer's logic (infra/fencer): what it fences and when, and its EC2 and Kubernetes
calls in order, against an EC2 API stand-in that speaks the real Query API (moto in server mode,
from its own venv: botocore cannot sit beside the project's kubernetes client).

The pod test (tests/pods/test_pods.py, the fenced lost node) runs the same fencer against the
emulated cluster end to end. Emulated here: the Kubernetes API (plain Node JSON, as the API
server returns it), EC2 (moto; it enforces no IAM).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.fencer.controller import Fencer, view
from infra.fencer.decide import FencePolicy, Instance, NodeView, decide, instance_id
from infra.fencer.ec2 import Ec2
from ops.cordon import LUSTRE_MOUNT, STARTUP_CHECK, STRAGGLER, UNFIT_LABEL, cordon_patch
from podsim import ec2 as fencing

NOW = 1_000_000.0
POLICY = FencePolicy(wait_s=30, max_in_flight=1, max_bad_fraction=0.2)


def _node(name: str, ready: str = "True", since: float = 0.0, iid: str = "i-1") -> NodeView:
    return NodeView(
        name=name, instance_id=iid, ready=ready, ready_since=since, out_of_service=False
    )


def test_instance_id_from_provider_id() -> None:
    assert instance_id("aws:///us-east-2a/i-0123456789abcdef0") == "i-0123456789abcdef0"
    assert instance_id("") is None
    assert instance_id("gce://project/zone/name") is None


def test_a_node_is_fenced_only_once_ready_stayed_unknown_past_the_wait() -> None:
    nodes = [_node(f"n{i}") for i in range(9)]
    early = [*nodes, _node("lost", "Unknown", since=NOW - 29)]
    assert decide(early, now=NOW, policy=POLICY, in_flight=0).fence == ()
    due = [*nodes, _node("lost", "Unknown", since=NOW - 30)]
    assert [n.name for n in decide(due, now=NOW, policy=POLICY, in_flight=0).fence] == ["lost"]
    # Ready=False: a kubelet that answers; left to EKS node repair (it can be drained).
    sick = [*nodes, _node("sick", "False", since=NOW - 3600)]
    assert decide(sick, now=NOW, policy=POLICY, in_flight=0).fence == ()


def test_fencing_is_paced_by_the_spares() -> None:
    nodes = [_node(f"n{i}") for i in range(8)]
    lost = [_node(f"lost{i}", "Unknown", since=NOW - 100 + i) for i in range(2)]
    policy = FencePolicy(wait_s=30, max_in_flight=2, max_bad_fraction=0.2)
    both = decide([*nodes, *lost], now=NOW, policy=policy, in_flight=0).fence
    assert [n.name for n in both] == ["lost0", "lost1"]  # the longest silent first
    one = decide([*nodes, *lost], now=NOW, policy=policy, in_flight=1).fence
    assert [n.name for n in one] == ["lost0"]
    assert decide([*nodes, *lost], now=NOW, policy=policy, in_flight=2).fence == ()


def test_too_much_of_the_group_bad_stops_fencing_with_an_alert() -> None:
    nodes = [_node(f"n{i}") for i in range(7)]
    lost = [_node(f"lost{i}", "Unknown", since=NOW - 100) for i in range(3)]
    decision = decide([*nodes, *lost], now=NOW, policy=POLICY, in_flight=0)
    assert decision.fence == ()
    assert decision.alert and "3 of 10 GPU nodes are bad" in decision.alert
    # A small group may always lose as many nodes as it has spares: 1 of 3 is not an incident.
    small = [_node("a"), _node("b"), _node("lost", "Unknown", since=NOW - 100)]
    assert decide(small, now=NOW, policy=POLICY, in_flight=0).alert is None


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("wait_s", {"wait_s": -1}),
        ("max_in_flight", {"max_in_flight": 0}),
        ("max_bad_fraction", {"max_bad_fraction": 0}),
        ("join_timeout_s", {"join_timeout_s": 0}),
    ],
)
def test_a_bad_policy_names_its_field(field: str, kwargs: dict) -> None:
    values = {"wait_s": 30, "max_in_flight": 1, "max_bad_fraction": 0.2, **kwargs}
    with pytest.raises(ValueError, match=field):
        FencePolicy(**values)


def test_the_node_json_is_read_as_the_api_server_writes_it() -> None:
    node = {
        "metadata": {"name": "ip-10-0-0-1"},
        "spec": {
            "providerID": "aws:///us-east-2a/i-0abc",
            "taints": [{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}],
        },
        "status": {
            "conditions": [
                {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-12-07T04:00:00Z"}
            ]
        },
    }
    seen = view(node)
    assert (seen.name, seen.instance_id, seen.ready, seen.out_of_service) == (
        "ip-10-0-0-1",
        "i-0abc",
        "Unknown",
        True,
    )
    assert seen.ready_since == datetime(2026, 12, 7, 4, tzinfo=UTC).timestamp()


class _Nodes:
    """list_node/patch_node of CoreV1Api over plain Node JSON."""

    def __init__(self, nodes: dict[str, dict]) -> None:
        self.nodes = nodes
        self.patches: list[tuple[str, dict]] = []

    def list_node(self, *, label_selector: str, **kwargs: object) -> SimpleNamespace:
        assert label_selector == fencing.SELECTOR
        assert kwargs.get("_request_timeout"), "every API call carries a timeout"
        return SimpleNamespace(items=list(self.nodes.values()))

    def patch_node(self, name: str, body: dict, **kwargs: object) -> dict:
        assert kwargs.get("_request_timeout"), "every API call carries a timeout"
        self.patches.append((name, body))
        self.nodes[name]["spec"]["taints"] = body["spec"]["taints"]
        return self.nodes[name]


def _node_json(name: str, iid: str, ready: str, since: float) -> dict:
    stamp = datetime.fromtimestamp(since, tz=UTC).isoformat()
    return {
        "metadata": {"name": name},
        "spec": {
            "providerID": f"aws:///us-east-2a/{iid}",
            "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
        },
        "status": {"conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": stamp}]},
    }


@pytest.mark.requires(reason=fencing.moto_reason())
def test_the_fencer_terminates_then_taints_through_the_ec2_api(tmp_path: Path) -> None:
    """A silent node's instance is terminated (TerminateInstances over the Query API, SigV4 by
    awscrt) and the node tainted out-of-service only once DescribeInstances says terminated,
    keeping its other taints; a healthy node's instance keeps running; a second pass does
    nothing more."""
    with fencing.moto_server(tmp_path) as url, fencing.aws_environment(url):
        ec2 = Ec2(region=os.environ["AWS_REGION"])
        cloud = fencing.Cloud(plane=None, ec2=ec2)  # type: ignore[arg-type]
        lost, healthy = cloud.instance("lost"), cloud.instance("healthy")
        now = datetime.now(tz=UTC).timestamp()
        nodes = _Nodes(
            {
                "lost": _node_json("lost", lost, "Unknown", now - 60),
                "healthy": _node_json("healthy", healthy, "True", now - 3600),
                "spare": _node_json("spare", cloud.instance("spare"), "True", now - 3600),
            }
        )
        fencer = Fencer(
            nodes=nodes,
            ec2=ec2,
            policy=POLICY,
            label_selector=fencing.SELECTOR,
        )
        fencer.reconcile()
        assert ec2.states([lost, healthy]) == {lost: "terminated", healthy: "running"}
        (name, body), *more = nodes.patches
        assert name == "lost" and more == []
        assert body["spec"]["taints"] == [
            {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"},
            {
                "key": "node.kubernetes.io/out-of-service",
                "value": "nodeshutdown",
                "effect": "NoExecute",
            },
        ]
        assert fencer.fenced == ["lost"]
        fencer.reconcile()
        assert len(nodes.patches) == 1 and fencer.fenced == ["lost"]


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "AWS_REGION"),
        ({"FENCE_MAX_IN_FLIGHT": "0"}, "max_in_flight"),
        ({"FENCE_WAIT_S": "soon"}, "soon"),
        ({"FENCE_JOIN_TIMEOUT_S": "0"}, "join_timeout_s"),
        ({"FENCE_METRICS_PORT": "metrics"}, "metrics"),
        ({"FENCE_MOUNT_TIMEOUT_S": "0"}, "mount_timeout_s"),
        ({"FENCE_MOUNT_CORDON": "cordon"}, "FENCE_MOUNT_CORDON"),
    ],
)
def test_bad_settings_exit_2_naming_the_field(
    env: dict, named: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from infra.fencer import __main__ as fencer_main

    good = {
        "AWS_REGION": "us-east-2",
        "FENCE_NODE_SELECTOR": fencing.SELECTOR,
        "FENCE_WAIT_S": "30",
        "FENCE_MAX_IN_FLIGHT": "1",
        "FENCE_MAX_BAD_FRACTION": "0.2",
        "FENCE_POLL_S": "5",
        "FENCE_UNFIT_LABEL": UNFIT_LABEL,
        "FENCE_NAMESPACES": "training",
        "FENCE_METRICS_PORT": "9102",
        "FENCE_JOIN_TIMEOUT_S": "1200",
        "FENCE_CLUSTER_NAME": fencing.CLUSTER,
        "FENCE_NODEGROUP_NAME": fencing.NODEGROUP,
        "FENCE_MOUNT_TIMEOUT_S": "600",
        "FENCE_MOUNT_CORDON": json.dumps(cordon_patch(LUSTRE_MOUNT)),
    }
    assert set(good) == set(fencer_main.REQUIRED)
    for key, value in {**good, **env}.items():
        monkeypatch.setenv(key, value)
    if not env:
        monkeypatch.delenv("AWS_REGION")
    assert fencer_main.main() == 2
    err = capsys.readouterr().err
    assert named in err and "infra/node_fencer.py" in err
    assert "Traceback" not in err


# --- every bad node ends the same way: unfit (cordoned by the product) and never joined ---


def _unfit(name: str, *, busy: bool = False, reason: str = STRAGGLER, iid: str = "i-1") -> NodeView:
    return NodeView(
        name=name,
        instance_id=iid,
        ready="True",
        ready_since=0.0,
        out_of_service=False,
        unfit=reason,
        busy=busy,
    )


def test_an_unfit_node_is_replaced_only_once_no_training_pod_runs_there() -> None:
    nodes = [_node(f"n{i}") for i in range(9)]
    busy = decide([*nodes, _unfit("bad", busy=True)], now=NOW, policy=POLICY, in_flight=0)
    assert busy.replace == () and busy.fence == () and busy.bad == 1
    empty = decide([*nodes, _unfit("bad")], now=NOW, policy=POLICY, in_flight=0)
    assert [n.name for n in empty.replace] == ["bad"] and empty.fence == ()


def test_silent_nodes_go_first_and_unfit_ones_share_the_same_pace() -> None:
    nodes = [_node(f"n{i}") for i in range(8)]
    lost = _node("lost", "Unknown", since=NOW - 100)
    unfit = [_unfit("unfit-b"), _unfit("unfit-a")]
    policy = FencePolicy(wait_s=30, max_in_flight=2, max_bad_fraction=0.5)
    first = decide([*nodes, lost, *unfit], now=NOW, policy=policy, in_flight=0)
    assert [n.name for n in first.fence] == ["lost"]
    assert [n.name for n in first.replace] == ["unfit-a"]  # the room the silent one left
    full = decide([*nodes, lost, *unfit], now=NOW, policy=policy, in_flight=2)
    assert full.fence == () and full.replace == ()


def test_unfit_nodes_count_as_bad_and_too_many_stop_repairs() -> None:
    nodes = [_node(f"n{i}") for i in range(7)]
    decision = decide(
        [*nodes, *(_unfit(f"u{i}") for i in range(3))], now=NOW, policy=POLICY, in_flight=0
    )
    assert decision.replace == () and decision.bad == 3
    assert decision.alert and "3 of 10 GPU nodes are bad" in decision.alert


def _node_json_unfit(name: str, iid: str, *, labels: dict, unschedulable: bool) -> dict:
    node = _node_json(name, iid, "True", NOW - 3600)
    node["metadata"]["labels"] = labels
    node["spec"]["unschedulable"] = unschedulable
    return node


def test_only_the_products_own_cordon_makes_a_node_unfit() -> None:
    """The label and the cordon together: a person's cordon (no label) is never acted on, and
    uncordoning a marked node (a person keeping it) takes it back from the fencer."""
    product = {"metadata": {"labels": cordon_patch(STARTUP_CHECK)["metadata"]["labels"]}}
    marked = _node_json_unfit("a", "i-a", labels=product["metadata"]["labels"], unschedulable=True)
    assert view(marked, unfit_label=UNFIT_LABEL).unfit == STARTUP_CHECK
    by_hand = _node_json_unfit("b", "i-b", labels={}, unschedulable=True)
    assert view(by_hand, unfit_label=UNFIT_LABEL).unfit is None
    uncordoned = _node_json_unfit(
        "c", "i-c", labels=product["metadata"]["labels"], unschedulable=False
    )
    assert view(uncordoned, unfit_label=UNFIT_LABEL).unfit is None
    assert view(marked, unfit_label=UNFIT_LABEL, busy=frozenset({"a"})).busy


def test_an_instance_that_never_joined_is_ended_after_the_join_timeout() -> None:
    policy = FencePolicy(wait_s=30, max_in_flight=1, max_bad_fraction=0.2, join_timeout_s=1200)
    nodes = [_node(f"n{i}", iid=f"i-n{i}") for i in range(9)]
    joined = [Instance(instance_id=f"i-n{i}", state="running", launched=0.0) for i in range(9)]
    booting = Instance(instance_id="i-new", state="running", launched=NOW - 1199)
    stuck = Instance(instance_id="i-stuck", state="running", launched=NOW - 1200)
    early = decide(nodes, now=NOW, policy=policy, in_flight=0, instances=[*joined, booting])
    assert early.never_joined == () and early.bad == 0
    due = decide(nodes, now=NOW, policy=policy, in_flight=0, instances=[*joined, stuck])
    assert due.never_joined == (stuck,) and due.bad == 1
    # Paced like the others: no room, no termination.
    assert decide(nodes, now=NOW, policy=policy, in_flight=1, instances=[stuck]).never_joined == ()


class _Cluster(_Nodes):
    """`_Nodes` plus the training namespace's pods (``list_namespaced_pod`` with the fencer's
    field selector, answered as the API server filters on ``status.phase``)."""

    def __init__(self, nodes: dict[str, dict], pods: dict[str, tuple[str, str]]) -> None:
        super().__init__(nodes)
        self.pods = pods  # pod name -> (node name, phase)
        self.pod_lists: list[str] = []

    def list_namespaced_pod(self, namespace: str, **kwargs: object) -> SimpleNamespace:
        assert kwargs.get("_request_timeout"), "every API call carries a timeout"
        assert kwargs["field_selector"] == "status.phase!=Succeeded,status.phase!=Failed"
        self.pod_lists.append(namespace)
        items = [
            {"metadata": {"name": n}, "spec": {"nodeName": node}, "status": {"phase": phase}}
            for n, (node, phase) in self.pods.items()
            if phase not in ("Succeeded", "Failed")
        ]
        return SimpleNamespace(items=items)


@pytest.mark.requires(reason=fencing.moto_reason())
def test_the_fencer_replaces_an_unfit_node_once_empty_and_never_a_hand_cordoned_one(
    tmp_path: Path,
) -> None:
    """A node the trainer cordoned (ops.cordon's own patch body) keeps its instance while its
    training pod runs; once that pod has failed (NODE_UNFIT, the Job replaced it elsewhere) the
    fencer terminates the instance through the EC2 API and, once terminated, taints the node
    out of service. A node a person cordoned keeps running. The metrics say so."""
    with fencing.moto_server(tmp_path) as url, fencing.aws_environment(url):
        ec2 = Ec2(region=os.environ["AWS_REGION"])
        cloud = fencing.Cloud(plane=None, ec2=ec2)  # type: ignore[arg-type]
        unfit, by_hand = cloud.instance("unfit"), cloud.instance("by-hand")
        nodes = {
            f"n{i}": _node_json(f"n{i}", cloud.instance(f"n{i}"), "True", NOW) for i in range(8)
        }
        marked = _node_json("unfit", unfit, "True", NOW)
        marked["metadata"]["labels"] = cordon_patch(STRAGGLER)["metadata"]["labels"]
        marked["spec"]["unschedulable"] = True
        hand = _node_json("by-hand", by_hand, "True", NOW)
        hand["spec"]["unschedulable"] = True
        api = _Cluster(
            {**nodes, "unfit": marked, "by-hand": hand},
            {"fsdp-0-abc": ("unfit", "Running"), "fsdp-1-def": ("n1", "Running")},
        )
        fencer = Fencer(
            nodes=api,
            ec2=ec2,
            policy=POLICY,
            label_selector=fencing.SELECTOR,
            unfit_label=UNFIT_LABEL,
            namespaces=("training",),
        )
        fencer.reconcile()
        assert api.pod_lists == ["training"]
        assert ec2.states([unfit, by_hand]) == {unfit: "running", by_hand: "running"}
        assert api.patches == []
        api.pods["fsdp-0-abc"] = ("unfit", "Failed")
        fencer.reconcile()
        assert ec2.states([unfit, by_hand]) == {unfit: "terminated", by_hand: "running"}
        ((name, body),) = api.patches
        assert name == "unfit" and body["spec"]["taints"][-1]["key"] == (
            "node.kubernetes.io/out-of-service"
        )
        assert fencer.fenced == ["unfit"]
        text = fencer.metrics.render()
        assert 'node_fencer_terminations_total{kind="replaced"} 1.0' in text
        assert 'node_fencer_terminations_total{kind="fenced"} 0.0' in text
        assert "node_fencer_halted 0.0" in text


@pytest.mark.requires(reason=fencing.moto_reason())
def test_the_fencer_ends_an_instance_that_never_joined(tmp_path: Path) -> None:
    """An instance of the group (EKS's tags) with no Node past the join timeout (a Lustre set-up
    that failed keeps the kubelet from starting) is terminated; one of another node group, and
    one still in its boot, keep running."""
    with fencing.moto_server(tmp_path) as url, fencing.aws_environment(url):
        ec2 = Ec2(region=os.environ["AWS_REGION"])
        cloud = fencing.Cloud(plane=None, ec2=ec2)  # type: ignore[arg-type]
        nodes = {
            f"n{i}": _node_json(f"n{i}", cloud.instance(f"n{i}"), "True", NOW) for i in range(9)
        }
        stuck = cloud.instance("never-joined")  # no Node
        other = ec2.call(
            "RunInstances",
            {
                "ImageId": "ami-12c6146b",
                "MinCount": "1",
                "MaxCount": "1",
                "TagSpecification.1.ResourceType": "instance",
                "TagSpecification.1.Tag.1.Key": "eks:nodegroup-name",
                "TagSpecification.1.Tag.1.Value": "system",
                "TagSpecification.1.Tag.2.Key": "eks:cluster-name",
                "TagSpecification.1.Tag.2.Value": fencing.CLUSTER,
            },
        ).findtext(".//{*}instancesSet/{*}item/{*}instanceId")
        launched = datetime.now(tz=UTC).timestamp()
        policy = FencePolicy(wait_s=30, max_in_flight=1, max_bad_fraction=0.2, join_timeout_s=600)
        clock = [launched + 60]
        fencer = Fencer(
            nodes=_Nodes(nodes),
            ec2=ec2,
            policy=policy,
            label_selector=fencing.SELECTOR,
            cluster_name=fencing.CLUSTER,
            nodegroup_name=fencing.NODEGROUP,
            clock=lambda: clock[0],
        )
        fencer.reconcile()  # a minute after launch: still booting
        assert ec2.states([stuck, other]) == {stuck: "running", other: "running"}
        clock[0] = launched + 660
        fencer.reconcile()
        assert ec2.states([stuck, other]) == {stuck: "terminated", other: "running"}
        assert 'node_fencer_terminations_total{kind="unjoined"} 1.0' in fencer.metrics.render()


def test_the_halt_is_a_metric_served_over_http() -> None:
    """What the scraper reads: the halt and the bad count, in the text format, on /metrics."""
    import urllib.request

    from infra.fencer.metrics import FencerMetrics, serve

    metrics = FencerMetrics()
    nodes = [_node(f"n{i}") for i in range(7)]
    lost = [_node(f"lost{i}", "Unknown", since=NOW - 100) for i in range(3)]
    decision = decide([*nodes, *lost], now=NOW, policy=POLICY, in_flight=0)
    metrics.observe(nodes=10, bad=decision.bad, in_flight=0, halted=bool(decision.alert))
    server = serve(metrics, port=0, host="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(samples["node_fencer_halted"]) == 1
    assert float(samples["node_fencer_bad_nodes"]) == 3
    assert "# TYPE node_fencer_terminations_total counter" in text


def test_an_unfit_label_without_namespaces_is_refused() -> None:
    with pytest.raises(ValueError, match="namespaces"):
        Fencer(
            nodes=_Nodes({}),
            ec2=Ec2(region="us-east-2"),
            policy=POLICY,
            label_selector=fencing.SELECTOR,
            unfit_label=UNFIT_LABEL,
        )

"""The node fencer's logic (infra/fencer): what it fences and when, and its EC2 and Kubernetes
calls in order, against an EC2 API stand-in that speaks the real Query API (moto in server mode,
from its own venv: botocore cannot sit beside the project's kubernetes client).

The pod test (tests/pods/test_pods.py, the fenced lost node) runs the same fencer against the
emulated cluster end to end. Emulated here: the Kubernetes API (plain Node JSON, as the API
server returns it), EC2 (moto; it enforces no IAM).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.fencer.controller import Fencer, view
from infra.fencer.decide import FencePolicy, NodeView, decide, instance_id
from infra.fencer.ec2 import Ec2
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
    assert decision.alert and "3 of 10 GPU nodes are not Ready" in decision.alert
    # A small group may always lose as many nodes as it has spares: 1 of 3 is not an incident.
    small = [_node("a"), _node("b"), _node("lost", "Unknown", since=NOW - 100)]
    assert decide(small, now=NOW, policy=POLICY, in_flight=0).alert is None


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("wait_s", {"wait_s": -1}),
        ("max_in_flight", {"max_in_flight": 0}),
        ("max_bad_fraction", {"max_bad_fraction": 0}),
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
    }
    for key, value in {**good, **env}.items():
        monkeypatch.setenv(key, value)
    if not env:
        monkeypatch.delenv("AWS_REGION")
    assert fencer_main.main() == 2
    err = capsys.readouterr().err
    assert named in err and "infra/node_fencer.py" in err
    assert "Traceback" not in err

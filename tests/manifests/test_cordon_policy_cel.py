"""The trainer's cordon ValidatingAdmissionPolicy (manifests/render.py `node_cordon_objects`),
compiled and evaluated by a real CEL implementation.

Evaluator: `cel-expr-python`, the CEL project's own Python binding of cel-cpp (github.com/
cel-expr/cel-python). Kubernetes evaluates policies with cel-go; both implement the one language
definition (github.com/google/cel-spec, whose conformance suite both run), and the policy uses
only standard CEL: `in` on a map, `has()`, indexing, `==` on lists and maps, `?:`, `&&`. No
Kubernetes CEL library function (quantity, url, authorizer, ...): a policy that starts using
one fails `test_every_expression_compiles` here with "undeclared reference", and then needs a
kube-apiserver to test. Why not the API server itself: no kube-apiserver, envtest or kind binary
is in the registries this machine reaches (PyPI, npm, Debian: `apt-cache search kube-apiserver`
finds nothing), and building one needs Go and etcd.

What the API server does around the expressions is emulated here, after kubernetes.io/docs/
reference/access-authn-authz/validating-admission-policy ("Matching requests: matchConditions",
"Failure Policy", "Validation expressions"): the request must match `matchConstraints`; every
match condition must be true, else the policy is skipped (an error fails per failurePolicy);
then every validation must be true, else the request is denied with its message (an error also
denies, failurePolicy Fail). The variables are those the page lists (`object`, `oldObject`,
`request`, `params`, `namespaceObject`), dynamically typed here, where Kubernetes types
`object` from the Node's OpenAPI schema. What is not emulated: the binding (it has no
`matchResources` or params, so it applies the policy to every matching request) and the
`authentication.kubernetes.io/node-name` extra itself, which the API server takes from a
pod-bound ServiceAccount token (ServiceAccountTokenPodNodeInfo, GA in 1.32); the requests below
carry it as the API server would.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from cel_expr_python import cel

from manifests import render
from ops.cordon import REASONS, STARTUP_CHECK, STRAGGLER, UNFIT_LABEL, cordon_patch

NAMESPACE = "training"
TRAINER = f"system:serviceaccount:{NAMESPACE}:{render.SERVICE_ACCOUNT}"
NODE = "ip-10-0-96-17.us-east-2.compute.internal"
OTHER_NODE = "ip-10-0-97-4.us-east-2.compute.internal"
VARIABLES = ("object", "oldObject", "request", "params", "namespaceObject")
CORDON_PATCH = cordon_patch(STRAGGLER)
"""The trainer's own request body after a straggler eviction (ops.cordon.cordon_patch)."""


def _with(extra: dict, body: dict | None = None) -> dict:
    """The trainer's body plus `extra`, keeping `extra`'s nulls (a removal in the patch)."""
    out = copy.deepcopy(CORDON_PATCH if body is None else body)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _with(value, out[key])
        else:
            out[key] = value
    return out


def _policy() -> dict[str, Any]:
    """The policy as the stack applies it (the shared objects of infra/workloads.py)."""
    objects = render.shared_objects(
        namespace=NAMESPACE,
        file_system_id="fs-0123456789abcdef0",
        dns_name="fs.example",
        mount_name="abcdefgh",
        storage_capacity_gib=4800,
        image="trainer:1",
        store_image="store:1",
    )
    (policy,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    return policy


ENV = cel.NewEnv(variables=dict.fromkeys(VARIABLES, cel.Type.DYN))


def _node(name: str = NODE) -> dict[str, Any]:
    """A GPU node as EKS registers it (the fields the policy reads, and a few it must not)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.present": "true",
                "eks.amazonaws.com/nodegroup": "gpu",
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            "resourceVersion": "4711",
        },
        "spec": {
            "providerID": "aws:///us-east-2a/i-0123456789abcdef0",
            "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
        },
    }


def _merge_patch(target: Any, patch: Any) -> Any:
    """JSON merge patch (RFC 7386); for these fields a strategic merge patch, which the
    kubernetes client sends for a dict body, gives the same object."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def _request(*, user: str = TRAINER, node_claim: str | None = NODE) -> dict[str, Any]:
    extra = {"authentication.kubernetes.io/pod-name": ["fsdp-2node-0-abcde"]}
    if node_claim is not None:
        extra["authentication.kubernetes.io/node-name"] = [node_claim]
    return {
        "operation": "UPDATE",
        "resource": {"group": "", "version": "v1", "resource": "nodes"},
        "userInfo": {"username": user, "groups": ["system:serviceaccounts"], "extra": extra},
    }


def _matches_constraints(policy: dict[str, Any], request: dict[str, Any]) -> bool:
    resource = request["resource"]
    return any(
        resource["group"] in rule["apiGroups"]
        and resource["version"] in rule["apiVersions"]
        and resource["resource"] in rule["resources"]
        and request["operation"] in rule["operations"]
        for rule in policy["spec"]["matchConstraints"]["resourceRules"]
    )


def admit(old: dict, new: dict, request: dict, *, policy: dict | None = None) -> str | None:
    """None when the policy admits the update, else the denial's message."""
    policy = policy or _policy()
    spec = policy["spec"]
    if not _matches_constraints(policy, request):
        return None
    data = {"object": new, "oldObject": old, "request": request}
    data |= {"params": None, "namespaceObject": None}  # cluster-scoped, no paramKind
    assert spec["failurePolicy"] == "Fail"
    for condition in spec.get("matchConditions", []):
        try:
            matched = ENV.compile(condition["expression"]).eval(data=data).value()
        except Exception as err:
            return f"match condition {condition['name']} failed: {err}"
        if matched is not True:
            return None  # the policy does not apply to this request
    for validation in spec["validations"]:
        try:
            ok = ENV.compile(validation["expression"]).eval(data=data).value()
        except Exception as err:
            return f"expression failed: {err}"
        if ok is not True:
            return validation["message"]
    return None


def _cordoned(node: dict) -> dict:
    """The node after the trainer's own request body (ops.cordon.cordon_patch)."""
    return _merge_patch(node, CORDON_PATCH)


def test_every_expression_compiles() -> None:
    spec = _policy()["spec"]
    expressions = [c["expression"] for c in spec["matchConditions"]]
    expressions += [v["expression"] for v in spec["validations"]]
    assert len(expressions) == 4
    for expression in expressions:
        ENV.compile(expression)  # raises with the position of a syntax or reference error
    # The compiler checks, it does not just parse: these fail.
    with pytest.raises(RuntimeError, match="Syntax error"):
        ENV.compile("object.spec.unschedulable ==")
    with pytest.raises(RuntimeError, match="undeclared reference"):
        ENV.compile("quantity(object.spec.x) > 1")


def test_the_trainer_cordons_its_own_node() -> None:
    old = _node()
    assert admit(old, _cordoned(old), _request()) is None
    # Cordoning an already cordoned node (a second eviction) is admitted too.
    assert admit(_cordoned(old), _cordoned(old), _request()) is None
    # Every reason the trainer sends, and a new reason over an old one.
    for reason in REASONS:
        assert admit(old, _merge_patch(old, cordon_patch(reason)), _request()) is None
    again = _merge_patch(_cordoned(old), cordon_patch(STARTUP_CHECK))
    assert admit(_cordoned(old), again, _request()) is None


def test_other_users_are_not_judged_by_the_policy() -> None:
    old = _node()
    new = _merge_patch(old, {"metadata": {"labels": {"topology.kubernetes.io/zone": "x"}}})
    assert admit(old, new, _request(user="system:node:" + NODE)) is None
    assert admit(old, new, _request(user="system:serviceaccount:training:default")) is None


@pytest.mark.parametrize(
    ("patch", "request_kwargs", "message"),
    [
        pytest.param(
            CORDON_PATCH, {"node_claim": OTHER_NODE}, "only the node it runs on", id="other-node"
        ),
        pytest.param(CORDON_PATCH, {"node_claim": None}, "only the node it runs on", id="no-claim"),
        pytest.param(
            {"spec": {"unschedulable": False}}, {}, "only set spec.unschedulable", id="uncordon"
        ),
        pytest.param(
            {"metadata": {"labels": {"nvidia.com/gpu.present": "false"}}},
            {},
            "only set spec.unschedulable",
            id="label-only",
        ),
        pytest.param(
            {"spec": {"unschedulable": True}},
            {},
            f"with the label {UNFIT_LABEL}",
            id="cordon-without-the-unfit-label",
        ),
        pytest.param(
            {"spec": {"unschedulable": True}, "metadata": {"labels": {UNFIT_LABEL: "bored"}}},
            {},
            f"with the label {UNFIT_LABEL}",
            id="unknown-reason",
        ),
        pytest.param(
            _with({"metadata": {"labels": {"a": "b"}}}),
            {},
            "no field but spec.unschedulable",
            id="label",
        ),
        pytest.param(
            _with({"metadata": {"labels": {"nvidia.com/gpu.present": "false"}}}),
            {},
            "no field but spec.unschedulable",
            id="label-changed",
        ),
        pytest.param(
            _with({"metadata": {"labels": {"eks.amazonaws.com/nodegroup": None}}}),
            {},
            "no field but spec.unschedulable",
            id="label-removed",
        ),
        pytest.param(
            _with({"metadata": {"annotations": {"a": "b"}}}),
            {},
            "no field but spec.unschedulable",
            id="annotation",
        ),
        pytest.param(
            _with({"spec": {"taints": None}}),
            {},
            "no field but spec.unschedulable",
            id="taints-removed",
        ),
        pytest.param(
            _with({"spec": {"providerID": "aws:///us-east-2a/i-1"}}),
            {},
            "no field but spec.unschedulable",
            id="provider-id",
        ),
        pytest.param(
            _with({"spec": {"podCIDR": "10.1.0.0/24"}}),
            {},
            "no field but spec.unschedulable",
            id="pod-cidr",
        ),
        pytest.param(
            _with({"metadata": {"finalizers": ["x"]}}),
            {},
            "no field but spec.unschedulable",
            id="finalizer",
        ),
    ],
)
def test_the_trainer_is_refused(patch: dict, request_kwargs: dict, message: str) -> None:
    old = _node()
    denial = admit(old, _merge_patch(old, patch), _request(**request_kwargs))
    assert denial is not None and message in denial


def test_a_weakened_policy_admits_what_this_one_refuses() -> None:
    """The evaluator decides, not the test's bookkeeping: without the node clause, another
    node's cordon is admitted."""
    policy = copy.deepcopy(_policy())
    policy["spec"]["validations"] = policy["spec"]["validations"][1:]
    old = _node(OTHER_NODE)
    assert admit(old, _cordoned(old), _request(), policy=policy) is None
    assert admit(old, _cordoned(old), _request()) is not None


def test_the_binding_denies_with_this_policy() -> None:
    """The binding (not emulated above) names this policy and denies (not only audits/warns)."""
    objects = render.node_cordon_objects(namespace=NAMESPACE)
    (binding,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {
        "policyName": _policy()["metadata"]["name"],
        "validationActions": ["Deny"],
    }

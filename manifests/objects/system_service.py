"""One small server every trainer pod reaches, kept single, in place and private: the rendezvous
store (``objects.rdzv_store``) and the replica groups' torchft Lighthouse (``manifests.replica``).
Its PriorityClass, one-replica Deployment on the system nodes, disruption budget, NetworkPolicy
and Service; each object says why it is there."""

from __future__ import annotations

from manifests.objects.common import SERVICE_ACCOUNT, TRAINER, labels, priority_class


def system_service_objects(
    *,
    name: str,
    namespace: str,
    component: str,
    priority_class_name: str,
    priority: int,
    description: str,
    container: dict,
    port: int,
    port_name: str,
) -> list[dict]:
    """``container``: the server's container without its port, requests and probe (added here:
    ``port`` named ``port_name``, TCP-probed). ``description``: the PriorityClass's."""
    own_labels = labels(component)
    return [
        # Scheduler preemption and the kubelet's node-pressure eviction both rank pods by
        # priority: with a class above the trainers' (0), the server is neither preempted for
        # nor evicted before a training pod (kubernetes.io/docs: "Pod Priority and Preemption";
        # "Node-pressure Eviction", which ranks by usage over requests, then priority).
        priority_class(
            name=priority_class_name,
            component=component,
            value=priority,
            preemption_policy="PreemptLowerPriority",
            description=description,
        ),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": own_labels},
            "spec": {
                "replicas": 1,
                # The old pod goes before the new one starts: a RollingUpdate would serve two
                # independent servers behind one Service for a while (two stores: launchers
                # that never form one rendezvous; two Lighthouses: two quorums).
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": own_labels},
                "template": {
                    "metadata": {"labels": own_labels},
                    "spec": {
                        "serviceAccountName": SERVICE_ACCOUNT,
                        "priorityClassName": priority_class_name,
                        # Never on a GPU node, so a lost training node cannot take it along.
                        "affinity": {
                            "nodeAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": {
                                    "nodeSelectorTerms": [
                                        {
                                            "matchExpressions": [
                                                {
                                                    "key": "nvidia.com/gpu.present",
                                                    "operator": "DoesNotExist",
                                                }
                                            ]
                                        }
                                    ]
                                }
                            }
                        },
                        "containers": [
                            {
                                **container,
                                "ports": [{"name": port_name, "containerPort": port}],
                                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                                "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 5},
                            }
                        ],
                    },
                },
            },
        },
        # No voluntary eviction (`kubectl drain`, an autoscaler's scale-down) takes the one
        # server down: with minAvailable equal to the replicas, a drain of its node waits
        # (kubernetes.io/docs: "Specifying a Disruption Budget for your Application"). A
        # server that is not ready can still be evicted (unhealthyPodEvictionPolicy), and a
        # managed node group version update forces its way through after its drain attempts
        # (the node group's force update, on by default in aws_eks_v2).
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": namespace, "labels": own_labels},
            "spec": {
                "minAvailable": 1,
                "selector": {"matchLabels": own_labels},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        },
        # The server has no authentication: only the training Jobs' pods (and the preflight's,
        # whose pod template is the training Job's) reach its port. Kubelet probes come from
        # the node, which a NetworkPolicy always admits (kubernetes.io/docs: "Network
        # Policies"). Egress: none. The server only answers connections made to it (replies on
        # an admitted connection are allowed, policies being stateful), so it needs no outbound
        # traffic, and denying it keeps the pod off the node's IMDS (the system nodes' hop
        # limit is 2; docs/day-two.md). Enforced only where the CNI enforces policies (the VPC
        # CNI with its network policy agent turned on).
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace, "labels": own_labels},
            "spec": {
                "podSelector": {"matchLabels": own_labels},
                "policyTypes": ["Ingress", "Egress"],
                "egress": [],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": labels(TRAINER)}}],
                        "ports": [{"protocol": "TCP", "port": port}],
                    }
                ],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": own_labels},
            "spec": {
                "selector": own_labels,
                "ports": [{"name": port_name, "port": port, "targetPort": port}],
            },
        },
    ]

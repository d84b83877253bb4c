"""An eviction waits while no hot spare is Ready.

Before, a due eviction stopped the node at once; with no spare, the replacement pod stayed
Pending and the survivors waited in the open rendezvous until ``join_timeout_s`` (1800 s), then
the Job failed (shared/reviews/checkpoint-tiers.md, "7. Stragglers"). Now rank 0 counts the
Ready pods of the spares' Deployment (``ops.cordon.ready_spares``) when a report would
evict; with none (or no answer) every rank trains on and rank 0 writes a
``straggler_eviction_deferred`` event; the first report that finds a spare evicts.

Real gloo ranks (spawned processes), real NVRx scoring, real ``kubernetes.client`` models for
the pod list. The API server itself cannot run here: the list call is answered by a stub that
returns what ``CoreV1Api.list_namespaced_pod`` returns (a ``V1PodList``).
Run: .venv/bin/pytest tests/training/resilience/test_straggler_spares.py -q
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from support import free_port

from ops import cordon

WORLD = 2


def _pod(*, ready: bool, deleting: bool = False) -> Any:
    from kubernetes import client

    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name="spare",
            deletion_timestamp=datetime.datetime.now(datetime.UTC) if deleting else None,
        ),
        status=client.V1PodStatus(
            conditions=[client.V1PodCondition(type="Ready", status="True" if ready else "False")]
        ),
    )


class PodListApi:
    """``CoreV1Api.list_namespaced_pod``'s answer, recorded with its arguments."""

    def __init__(self, pods: list[Any] | Exception) -> None:
        self.pods = pods
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any:
        from kubernetes import client

        self.calls.append((namespace, kwargs))
        if isinstance(self.pods, Exception):
            raise self.pods
        return client.V1PodList(items=self.pods)

    def patch_node(self, name: str, body: Any, **kwargs: Any) -> Any:
        raise AssertionError("not called here")


def test_the_selector_is_the_spare_deployments_pod_labels() -> None:
    from manifests import render

    (deployment,) = [
        o
        for o in render.spare_objects(overlay="2node", namespace="training", image="img")
        if o["kind"] == "Deployment"
    ]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert ",".join(f"{k}={v}" for k, v in labels.items()) == cordon.SPARE_SELECTOR


def test_the_trainer_may_list_the_pods_of_its_namespace() -> None:
    from manifests import render

    objects = {o["kind"]: o for o in render.spare_reader_objects(namespace="training")}
    assert objects["Role"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}
    ]
    assert objects["RoleBinding"]["subjects"][0]["name"] == render.SERVICE_ACCOUNT
    assert objects["RoleBinding"]["metadata"]["namespace"] == "training"


def test_ready_spares_counts_ready_pods_not_being_deleted(capsys) -> None:
    api = PodListApi(
        [_pod(ready=True), _pod(ready=False), _pod(ready=True, deleting=True), _pod(ready=True)]
    )
    assert cordon.ready_spares(api=api, namespace="training") == 2
    ((namespace, kwargs),) = api.calls
    assert namespace == "training" and kwargs["label_selector"] == cordon.SPARE_SELECTOR
    assert kwargs["_request_timeout"] == cordon.API_TIMEOUT_S
    failing = PodListApi(RuntimeError("403 Forbidden"))
    assert cordon.ready_spares(api=failing, namespace="training") is None
    assert "could not be counted" in capsys.readouterr().err


def _ranks(rank: int, out: str, port: int, spares_by_report: list[int | None]) -> None:
    import torch
    import torch.distributed as dist

    from training.config import StragglerConfig
    from training.resilience.straggler import StragglerHooks
    from training.runlog.metrics import EventLog

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    asked: list[int] = []
    answers = iter(spares_by_report)

    def spares() -> int | None:
        asked.append(1)
        return next(answers)

    events = EventLog(run_dir=Path(out), rank=rank)
    hooks = StragglerHooks(
        config=StragglerConfig(report_every=2, reports=1, threshold=0.5, evict=True),
        rank=rank,
        device=torch.device("cpu"),
        events=events,
        node=f"node-{rank}",
        spares=spares,
    )
    evicted_at = None
    for step in range(1, 2 * (len(spares_by_report) + 1) + 1):
        with hooks.timing("optimizer"):
            time.sleep(0.05 if rank == 1 else 0.005)  # rank 1 is 10x slower
        hooks.after_step(step)
        if hooks.eviction() is not None:
            evicted_at = step
            break
    hooks.close()
    events.flush()
    (Path(out) / f"rank{rank}.json").write_text(
        json.dumps({"evicted_at": evicted_at, "asked": len(asked)})
    )
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_eviction_waits_for_a_ready_spare(tmp_path: Path) -> None:
    """Reports at steps 2, 4, 6: no spare, no answer (an API error), then one spare. Both
    ranks train on through the first two and stop together at the third. (Failed before: both
    stopped at step 2, whatever the spares.)"""
    mp.start_processes(
        _ranks,
        args=(str(tmp_path), free_port(), [0, None, 1]),
        nprocs=WORLD,
        start_method="spawn",
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["evicted_at"] for r in results] == [6, 6]
    assert [r["asked"] for r in results] == [3, 0], "rank 0 asks, once per due report"
    rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    deferred = [r for r in rows if r["kind"] == "straggler_eviction_deferred"]
    assert [(r["step"], r["node"], r["ready_spares"]) for r in deferred] == [
        (2, "node-1", 0),
        (4, "node-1", None),
    ]
    assert "could not be counted" in deferred[1]["cause"]
    (eviction,) = [r for r in rows if r["kind"] == "straggler_eviction"]
    assert (eviction["step"], eviction["node"]) == (6, "node-1")

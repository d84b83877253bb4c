"""A run's verdict: why it stopped for good, left by a rank for the launchers to read.

A launcher (`torchrun`, `ft_launcher`) reports any failed worker as exit code 1, which would make
the Job replace the pod and try again. When a rank knows that a retry cannot help (no progress,
restart cap), it writes `<run_dir>/verdict.json` before it stops the workload; the pod's
supervisor and the local launcher then exit with the verdict's code (`training.exits`), which the
Job's pod failure policy turns into `FailJob`. Standard library only.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from training.durable import write_json_atomic
from training.runlog.files import VERDICT_FILE

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun and ft_launcher for their workers: the rendezvous id (unique per job)."""
NODE_NAME_ENV = "NODE_NAME"
"""The pod's node (the Job sets it from the downward API's ``spec.nodeName``, manifests/
render.py): named by the start-up check, the straggler reports and a node's verdict."""


@dataclass(frozen=True, kw_only=True)
class Verdict:
    code: int
    cause: str
    run_id: str
    node: str = ""
    """The node the verdict is about (a straggler's eviction), or "" for the whole run."""
    time: float = 0.0
    """When it was written (``time.time()`` of the writer, on the node it is about)."""


def current_run_id() -> str:
    return os.environ.get(RUN_ID_ENV, "")


def write_verdict(*, run_dir: Path, code: int, cause: str, run_id: str, node: str = "") -> None:
    """Atomically record the verdict of the run with rendezvous id `run_id` (about `node`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"code": code, "cause": cause, "run_id": run_id, "node": node, "time": time.time()}
    write_json_atomic(run_dir / VERDICT_FILE, record)


def read_verdict(*, run_dir: Path, run_id: str) -> Verdict | None:
    """The verdict of run `run_id`, if one was written (a verdict of an earlier job is ignored)."""
    try:
        data = json.loads((run_dir / VERDICT_FILE).read_text())
        verdict = Verdict(
            code=int(data["code"]),
            cause=str(data["cause"]),
            run_id=data["run_id"],
            node=str(data.get("node", "")),
            time=float(data.get("time", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return verdict if verdict.run_id == run_id else None

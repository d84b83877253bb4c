"""The one table of sizes every manifest is derived from.

`render.py` builds the Kubernetes objects from these rows, and the committed kustomize YAML
under `base/` and `overlays/` is generated from them (`python -m manifests.kustomize write`); a test
fails when the two drift apart. Change a size here, never in the YAML.
"""

from __future__ import annotations

from dataclasses import dataclass

from facts.hardware import P5_48XLARGE, NodeType
from training.modes import MODES, RESILIENT_MODES


@dataclass(frozen=True, kw_only=True)
class OverlaySize:
    """One overlay: how many nodes, which recipe, and the limits that grow with the job."""

    name: str
    """Overlay directory under `manifests/overlays/` and the suffix of the Job's name."""
    nodes: int
    """Nodes (= pods): the Job's parallelism and completions, and the launcher's --nnodes."""
    recipe: str
    """Trainer recipe (`python -m training train --recipe NAME`)."""
    node_type: NodeType = P5_48XLARGE
    restart: str = "nested"
    """Default restart layer: `nested` (in-process restarts inside ft_launcher: exceptions and
    soft hangs recover in the same processes, in seconds; dead or frozen ranks and lost pods are
    respawned by ft_launcher), `injob` (ft_launcher alone: every fault restarts the workers) or
    `inprocess` (torchrun, static ranks: a lost rank fails the pod). Nested is the default
    because it passed every fault of tests/training/resilience/test_resilience.py and tests/pods."""
    backoff_limit: int = 3
    """Pod failures (node loss, crash) the Job absorbs before it is marked failed."""
    grace_seconds: int = 600
    """terminationGracePeriodSeconds: time for the final checkpoint after SIGTERM."""
    train_args: tuple[str, ...] = ()
    """Extra trainer overrides, e.g. `--train.steps=100`."""
    spares: int = 0
    """Hot spare nodes the run keeps: joined, holding the trainer's image, running no rank
    (render.spare_objects: low-priority placeholder pods that a replacement trainer pod
    preempts). The GPU node group holds `nodes + spares` nodes (`node_count`)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"overlay {self.name}: nodes must be >= 1, got {self.nodes}")
        if self.spares < 0:
            raise ValueError(
                f"overlay {self.name}: spares must be >= 0 (0: no hot spare), got {self.spares}"
            )
        if self.restart not in RESTART_MODES:
            raise ValueError(
                f"overlay {self.name}: restart must be one of {RESTART_MODES}, got {self.restart!r}"
            )

    @property
    def job_name(self) -> str:
        return f"fsdp-{self.name}"

    @property
    def nproc_per_node(self) -> int:
        # One rank per GPU: derived, never set separately.
        return self.node_type.gpus

    @property
    def world_size(self) -> int:
        return self.nodes * self.node_type.gpus

    @property
    def node_count(self) -> int:
        """GPU nodes the node group holds for this overlay: the Job's nodes plus its spares."""
        return self.nodes + self.spares


RESTART_MODES = tuple(sorted(m for m in RESILIENT_MODES if not MODES[m].replica_groups))
"""The modes an overlay may run: every mode with a restart layer (``none`` leaves a fault to
the Job's ``backoffLimit``), in name order (``training.modes.MODES`` owns them). Not replica
groups: their ranks need the JobSet and the Lighthouse of ``manifests/replica.py``, which a
plain Indexed Job does not give them."""

SIZES: dict[str, OverlaySize] = {
    s.name: s
    for s in (
        # The smoke test: one node, a short run, quick to give up.
        OverlaySize(
            name="smoke",
            nodes=1,
            recipe="p5_smoke",
            backoff_limit=1,
            grace_seconds=300,
            train_args=("--train.steps=200",),
        ),
        # One spare each: the planner's rule (planner/spares.py: the fewest spares whose chance
        # of finding none is below 1 %, Erlang B with its failure model and a 4 h refill) gives
        # 1 at 2 and at 16 nodes, where a second failure inside one refill is rare. A spare is
        # 50 % more nodes at 2 and 6 % at 16: at 2 it buys the tested fast path, not goodput.
        OverlaySize(
            name="2node",
            nodes=2,
            recipe="p5_8b",
            backoff_limit=4,
            grace_seconds=600,
            spares=1,
        ),
        # 70B shards take longer to flush; a bigger fleet loses nodes more often.
        OverlaySize(
            name="16node",
            nodes=16,
            recipe="p5_70b",
            backoff_limit=16,
            grace_seconds=900,
            spares=1,
        ),
    )
}

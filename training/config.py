"""Typed run configuration: one small frozen dataclass per component.

Every field has a docstring-style comment and is validated in ``__post_init__``. A bad value
raises :class:`ConfigError` naming the field (``section.field``) and what is allowed; the CLI turns
it into one message and exit code 2. Overrides come from the command line as
``--section.field=value`` (see :func:`apply_overrides`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from training.exits import ConfigError
from training.faults import parse_faults
from training.modes import MODES, RestartMode, spec

CheckpointEngine = Literal["nvrx", "torch_async", "sync"]
ReplicaSemantics = Literal["wait", "shrink"]
REPLICA_SEMANTICS: tuple[str, ...] = typing.get_args(ReplicaSemantics)


def replica_min_groups(*, groups: int, semantics: str) -> int:
    """The fewest groups a step's quorum may have (the Lighthouse's ``--min_replicas``, the
    Manager's ``min_replica_size``): every group to wait, one to shrink (docs/replica-groups.md).
    The one derivation: the launcher, the manifests and the trainer call this."""
    return groups if semantics == "wait" else 1


def _require(condition: bool, section: str, name: str, problem: str) -> None:
    if not condition:
        raise ConfigError(f"{section}.{name}", problem)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the Llama-style decoder."""

    vocab_size: int = 256
    """Vocabulary size; 256 for the byte tokenizer used by the local corpus."""
    dim: int = 128
    """Hidden size (width of the residual stream)."""
    n_layers: int = 4
    """Number of transformer blocks; each block is one FSDP unit."""
    n_heads: int = 4
    """Attention (query) heads; ``dim`` must be divisible by it."""
    n_kv_heads: int = 2
    """Key/value heads for grouped-query attention; must divide ``n_heads``."""
    ffn_hidden: int = 0
    """SwiGLU hidden size; 0 derives Llama's ``8/3 * dim`` rounded up to ``multiple_of``."""
    multiple_of: int = 32
    """Rounding for the derived SwiGLU hidden size."""
    max_seq_len: int = 256
    """Longest sequence the rotary table covers; must be >= ``data.seq_len``."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        s = "model"
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            _require(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _require(
            self.dim % self.n_heads == 0,
            s,
            "n_heads",
            f"must divide model.dim={self.dim}, got {self.n_heads}",
        )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            s,
            "n_kv_heads",
            f"must divide model.n_heads={self.n_heads}, got {self.n_kv_heads}",
        )
        _require((self.dim // self.n_heads) % 2 == 0, s, "dim", "head dim must be even (rotary)")
        _require(self.ffn_hidden >= 0, s, "ffn_hidden", f"must be >= 0, got {self.ffn_hidden}")
        _require(self.multiple_of >= 1, s, "multiple_of", "must be >= 1")
        _require(self.rope_theta > 0, s, "rope_theta", "must be > 0")
        _require(0 < self.norm_eps < 1, s, "norm_eps", "must be in (0, 1)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokenized shards are and how samples are cut from them."""

    path: str = "data/stdlib"
    """Directory with ``meta.json`` and the shard files (``python -m training prepare``)."""
    seq_len: int = 128
    """Tokens per sample (each sample reads ``seq_len + 1`` tokens for the shifted target)."""
    shuffle: bool = True
    """Shuffle sample order per epoch with a seeded permutation (same on every rank)."""

    def __post_init__(self) -> None:
        _require(bool(self.path), "data", "path", "must not be empty")
        _require(self.seq_len >= 2, "data", "seq_len", f"must be >= 2, got {self.seq_len}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Length and batch shape of the run."""

    steps: int = 300
    """Optimizer steps to run in total (a resumed run continues up to this number)."""
    micro_batch_size: int = 8
    """Samples per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step. Global batch = micro * accum * world."""
    seed: int = 1234
    """Seeds model init and the data order; same seed, same run."""
    log_every: int = 10
    """Plain log line every N steps (the JSONL metrics file gets every step)."""
    progress: Literal["auto", "bar", "plain"] = "auto"
    """``auto``: a progress bar on a terminal, plain log lines in CI and pods."""

    def __post_init__(self) -> None:
        s = "train"
        for name in ("steps", "micro_batch_size", "grad_accum_steps", "log_every"):
            _require(getattr(self, name) >= 1, s, name, f"must be >= 1, got {getattr(self, name)}")
        _require(self.seed >= 0, s, "seed", f"must be >= 0, got {self.seed}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay, and gradient clipping."""

    lr: float = 3e-3
    """Peak learning rate reached after warm-up."""
    min_lr_ratio: float = 0.1
    """Cosine decays to ``lr * min_lr_ratio`` at ``train.steps``."""
    warmup_steps: int = 20
    """Linear warm-up steps from 0 to ``lr``."""
    weight_decay: float = 0.1
    """Decoupled weight decay (matrices only; norms are not decayed)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""

    def __post_init__(self) -> None:
        s = "optim"
        _require(self.lr > 0, s, "lr", f"must be > 0, got {self.lr}")
        _require(0 <= self.min_lr_ratio <= 1, s, "min_lr_ratio", "must be in [0, 1]")
        _require(self.warmup_steps >= 0, s, "warmup_steps", "must be >= 0")
        _require(self.weight_decay >= 0, s, "weight_decay", "must be >= 0")
        _require(0 <= self.beta1 < 1, s, "beta1", "must be in [0, 1)")
        _require(0 <= self.beta2 < 1, s, "beta2", "must be in [0, 1)")
        _require(self.eps > 0, s, "eps", "must be > 0")
        _require(self.grad_clip >= 0, s, "grad_clip", "must be >= 0 (0 = off)")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Device, precision and FSDP2 options. ``auto`` picks CUDA + NCCL + bf16 when a GPU exists,
    else CPU + gloo + fp32."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """FSDP2 MixedPrecisionPolicy: bf16 compute with fp32 reduce on CUDA, fp32 on CPU."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward to save memory."""
    activation_checkpointing_mode: Literal["full", "selective"] = "full"
    """With ``activation_checkpointing``: ``full`` recomputes the whole block in backward;
    ``selective`` keeps matmul and attention outputs and recomputes the rest (norms, rotary,
    pointwise), trading some memory for most of the recompute (training/parallel.py)."""
    compile: bool = False
    """``torch.compile`` each transformer block (in place, before FSDP; checkpoints unchanged).
    CUDA only here: on CPU, inductor needs a C++ toolchain and the gain is small."""
    loss_chunk_tokens: int = 0
    """Compute the loss over chunks of this many tokens, each chunk's logits recomputed in
    backward, so the logits of only one chunk exist at a time (training/model.py ``LMHead``);
    0 computes the whole micro-batch at once."""
    meta_init: bool = False
    """Build the model on the meta device and materialise only each rank's shard (large models)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3); False keeps them (ZeRO-2)."""
    cpu_threads: int = 1
    """torch intra-op threads per rank on CPU (ranks share the cores; 1 avoids oversubscription)."""
    pg_timeout_s: float = 600.0
    """Process-group (collective) timeout in seconds."""

    def __post_init__(self) -> None:
        s = "parallel"
        _require(self.cpu_threads >= 1, s, "cpu_threads", "must be >= 1")
        _require(self.pg_timeout_s > 0, s, "pg_timeout_s", "must be > 0")
        _require(self.loss_chunk_tokens >= 0, s, "loss_chunk_tokens", "must be >= 0 (0: off)")
        _require(
            self.activation_checkpointing_mode in ("full", "selective"),
            s,
            "activation_checkpointing_mode",
            f"must be full or selective, got {self.activation_checkpointing_mode!r}",
        )
        _require(
            not self.compile or self.device != "cpu",
            s,
            "compile",
            "torch.compile per block is for CUDA; leave it off with parallel.device=cpu",
        )


POD_MEMORY_DIR = "/dev/shm/fsdp-snapshots"
"""The default ``checkpoint.pod_memory_dir``: in the pod's memory-backed ``/dev/shm`` (the
``shm`` emptyDir of manifests/render.py); the local launcher's ranks share this machine's."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Sharded checkpoints on shared storage (FSx in the cluster, a local dir here)."""

    dir: str = ""
    """Checkpoint root; empty means ``<run_dir>/checkpoints``."""
    interval: int = 50
    """Save every N optimizer steps; 0 saves only the final (and SIGTERM) checkpoint."""
    engine: CheckpointEngine = "nvrx"
    """``nvrx``: NVRx async (persistent worker); ``torch_async``: torch DCP async_save
    (process); ``sync``: blocking DCP save."""
    keep_last: int = 3
    """Retention: keep the newest K committed checkpoints."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of M for good; 0 = off."""
    resume: bool = True
    """Resume from the newest committed checkpoint when one exists."""
    save_final: bool = True
    """Save (and commit) a checkpoint after the last step."""
    verify_on_load: bool = True
    """Check every shard's size and checksum against the commit record before loading."""
    peer_copy: bool = False
    """After each pod-memory snapshot, send it to the same local rank on the next node, which
    keeps it in its pod's memory: a replacement for a lost node restores from there instead of
    storage (training/checkpoint/peer.py). Needs ``memory_interval`` > 0; off, with the reason
    logged, on a job of one node (no other node to hold the copy)."""
    local_dir: str = ""
    """GPU only: node-local directory (the NVMe RAID0) for NVRx local checkpoints; empty = off."""
    local_interval: int = 0
    """GPU only: save a local checkpoint every N steps (between the shared ones); 0 = off."""
    memory_interval: int = 0
    """Every N steps each rank keeps a snapshot of its state in host memory (two slots), which
    a restart that keeps the pod (``resilience.restart`` injob, nested or inprocess) restores
    instead of the newest checkpoint on storage when it is newer; 0 = off. The snapshots live
    in ``pod_memory_dir`` (training/checkpoint/pod_memory.py), or in the process's memory when
    that is empty (in-process restarts only: training/checkpoint/memory.py)."""
    pod_memory_dir: str = POD_MEMORY_DIR
    """Where the snapshots live: a directory on a tmpfs that belongs to the pod (its
    memory-backed ``/dev/shm``), so that workers respawned in the same pod find them; each run
    gets its own subdirectory, removed when the run ends. Empty: in the process's memory."""

    def __post_init__(self) -> None:
        s = "checkpoint"
        _require(self.local_interval >= 0, s, "local_interval", "must be >= 0 (0 = off)")
        _require(
            not self.local_interval or bool(self.local_dir),
            s,
            "local_dir",
            "must be set when checkpoint.local_interval > 0 (e.g. /scratch/checkpoints)",
        )
        _require(self.interval >= 0, s, "interval", "must be >= 0 (0 = final only)")
        _require(self.memory_interval >= 0, s, "memory_interval", "must be >= 0 (0 = off)")
        _require(
            not self.peer_copy or self.memory_interval > 0,
            s,
            "peer_copy",
            "copies the pod-memory snapshots: set checkpoint.memory_interval > 0 as well",
        )
        _require(self.keep_last >= 1, s, "keep_last", f"must be >= 1, got {self.keep_last}")
        _require(self.keep_every >= 0, s, "keep_every", "must be >= 0 (0 = off)")


def _refuse_idle_tiers(*, checkpoint: CheckpointConfig, restart: str) -> None:
    """Refuse a configuration under which a checkpoint tier that is on never takes anything
    (each case: one message naming the field and the fix). The trainer's rules
    (training/trainer.py): a step saved to storage takes no local checkpoint; a memory
    snapshot is taken at every ``memory_interval`` step, save steps included; snapshots exist
    only in a restart mode that keeps the pod (``training.modes``). A run shorter than an
    interval is not refused: the same recipe runs for 5 steps as a smoke test (the launchers'
    ``--train.steps=5``) and for thousands in production."""
    c, s = checkpoint, "checkpoint"
    if c.peer_copy:
        _require(
            spec(restart).keeps_pod,
            s,
            "peer_copy",
            f"copies the pod-memory snapshots, which resilience.restart={restart} never takes "
            f"(only {', '.join(m for m, row in MODES.items() if row.keeps_pod)} do): set "
            "--restart to one of them, or "
            "checkpoint.peer_copy=false",
        )
        _require(
            bool(c.pod_memory_dir),
            s,
            "peer_copy",
            "copies the pod-memory snapshots, which checkpoint.pod_memory_dir='' keeps in "
            f"process memory instead: set checkpoint.pod_memory_dir={POD_MEMORY_DIR}, or "
            "checkpoint.peer_copy=false",
        )
    if c.local_interval and c.interval:
        fix = (
            f"set it to a value that is not a multiple of {c.interval} "
            f"(e.g. {c.interval // 2}), or 0 for none"
            if c.interval > 1
            else "checkpoint.interval=1 saves every step to storage: set it to 0"
        )
        _require(
            c.local_interval % c.interval != 0,
            s,
            "local_interval",
            f"every local checkpoint step (a multiple of {c.local_interval}) is a shared "
            f"save step (checkpoint.interval={c.interval}), which takes no local "
            f"checkpoint, so none is ever taken: {fix}",
        )


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """The restart layers and every timeout the launchers and the ranks use.

    This section is the one owner of the launcher's flags: `training.command` derives
    `ft_launcher`'s and `torchrun`'s command lines from it, locally and in the EKS Job.
    """

    restart: RestartMode = "none"
    """``none``; ``inprocess`` (NVRx Wrapper, same processes); ``injob`` (ft_launcher respawns);
    ``nested`` (the in-process Wrapper inside ft_launcher: exceptions and soft hangs recover in
    the same processes, dead or frozen ranks are respawned by the launcher)."""
    max_restarts: int = 3
    """Stop with a clear cause after this many restarts (of the layer that restarts)."""
    soft_timeout_s: float = 20.0
    """In-process: a rank that makes no progress for this long is treated as hung."""
    hard_timeout_s: float = 40.0
    """In-process: a rank still stuck this long after the soft timeout is killed."""
    heartbeat_timeout_s: float = 30.0
    """In-job: rank heartbeat timeout (ft_launcher kills and respawns a silent rank)."""
    initial_heartbeat_timeout_s: float = 90.0
    """In-job: the first heartbeat's timeout (process start, process group, checkpoint load)."""
    step_section_timeout_s: float = 60.0
    """In-job: longest a single training step may take before the rank is declared hung."""
    checkpoint_section_timeout_s: float = 300.0
    """In-job: longest a checkpoint load or save staging may take."""
    calibrate_timeouts_after: int = 0
    """After this many steps of an attempt, calibrate hang detection from the observed step
    times; 0 keeps the configured timeouts. In-job: the step section's timeout becomes
    max(hang_floor_s, NVRx's calculation: 5 x the longest step of any rank); heartbeat,
    checkpoint and out-of-section timeouts stay as configured (training/resilience/injob.py).
    In-process: a rank with no step boundary for max(hang_floor_s, 5 x p99 step time) raises
    (training/resilience/hang.py); the configured soft timeout stays as the backstop."""
    hang_floor_s: float = 2.0
    """At the floor of calibration, the longest a hang goes undetected (seconds), both layers:
    each detector's least timeout is this less its own latency, so its detection lands within
    it (in-process: twice the watchdog's 0.05 s poll, training/resilience/hang.py; in-job: the
    rank monitors' check interval, hang_floor_s / 4, training/command.py)."""
    stop_timeout_s: float = 10.0
    """A rank asked to stop (SIGTERM) that is still blocked (e.g. in a collective with a dead
    peer) after this long exits anyway; also ft_launcher's ``--workers-stop-timeout``."""
    term_timeout_s: float = 60.0
    """ft_launcher's ``--term-timeout``: after SIGTERM, time for the final checkpoint before the
    ranks are killed. In a pod it must fit in the grace period (the overlay sets it)."""
    join_timeout_s: float = 600.0
    """Rendezvous join timeout: how long the launchers wait for every node to arrive."""
    monitor_interval_s: float = 0.5
    """How often the launcher polls its workers."""
    replica_groups: int = 2
    """``restart=replica``: how many replica groups the job's ranks form (each group holds a
    whole FSDP2-sharded copy of the model; the job's world size divides into them)."""
    replica_wait_s: float = 600.0
    """``restart=replica``: how long the surviving groups wait at a step's quorum for a failed
    group to come back (waiting semantics: every group redoes the step, so the run stays
    bit-identical to a fault-free one). It must outlast a group's in-job restart."""
    replica_timeout_s: float = 60.0
    """``restart=replica``: torchft's timeout for one cross-group all-reduce, ``should_commit``
    and the heal's checkpoint transfer."""
    replica_semantics: ReplicaSemantics = "shrink"
    """``restart=replica``: what the surviving groups do when a group fails (default ``shrink``:
    its survivors' stall is the failure's detection, not the group's restart; the reasoning is
    in docs/replica-groups.md, "Which default"). ``wait``: no step
    without every group; they wait for it and redo the step (bit-identical to a fault-free
    run; the stall is the failed group's restart). ``shrink``: they go on with fewer groups
    (the global batch shrinks while it is out; the learning rate is unchanged, gradients are
    averaged over the groups present, the missing group's samples are skipped and recorded,
    ``replica_samples_skipped``); the stall is the failure's detection. docs/replica-groups.md.
    """

    @property
    def replica_min_groups(self) -> int:
        return replica_min_groups(groups=self.replica_groups, semantics=self.replica_semantics)

    def __post_init__(self) -> None:
        s = "resilience"
        _require(self.max_restarts >= 0, s, "max_restarts", "must be >= 0")
        _require(self.calibrate_timeouts_after >= 0, s, "calibrate_timeouts_after", "must be >= 0")
        for name in (
            "hang_floor_s",
            "soft_timeout_s",
            "hard_timeout_s",
            "heartbeat_timeout_s",
            "initial_heartbeat_timeout_s",
            "step_section_timeout_s",
            "checkpoint_section_timeout_s",
            "stop_timeout_s",
            "term_timeout_s",
            "join_timeout_s",
            "monitor_interval_s",
            "replica_wait_s",
            "replica_timeout_s",
        ):
            _require(getattr(self, name) > 0, s, name, "must be > 0")
        _require(self.replica_groups >= 1, s, "replica_groups", "must be >= 1")
        _require(
            self.replica_semantics in REPLICA_SEMANTICS,
            s,
            "replica_semantics",
            f"must be wait or shrink, got {self.replica_semantics!r}: set "
            "--resilience.replica_semantics=wait (survivors wait for a failed group) or "
            "=shrink (survivors go on with fewer groups)",
        )


@dataclass(frozen=True, kw_only=True)
class ObserveConfig:
    """The run's Prometheus exporter (``training/observe/exporter.py``, one per pod or local run)
    and the per-run thresholds it exports for the alert rules (``observability/alerts.yaml``)."""

    stall_factor: float = 50.0
    """N of the stall alert: the run counts as stalled after N x its calibrated step time (the
    median of its recent steps) without a step. It must outlast a restart's recovery
    (a checkpoint load), or every restart alerts."""
    stall_floor_s: float = 300.0
    """The stall alert's least threshold (seconds), whatever the step time: a run of fast steps
    still gets this long to recover from a restart before anyone is woken."""

    def __post_init__(self) -> None:
        s = "observe"
        _require(self.stall_factor >= 2, s, "stall_factor", "must be >= 2")
        _require(self.stall_floor_s > 0, s, "stall_floor_s", "must be > 0")


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Straggler detection (training/resilience/straggler.py): every ``report_every`` steps each
    rank's relative performance score (NVRx's straggler module: the best rank's median time over
    this rank's, 1.0 = as fast as the fastest) goes to events.jsonl, TensorBoard and the report,
    with the rank's node. With ``evict`` on, a node whose slowest rank scores below
    ``threshold`` in ``reports`` reports in a row is stopped with a final checkpoint and its
    ranks exit ``exits.NODE_UNFIT`` (the Job replaces the pod, on a spare when there is one)."""

    enabled: bool = True
    """Time the step and report scores (off: no timing, no extra collective)."""
    report_every: int = 20
    """Steps per report; each report is one all-reduce and one gather (plus one broadcast)."""
    threshold: float = 0.5
    """A rank scoring below this (2x slower than the fastest rank at 0.5) counts as slow."""
    reports: int = 3
    """Reports in a row a node must stay slow before it is evicted (M)."""
    evict: bool = False
    """The policy: stop a node that stays slow and exit ``NODE_UNFIT`` on its ranks."""

    def __post_init__(self) -> None:
        s = "straggler"
        _require(
            self.report_every >= 2, s, "report_every", f"must be >= 2, got {self.report_every}"
        )
        _require(
            0.0 < self.threshold < 1.0,
            s,
            "threshold",
            f"must be between 0 and 1 (exclusive), got {self.threshold}",
        )
        _require(self.reports >= 1, s, "reports", f"must be >= 1, got {self.reports}")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The whole run: one section per component."""

    recipe: str = "debug_cpu"
    """Name of the recipe these values started from."""
    run_dir: str = "runs/local"
    """Metrics, events, summary and (by default) checkpoints go here."""
    faults: str = ""
    """Fault injection spec (see training/faults.py), e.g. ``exception@rank1:step40``."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)

    def __post_init__(self) -> None:
        _require(bool(self.run_dir), "job", "run_dir", "must not be empty")
        _require(
            self.model.max_seq_len >= self.data.seq_len,
            "model",
            "max_seq_len",
            f"must be >= data.seq_len={self.data.seq_len}, got {self.model.max_seq_len}",
        )
        _refuse_idle_tiers(checkpoint=self.checkpoint, restart=self.resilience.restart)
        if self.faults:
            parse_faults(self.faults)  # now: a bad spec fails before any process starts

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or f"{self.run_dir}/checkpoints"


SECTIONS = (
    "model",
    "data",
    "train",
    "optim",
    "parallel",
    "checkpoint",
    "resilience",
    "straggler",
    "observe",
)
TOP_LEVEL = ("recipe", "run_dir", "faults")


def _coerce(path: str, raw: str, annotation: Any) -> Any:
    """Turn a command-line string into the field's type, with a message naming the field."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if raw not in allowed:
            raise ConfigError(path, f"must be one of {', '.join(allowed)}; got {raw!r}")
        return raw
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(path, "cannot be set from the command line")
    if annotation is bool:
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(path, f"must be true or false; got {raw!r}")
    if annotation is int:
        try:
            if "e" not in raw.lower():
                return int(raw)
            value = float(raw)  # 1e3 is an integer; 2.5e0 is not (never truncate silently)
            if not value.is_integer():
                raise ValueError(raw)
            return int(value)
        except ValueError:
            raise ConfigError(path, f"must be an integer; got {raw!r}") from None
    if annotation is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(path, f"must be a number; got {raw!r}") from None
    return raw


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def apply_overrides(config: JobConfig, overrides: dict[str, str]) -> JobConfig:
    """Return ``config`` with ``{"section.field": "value"}`` overrides applied and validated."""
    top: dict[str, Any] = {}
    per_section: dict[str, dict[str, Any]] = {}
    top_types = _field_types(JobConfig)
    for path, raw in overrides.items():
        if "." not in path:
            if path not in TOP_LEVEL:
                raise ConfigError(
                    path, f"unknown setting; use one of {', '.join(TOP_LEVEL)} or section.field"
                )
            top[path] = _coerce(path, raw, top_types[path])
            continue
        section, name = path.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(path, f"unknown section {section!r}; sections: {', '.join(SECTIONS)}")
        section_cls = type(getattr(config, section))
        types_ = _field_types(section_cls)
        if name not in types_:
            raise ConfigError(path, f"unknown field; {section} has: {', '.join(sorted(types_))}")
        per_section.setdefault(section, {})[name] = _coerce(path, raw, types_[name])
    changes: dict[str, Any] = dict(top)
    for section, values in per_section.items():
        changes[section] = dataclasses.replace(getattr(config, section), **values)
    return dataclasses.replace(config, **changes)


def to_dict(config: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)

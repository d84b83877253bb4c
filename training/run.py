"""One rank's run: process group, trainer, checkpoints, the loop, clean teardown.

``run_training`` is what every restart layer calls: directly (``--restart none``), inside NVRx's
in-process ``Wrapper`` (``inprocess``), or under ``ft_launcher`` (``injob``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from training.checkpoint.manager import CheckpointManager, needs_cpu_collectives
from training.command import COLD_RESTARTS_ENV
from training.config import JobConfig
from training.hooks import StepHooks
from training.parallel import DistEnv, dist_env_from_environment, init_process_group
from training.replica.trainer import trainer_for
from training.runlog.metrics import EventLog
from training.runlog.phases import MODEL_BUILT, PROCESS_GROUP_UP, emit_phase
from training.runlog.tensorboard import start_tailer
from training.runlog.verdict import current_run_id, write_verdict
from training.trainer import TrainResult

StepHooksFor = Callable[[DistEnv, EventLog], StepHooks]
"""Builds an attempt's step hooks once it knows who it is (rank, device) and where its events
go: every hook the loop and the checkpoint manager call comes from the restart layer
(``training.resilience.step_hooks.step_hooks_for``: its own, the faults, the straggler policy)."""

# Checkpoint managers of attempts that did not finish cleanly. A fault can interrupt the clean-up
# in ``run_training``'s ``finally`` (in-process restart raises asynchronously into the main
# thread), so the next attempt finishes it first: see ``release_leftovers``.
_LEFTOVERS: list[CheckpointManager] = []


def freeze_imported_objects() -> None:
    """Move every object alive now (the imports: torch, NVRx, ~260k objects) into the
    collector's permanent generation, once per process, before the first attempt builds
    anything. A full collection then skips them: 0.11 s each on this machine before, ~0 after.
    NVRx's wrapper collects until nothing is left between in-process attempts
    (``while gc.collect()``, 0.4.1 ``wrap.py``), and a gen-2 collection in the loop stalls a
    step the same way. Per-attempt objects (model, optimizer, data) are created later, so they
    stay collectable and an in-process restart still frees the previous attempt's."""
    if gc.get_freeze_count() == 0:
        gc.freeze()


def release_leftovers() -> None:
    """Idempotent clean-up of an interrupted attempt: stop its checkpoint worker and end its
    process group, so the next attempt starts from nothing."""
    while _LEFTOVERS:
        _LEFTOVERS.pop().abandon()
    release_process_group_after_fault()


def _has_nccl_backend() -> bool:
    """Whether the default process group runs its CUDA collectives on NCCL."""
    if not dist.is_nccl_available():
        return False
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
    except RuntimeError:  # no CUDA backend in this group
        return False
    return isinstance(backend, dist.ProcessGroupNCCL)


def release_process_group_after_fault() -> None:
    """End the process group of a failed attempt without waiting on its peers.

    With NCCL, ``destroy_process_group`` shuts the communicators down gracefully, which waits
    for the collectives in flight: on a failing rank whose peers are stuck, or gone, it can
    hang before NVRx's monitor thread ever aborts anything. So NCCL groups are aborted first,
    all at once (torch's ``_abort_process_group``: every group's backends inside one NCCL
    group call, then its bookkeeping is cleared as ``destroy_process_group`` would; present in
    torch 2.11 and 2.13). gloo groups have no abort; destroying them waits on nothing."""
    if not dist.is_initialized():
        return
    if _has_nccl_backend():
        dist.distributed_c10d._abort_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_training(
    config: JobConfig,
    *,
    hooks: StepHooksFor | None = None,
    attempt: int = 0,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> TrainResult:
    env = dist_env_from_environment(
        config.parallel, cpu_collectives=needs_cpu_collectives(config.checkpoint)
    )
    if rank is not None and world_size is not None:
        env = type(env)(
            rank=rank,
            world_size=world_size,
            local_rank=env.local_rank,
            device=env.device,
            backend=env.backend,
        )
    freeze_imported_objects()
    run_dir = Path(config.run_dir)
    events = EventLog(run_dir=run_dir, rank=env.rank)
    start_tailer(run_dir=run_dir, rank=env.rank)  # TensorBoard scalars: rank 0, when installed
    owns_process_group = not dist.is_initialized()
    if owns_process_group:
        init_process_group(env, timeout_s=config.parallel.pg_timeout_s, store=store)
    # Attempts count across whole-job relaunches too (the local launcher's cold restarts).
    attempt += int(os.environ.get(COLD_RESTARTS_ENV, "0"))
    if env.rank == 0 and attempt == 0:
        events.emit("run_start", world_size=env.world_size, restart_mode=config.resilience.restart)
    events.emit("attempt_start", attempt=attempt)
    mode = config.resilience.restart
    emit_phase(events, phase=PROCESS_GROUP_UP, attempt=attempt, mode=mode)
    completed = False
    try:
        step_hooks = hooks(env, events) if hooks is not None else StepHooks()
        checkpoints = CheckpointManager.for_job(
            config=config,
            rank=env.rank,
            world_size=env.world_size,
            events=events,
            point_hook=step_hooks.checkpoint_point,
            keepalive=step_hooks.keepalive,
        )
        resume = checkpoints.resume_expected()
        trainer = trainer_for(config)(
            config=config,
            env=env,
            events=events,
            hooks=[step_hooks],
            attempt=attempt,
            initialize=not resume,
        )
        emit_phase(
            events, phase=MODEL_BUILT, attempt=attempt, mode=mode, weights_initialized=not resume
        )
        _LEFTOVERS.append(checkpoints)
        # Checkpoint I/O, like the load: the torn-checkpoint sweep and a barrier. The NVRx
        # worker is spawned after the first step (``prepare``), off the restart's critical
        # path; it imports torch (seconds) during the next steps, whose polls find it ready
        # (only a save scheduled before then waits for it, in its checkpoint_save section).
        with step_hooks.section("checkpoint_start"):
            checkpoints.start()
        try:
            result = trainer.fit(checkpoints=checkpoints)
        finally:
            step_hooks.loop_ended()
        if result.eviction is not None and result.eviction.this_node:
            # For the pod's supervisor and the local launcher: this node's pod exits NODE_UNFIT.
            # Written before the clean-up below, which a restart could interrupt.
            write_verdict(
                run_dir=run_dir,
                code=result.exit_code,
                cause=result.eviction.cause,
                run_id=current_run_id(),
                node=result.eviction.node,
            )
        step_hooks.finished(result)
        checkpoints.close()
        _LEFTOVERS.remove(checkpoints)
        completed = True
        if env.rank == 0 and not result.preempted:
            events.emit("run_end", step=result.final_step, status="completed", cause=None)
        return result
    finally:
        if not completed:
            # A fault: stop the background writer without collectives (peers may be gone).
            release_leftovers()
        elif owns_process_group and dist.is_initialized():
            # A process that exits with a live gloo group can abort in its destructor.
            dist.destroy_process_group()

"""The training loop: AdamW, warm-up + cosine, clipping, accumulation, checkpoints, metrics.

``Trainer`` is ``Stateful``: its ``state_dict`` is the whole resumable state (model and optimizer
shards, sampler position, RNG, step; the LR schedule is a function of the step), saved and
loaded by torch.distributed.checkpoint through ``training.checkpoint``. Resilience layers
(training/resilience/) wrap ``run_training``; the loop itself only exposes hooks
(``training.hooks.StepHooks``: restart layers' heartbeats and sections, injected faults) so it
stays the same under every layer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from training import exits
from training.checkpoint.manager import CheckpointManager
from training.config import JobConfig
from training.data import BatchLayout, ResumableSampler, TokenShards
from training.hooks import HookChain, NodeEviction, StepHooks
from training.model import Transformer, flops_per_token
from training.parallel import (
    DistEnv,
    build_sharded_model,
    initialize_weights,
    set_cpu_threads,
)
from training.runlog.metrics import EventLog, StepLogger, peak_flops_for
from training.runlog.phases import (
    CHECKPOINT_LOADED,
    DETECTED,
    FIRST_STEP,
    SURVIVORS_STOPPED,
    emit_phase,
)
from training.stop import StopRequest

STOP_GRACE_FLOOR_S = 2.0
"""On SIGTERM, the least time a rank gets to reach its next step boundary (see fit)."""


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine down to ``peak*min_ratio``."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (min_ratio + (1.0 - min_ratio) * cosine)


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    final_step: int
    final_loss: float | None
    preempted: bool
    eviction: NodeEviction | None = None
    """Set when the run stopped because a node was evicted (straggler policy)."""

    @property
    def exit_code(self) -> int:
        """The rank's exit code: ``NODE_UNFIT`` on an evicted node (the Job replaces its pod),
        ``PREEMPTED`` for any other stop after a final checkpoint, ``OK`` when the run is done."""
        if self.eviction is not None and self.eviction.this_node:
            return exits.NODE_UNFIT
        return exits.PREEMPTED if self.preempted else exits.OK


@dataclass(frozen=True, kw_only=True)
class StopReason:
    """Why the loop stops before the run's end, after a final checkpoint: a node evicted
    (straggler policy, decided on every rank at the same step) or a drain (SIGTERM on some
    rank, agreed through the step's all-reduce)."""

    status: str
    """``run_end``'s status: ``evicted`` or ``preempted``."""
    cause: str
    eviction: NodeEviction | None = None

    @classmethod
    def of(cls, *, eviction: NodeEviction | None, drained: bool) -> StopReason | None:
        if eviction is not None:
            return cls(status="evicted", cause=eviction.cause, eviction=eviction)
        if drained:
            return cls(status="preempted", cause="SIGTERM: final checkpoint committed")
        return None


class Trainer:
    def __init__(
        self,
        *,
        config: JobConfig,
        env: DistEnv,
        events: EventLog,
        hooks: Sequence[StepHooks] = (),
        attempt: int = 0,
        initialize: bool = True,
    ) -> None:
        """``initialize=False`` when a checkpoint is about to be loaded (resume): the weights are
        not initialised first, unless the load finds nothing after all (see ``fit``)."""
        self.config = config
        self.env = env
        self.events = events
        self.hooks = HookChain(hooks)
        self.attempt = attempt
        self.step = 0
        set_cpu_threads(config.parallel, env)

        self.model, self.mesh = build_sharded_model(
            self._model_factory,
            config=config.parallel,
            env=env,
            seed=config.train.seed,
            initialize=initialize,
        )
        self.weights_initialized = initialize
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (decay if param.ndim >= 2 and "embeddings" not in name else no_decay).append(param)
        o = config.optim
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": o.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            # foreach on DTensors works on CPU and GPU; fused needs CUDA.
            fused=env.is_cuda or None,
            foreach=None if env.is_cuda else True,
        )
        self.shards = TokenShards(
            path=Path(config.data.path),
            seq_len=config.data.seq_len,
            vocab_size=config.model.vocab_size,
        )
        self.layout = self._batch_layout()
        self.sampler = ResumableSampler(
            num_samples=self.shards.num_samples,
            layout=self.layout,
            seed=config.train.seed,
            shuffle=config.data.shuffle,
        )
        self.tokens_per_step = self.layout.global_batch * config.data.seq_len
        self.flops_per_token = flops_per_token(config.model, seq_len=config.data.seq_len)
        self.peak_flops = peak_flops_for(
            torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
        )
        self._stats_host: torch.Tensor | None = None
        """Pinned host copy of the step's stats (GPU only, see ``_stats_to_host``)."""
        self.before_update: Any = lambda: None
        """Called before the optimizer's in-place update (``fit`` sets the checkpoint
        manager's: the newest memory snapshot's copies finish first)."""

    def _model_factory(self) -> Transformer:
        return Transformer(self.config.model)

    def _batch_layout(self) -> BatchLayout:
        """Which share of every global batch this rank reads: its rank among the job's ranks
        (a replica group's trainer spans every group's ranks instead)."""
        t = self.config.train
        return BatchLayout(
            world_size=self.env.world_size,
            rank=self.env.rank,
            micro_batch_size=t.micro_batch_size,
            grad_accum_steps=t.grad_accum_steps,
        )

    # -- Stateful ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "sampler": self.sampler.state_dict(),
            "step": self.step,
            # Same on every rank (same seed, no per-rank randomness), so saved once, replicated.
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=True),
        )
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])

    def begin_step(self) -> None:
        """Called at the top of every iteration of ``fit``, before the step's number is taken:
        where a layer that may replace the state between steps does it (replica groups: the
        step's quorum, and a heal from a peer group, ``training/replica/trainer.py``)."""

    # -- one optimizer step ----------------------------------------------------------------------
    def _lr(self, step: int) -> float:
        o = self.config.optim
        return lr_at(
            step,
            peak=o.lr,
            warmup=o.warmup_steps,
            total=self.config.train.steps,
            min_ratio=o.min_lr_ratio,
        )

    def train_step(self) -> torch.Tensor:
        lr = self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro_batches = self.sampler.next_step()
        accum = len(micro_batches)
        loss_sum = torch.zeros((), device=self.env.device)
        for index, indices in enumerate(micro_batches):
            batch = self.shards.batch(indices).to(self.env.device, non_blocking=True)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            # Only the last micro-batch reduces gradients across ranks.
            self.model.set_requires_gradient_sync(index == accum - 1)
            chunk = self.config.parallel.loss_chunk_tokens
            with self.hooks.timing("forward"):
                loss = self.model(inputs, targets, loss_chunk_tokens=chunk) / accum
            with self.hooks.timing("backward"):
                loss.backward()
            loss_sum += loss.detach()
        if self.config.optim.grad_clip > 0:
            with self.hooks.timing("communication"):  # the gradient norm's all-reduce
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
        self.before_update()  # a memory snapshot's copies on a GPU read the old state
        with self.hooks.timing("optimizer"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum

    def reduce_step_stats(self, loss: torch.Tensor, *, stop_requested: bool) -> tuple[float, bool]:
        """One small all-reduce per step: the mean loss, and whether any rank got SIGTERM (so
        every rank stops at the same step)."""
        stats = torch.empty(2, dtype=torch.float32, device=loss.device)
        stats[0] = loss  # device to device
        stats[1].fill_(float(stop_requested))  # a fill kernel: no host-to-device copy
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)  # gloo has no AVG
        loss_sum, stops = self._stats_to_host(stats)
        return loss_sum / self.env.world_size, stops > 0

    def _stats_to_host(self, stats: torch.Tensor) -> list[float]:
        """The one synchronization of the step: a non-blocking copy into a pinned buffer, then
        one wait for it on a GPU (was two ``.item()`` calls, each a sync with a pageable copy)."""
        if stats.device.type != "cuda":
            return stats.tolist()
        if self._stats_host is None:  # pinned once; every step waits for its copy before reuse
            self._stats_host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        self._stats_host.copy_(stats, non_blocking=True)  # after the all-reduce, same stream
        torch.cuda.current_stream(stats.device).synchronize()
        return self._stats_host.tolist()

    # -- the loop --------------------------------------------------------------------------------
    def _stop(
        self,
        reason: StopReason,
        *,
        stop: StopRequest,
        checkpoints: CheckpointManager,
        loss: float | None,
    ) -> TrainResult:
        """Stop before the run's end: a final checkpoint (blocking, no grace deadline), then
        ``run_end`` with the reason."""
        stop.saving()
        with self.hooks.section("checkpoint_save"):
            checkpoints.save(self, step=self.step, blocking=True)
        self.events.emit("run_end", step=self.step, status=reason.status, cause=reason.cause)
        return TrainResult(
            final_step=self.step, final_loss=loss, preempted=True, eviction=reason.eviction
        )

    def fit(self, *, checkpoints: CheckpointManager) -> TrainResult:
        c = self.config
        slowest_iteration_s = 0.0
        # On SIGTERM the loop has this long to reach a step boundary (where it takes the final
        # checkpoint); a rank stuck in a collective exits 143 instead (training/stop.py). The
        # grace bounds a step, not the work between two steps: from a step's all-reduce to the
        # next step's start (the log, the hooks, the first-step prepare, the poll, the
        # checkpoint schedule: saves, snapshot takes, the peer exchange) the rank is at a
        # boundary, and the grace runs from its latest progress there (stop.progress: the
        # all-reduce, each pass of a checkpoint wait, each piece of the schedule, the boundary's
        # end), so the next step gets all of it. An all-reduce that agrees on the stop is the
        # stop's boundary: no deadline from there. A boundary collective with a dead peer shows
        # no progress and still ends at the grace.
        mode = c.resilience.restart
        stop = StopRequest(
            grace_s=lambda: max(STOP_GRACE_FLOOR_S, 2.0 * slowest_iteration_s),
            # SIGTERM: a launcher saw a fault elsewhere (or a drain began); a forced exit is
            # this survivor leaving its stuck step.
            on_signal=lambda: emit_phase(
                self.events, phase=DETECTED, attempt=self.attempt + 1, mode=mode
            ),
            on_forced_exit=lambda: (
                emit_phase(
                    self.events, phase=SURVIVORS_STOPPED, attempt=self.attempt + 1, mode=mode
                ),
                self.events.flush(),  # os._exit follows: no atexit
            ),
        )
        logger = None
        self.before_update = checkpoints.before_update
        try:
            stop.install()
            with self.hooks.section("checkpoint_load"):
                loaded = checkpoints.load_latest(self)
            if loaded is None and not self.weights_initialized:
                initialize_weights(
                    self.model,
                    self._model_factory,
                    config=c.parallel,
                    seed=c.train.seed,
                )
                self.weights_initialized = True
            emit_phase(self.events, phase=CHECKPOINT_LOADED, attempt=self.attempt, mode=mode)
            start_step = self.step
            if self.env.rank == 0:
                logger = StepLogger(
                    run_dir=Path(c.run_dir),
                    total_steps=c.train.steps,
                    start_step=start_step,
                    log_every=c.train.log_every,
                    progress=c.train.progress,
                    attempt=self.attempt,
                )
            loss = None
            # This attempt's first step, by count: a replica group that heals from a peer in
            # begin_step jumps self.step past start_step + 1.
            steps_this_attempt = 0
            while self.step < c.train.steps:
                iteration_started = time.perf_counter()
                self.begin_step()
                next_step = self.step + 1
                self.hooks.before_step(next_step)
                started = time.perf_counter()
                with self.hooks.timing("step"):
                    local_loss = self.train_step()
                with self.hooks.timing("communication"):
                    loss, stop_now = self.reduce_step_stats(
                        local_loss, stop_requested=stop.requested
                    )
                if stop_now:
                    stop.saving()  # every rank stops at this step: the rest is its checkpoint's
                else:
                    stop.progress()
                self.step = next_step
                steps_this_attempt += 1
                elapsed = time.perf_counter() - started
                if steps_this_attempt == 1:
                    emit_phase(self.events, phase=FIRST_STEP, attempt=self.attempt, mode=mode)
                if logger is not None:
                    logger.log(
                        step=self.step,
                        loss=loss,
                        lr=self._lr(self.step - 1),
                        step_time_s=elapsed,
                        tokens=self.tokens_per_step,
                        flops_per_token=self.flops_per_token,
                        peak_flops=self.peak_flops,
                        world_size=self.env.world_size,
                    )
                self.hooks.after_step(self.step)
                eviction = self.hooks.eviction()  # decided on every rank at this same step
                if steps_this_attempt == 1:
                    # Out of the step section (it calibrates the hang timeout): the save
                    # plan and the staging buffer (collective).
                    with self.hooks.section("checkpoint_start"):
                        checkpoints.prepare(self)  # the optimizer state exists from here on
                checkpoints.poll()
                reason = StopReason.of(eviction=eviction, drained=stop_now)
                if reason is not None:
                    return self._stop(reason, stop=stop, checkpoints=checkpoints, loss=loss)
                if self.step < c.train.steps:  # the run's last step: the final save below
                    checkpoints.after_step(self, step=self.step, section=self.hooks.section)
                slowest_iteration_s = max(
                    slowest_iteration_s, time.perf_counter() - iteration_started
                )
                stop.progress()  # the boundary's end: the next step gets the whole grace
            stop.saving()  # the run is over: the last save and the commit wait have no deadline
            if c.checkpoint.save_final and checkpoints.latest_step() != self.step:
                with self.hooks.section("checkpoint_save"):
                    checkpoints.save(self, step=self.step, blocking=True)
            checkpoints.wait()
            return TrainResult(final_step=self.step, final_loss=loss, preempted=False)
        finally:
            stop.uninstall()
            if logger is not None:
                logger.close()

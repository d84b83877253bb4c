"""The trainer of one replica group: FSDP2 inside the group, torchft's ``Manager`` across groups.

HSDP the way torchft's own FSDP test wires it (``torchft/fsdp_test.py``): ``fully_shard`` on the
group's 1-D mesh, and each FSDP unit's ``set_all_reduce_hook`` (torch
``_fully_shard.py``; the hook runs on the reduce-scatter output, ``_fsdp_collectives.py``)
averages that shard across the groups with ``Manager.allreduce`` (a SUM divided by the
quorum's participants, ``torchft/manager.py``). Rank ``r`` of every group holds the same shard,
so the replicate dimension is one torchft process group per group rank.

Every step (``resilience.replica_semantics``; docs/replica-groups.md):

1. ``Manager.start_quorum`` (synchronous: ``use_async_quorum=False``) at the top of ``fit``'s
   iteration (``Trainer.begin_step``). Waiting semantics: the Lighthouse forms no quorum with
   fewer than every group (``--min_replicas``), so survivors of a failed group wait here for
   it. Shrinking semantics (``--min_replicas=1``): the survivors' quorum forms without it once
   the Lighthouse has stopped hearing from it, and they go on. A group that
   restarted is behind the quorum's ``max_step``: torchft heals it from a live peer (the
   peer's ``state_dict`` over its ``HTTPTransport``, ``Manager._async_quorum``) and applies it
   in the main thread (``_apply_pending_state_dict``) before the step runs.
2. forward/backward; the all-reduce hook averages gradients across groups.
3. ``Manager.should_commit`` before the optimizer update (``_CommitGate``): False on every rank
   of a group when any of its ranks saw a failed cross-group collective. The step is then
   discarded (no update, gradients dropped, sampler and RNG rewound) and redone after a new
   quorum: with the failed group back (waiting: the run stays bit-identical to a fault-free
   one), or without it (shrinking).

Shrinking semantics, exactly: the learning rate is unchanged (the schedule is a function of
the step, and the step's gradient is still a mean over samples: an unbiased estimate from a
smaller batch); the gradient is averaged over the groups present (``Manager.allreduce``: a
SUM divided by ``num_participants()``, ``torchft/manager.py``); the missing groups' samples of
each step committed without them are skipped, never replayed, and written down by the lowest
group present (``replica_samples_skipped``: the missing group, the step, the sampler position,
the sample indices each of its ranks would have read), so nothing is lost silently. Every
group's sampler advances by the whole global batch each step, so no sample is read twice, and
a rejoining group heals to its peers' step and sampler position.

Data: the sampler's layout spans every group (``world = groups x group size``, rank
``group x group size + rank``), so each group reads its own deterministic share of each global
batch; the sampler's position travels with the healed state.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from training.config import JobConfig
from training.data import BatchLayout, ResumableSampler
from training.modes import spec
from training.replica.topology import ReplicaTopology
from training.trainer import Trainer

STORE_KEY = "replica/manager_store"
WAITING_EVENT_S = 2.0
"""A quorum that has not formed after this long is a wait for a group that is out (or slow): the
ranks say so once (``replica_waiting``, with the wait's start), so the exporter can tell how
long a group has been out while it still is (``training/runlog/replica.py``). A quorum of groups
that are all in and in step forms in milliseconds; a rejoin adds the Lighthouse's
``--join_timeout_ms`` (1 s)."""


def trainer_for(config: JobConfig) -> Callable[..., Trainer]:
    """The trainer class of a run: ``ReplicaTrainer`` bound to its group for a mode with replica
    groups (``training.modes.ModeSpec.replica_groups``), else ``Trainer``."""
    if not spec(config.resilience.restart).replica_groups:
        return Trainer
    topology = ReplicaTopology.from_environment(groups=config.resilience.replica_groups)
    return partial(ReplicaTrainer, topology=topology)


def replica_layout(
    *,
    topology: ReplicaTopology,
    group_size: int,
    rank: int,
    micro_batch_size: int,
    grad_accum_steps: int,
) -> BatchLayout:
    """The batch layout of group rank ``rank``: one data-parallel world across every group, so
    each group reads its own share of each global batch (group ``g``'s ranks hold positions
    ``g * group_size .. (g + 1) * group_size - 1``) and the global batch is the same as a run
    of ``groups x group_size`` plain data-parallel ranks."""
    return BatchLayout(
        world_size=topology.groups * group_size,
        rank=topology.group * group_size + rank,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
    )


def samples_at(*, sampler: ResumableSampler, position: int) -> tuple[int, list[int]]:
    """The samples ``sampler``'s rank reads in the step at sampler ``position``, as ``(epoch,
    indices)``: an index names a sample within its epoch (each epoch is a new permutation of the
    same indices), so the pair names it in the run. A step never spans two epochs (an epoch is
    whole global batches)."""
    sampler.consumed_samples = position
    epoch = position // sampler.epoch_len
    return epoch, [i for micro in sampler.next_step() for i in micro]


def _manager_store() -> tuple[str, int]:
    """A TCPStore for this group's torchft Manager, fresh per attempt, hosted by group rank 0.

    The Manager keeps its server's address in the store it is given (``MANAGER_ADDR_KEY``).
    ft_launcher's agent store outlives a restart of the group's workers, so an old attempt's
    address would still be there; the default group's store is prefixed per attempt (torch's
    env rendezvous), so it carries the address of this fresh store instead."""
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        host = socket.gethostname()
        server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _KEEP.append(server)
        store.set(STORE_KEY, f"{host}:{server.port}")
    host, port = store.get(STORE_KEY).decode().rsplit(":", 1)
    return host, int(port)


_KEEP: list[dist.TCPStore] = []
"""The Manager stores this process hosts (alive as long as the process)."""


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


class _CommitGate:
    """The optimizer as ``Trainer.train_step`` calls it, with torchft's commit decision in front
    of the update (what ``torchft.optim.OptimizerWrapper.step`` does; its ``zero_grad`` would
    also start the next quorum, which here is ``begin_step``'s)."""

    def __init__(self, optimizer: torch.optim.Optimizer, manager: Any) -> None:
        self.optimizer = optimizer
        self.manager = manager
        self.committed = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> None:
        self.committed = self.manager.should_commit()
        if self.committed:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def group_of(replica_id: str) -> int | None:
    """The group of a torchft replica id (``group<g>:<uuid>``: ``replica_id`` below, to which
    the ``Manager`` appends a uuid per process)."""
    name = replica_id.split(":", 1)[0]
    return int(name[5:]) if name.startswith("group") and name[5:].isdigit() else None


class _QuorumMembers:
    """The Manager's client, keeping the groups of the last quorum it returned.

    torchft's ``QuorumResult`` lists the quorum's ``replica_ids`` (``torchft/_torchft.pyi``),
    but ``Manager._async_quorum`` keeps only their count (``num_participants``); the shrinking
    semantics needs to know which groups are out (whose samples a step skipped)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.groups: frozenset[int] = frozenset()

    def _quorum(self, **kwargs: Any) -> Any:
        result = self._client._quorum(**kwargs)
        self.groups = frozenset(
            g for g in (group_of(r) for r in result.replica_ids) if g is not None
        )
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class ReplicaTrainer(Trainer):
    _shrink = False
    """``resilience.replica_semantics == "shrink"`` (set in ``__init__``)."""

    def __init__(self, *, topology: ReplicaTopology, **kwargs: Any) -> None:
        self.topology = topology  # before Trainer's: its data layout (_batch_layout) reads it
        super().__init__(**kwargs)
        from torchft import Manager, ProcessGroupBabyNCCL, ProcessGroupGloo

        env, r = self.env, self.config.resilience
        timeout = timedelta(seconds=r.replica_timeout_s)
        # NCCL in a subprocess on GPUs (torchft's recommendation for aborting a stuck
        # communicator); gloo on CPU.
        pg = (
            ProcessGroupBabyNCCL(timeout=timeout)
            if env.is_cuda
            else ProcessGroupGloo(timeout=timeout)
        )
        host, port = _manager_store()
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load_heal_state,
            state_dict=self._heal_state,
            min_replica_size=r.replica_min_groups,  # wait: every group; shrink: one
            use_async_quorum=False,  # heal before the step, in the main thread
            timeout=timeout,
            quorum_timeout=timedelta(seconds=r.replica_wait_s),
            connect_timeout=timeout,
            rank=env.rank,
            world_size=env.world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=topology.lighthouse,
            replica_id=f"group{topology.group}",
            # What the other groups dial for the heal (EKS: the pod IP, render's POD_IP env).
            hostname=os.environ.get("POD_IP") or socket.gethostname(),
            init_sync=False,  # every group initialises the same weights from the same seed
        )
        # Private in torchft 2026.10.26 (the pinned version): the client the quorum goes through.
        self._members = _QuorumMembers(self.manager._client)
        self.manager._client = self._members
        self._shrink = r.replica_semantics == "shrink"
        self._missing_samplers: dict[int, ResumableSampler] = {}
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self._average_across_groups)
        self._participants = 0
        self._quorum_id: int | None = None
        self._healed: tuple[int, int] | None = None  # (step, bytes) of the last heal

    def _batch_layout(self) -> BatchLayout:
        t = self.config.train
        return replica_layout(
            topology=self.topology,
            group_size=self.env.world_size,
            rank=self.env.rank,
            micro_batch_size=t.micro_batch_size,
            grad_accum_steps=t.grad_accum_steps,
        )

    # -- across groups -----------------------------------------------------------------------
    def _average_across_groups(self, reduce_output: torch.Tensor) -> None:
        self.manager.allreduce(reduce_output).wait()

    def _heal_state(self) -> dict[str, Any]:
        """What a recovering group takes from this one: this rank's shards as plain tensors
        (peer rank ``r`` holds the same shard), the sampler's position, the step, the RNG."""
        optim = [
            {key: _local(value) for key, value in self.optimizer.state.get(p, {}).items()}
            for p in self.model.parameters()
        ]
        return {
            "params": [_local(p.data) for p in self.model.parameters()],
            "optim": optim,
            "sampler": self.sampler.state_dict(),
            "step": self.step,
            "rng": torch.get_rng_state(),
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        nbytes = 0
        with torch.no_grad():
            for p, value in zip(self.model.parameters(), state["params"], strict=True):
                _local(p.data).copy_(value)
                nbytes += value.numel() * value.element_size()
            for p, saved in zip(self.model.parameters(), state["optim"], strict=True):
                current = self.optimizer.state.setdefault(p, {})
                for key, value in saved.items():
                    nbytes += value.numel() * value.element_size()
                    if key in current:
                        _local(current[key]).copy_(value)
                    elif isinstance(p.data, DTensor) and value.dim() > 0:
                        current[key] = DTensor.from_local(
                            value.clone().to(p.device),
                            device_mesh=p.data.device_mesh,
                            placements=p.data.placements,
                            run_check=False,
                            shape=p.data.shape,
                            stride=p.data.stride(),
                        )
                    else:
                        current[key] = value.clone()
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])
        self._healed = (self.step, nbytes)

    def _quorum(self) -> tuple[float, bool, bool]:
        """One quorum (and heal, if this group is behind); its changes to events.jsonl.
        Returns (seconds it took, whether it waited for a group that was out: a long wait that
        ended in a quorum of new members, whether this group healed in it). A long wait in the
        same quorum was for a slow group (a checkpoint save, a restarted group's first steps):
        seen in the fault test, 5 and 25 s after the heal, with the quorum id unchanged."""
        if self.manager.current_step() != self.step:
            # A restarted group starts from its restore tiers' step: the quorum compares it.
            self.manager.load_state_dict(
                {"step": self.step, "batches_committed": self.step * self.topology.groups}
            )
        started = time.perf_counter()
        behind = self.step
        wait = timedelta(seconds=self.config.resilience.replica_wait_s)
        groups = self.topology.groups
        needed = 0  # the waiting semantics: the Lighthouse counts them (--min_replicas)
        if self._shrink and self._participants == 0:  # this process's first quorum
            # A fresh run starts with every group; a restarted group joins a peer to heal from.
            needed = groups if self.step == 0 else min(2, groups)
        waited = self._keeping_alive(
            partial(self._start_quorum, timeout=wait, needed=needed), step=self.step
        )
        elapsed = time.perf_counter() - started
        participants = self.manager.num_participants()
        healed = self._healed is not None
        if self._healed is not None:
            step, nbytes = self._healed
            self._healed = None
            self._emit(
                "replica_heal",
                step=step,
                from_step=behind,
                heal_s=round(elapsed, 4),
                bytes=nbytes,
            )
        # A new quorum id: the members changed (a group out or back; torchft reconfigures its
        # process group then). Private in torchft 2026.10.26, read only for the event.
        # A wait that was announced always ends with one (the exporter's open wait closes).
        quorum_id = getattr(self.manager, "_quorum_id", None)
        changed = quorum_id != self._quorum_id
        if participants != self._participants or changed or waited:
            self._quorum_id = quorum_id
            self._emit(
                "replica_quorum",
                step=self.step,
                participants=participants,
                groups=self.topology.groups,
                quorum_id=quorum_id,
                wait_s=round(elapsed, 4),
            )
            self._participants = participants
        return elapsed, waited and changed, healed

    def _start_quorum(self, *, timeout: timedelta, needed: int) -> None:
        """``Manager.start_quorum``, again until ``needed`` groups are in it (or ``timeout`` has
        passed). In the shrinking semantics the Lighthouse forms a quorum of one group: at a
        start the first group to arrive would otherwise train alone, skipping the others'
        samples while they still import torch; a restarted group would train alone from its
        own checkpoint instead of healing from a peer."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            self.manager.start_quorum(timeout=timeout)
            if not needed or len(self._members.groups) >= needed:
                return
            if time.monotonic() >= deadline:
                # As the waiting semantics' quorum times out: a group back after its peers
                # finished (or with none alive) must not train alone from its own checkpoint.
                raise TimeoutError(
                    f"replica group {self.topology.group}: not every group joined in "
                    f"{timeout.total_seconds():.0f} s (resilience.replica_wait_s); "
                    f"quorum had groups {sorted(self._members.groups)}"
                )
            time.sleep(0.2)

    def _record_skipped_samples(self, *, step: int, position: int) -> None:
        """Shrinking semantics, a step just committed: the samples of each group out of its
        quorum are skipped. The lowest group present writes them down, every rank ``r`` the
        indices group ``g``'s rank ``r`` would have read (the same sampler, ``g``'s layout, at
        the step's position), so the account is every sample of the missing group's share."""
        present = self._members.groups
        missing = [g for g in range(self.topology.groups) if g not in present]
        if not missing or not present or self.topology.group != min(present):
            return
        for g in missing:
            sampler = self._missing_samplers.get(g)
            if sampler is None:
                t = self.config.train
                layout = replica_layout(
                    topology=ReplicaTopology(
                        group=g, groups=self.topology.groups, lighthouse=self.topology.lighthouse
                    ),
                    group_size=self.env.world_size,
                    rank=self.env.rank,
                    micro_batch_size=t.micro_batch_size,
                    grad_accum_steps=t.grad_accum_steps,
                )
                sampler = ResumableSampler(
                    num_samples=self.shards.num_samples,
                    layout=layout,
                    seed=self.sampler.seed,
                    shuffle=self.sampler.shuffle,
                )
                self._missing_samplers[g] = sampler
            epoch, indices = samples_at(sampler=sampler, position=position)
            self._emit(
                "replica_samples_skipped",
                step=step,
                missing_group=g,
                position=position,
                epoch=epoch,
                samples=len(indices),
                indices=indices,
            )

    def _keeping_alive(self, wait: Callable[[], None], *, step: int) -> bool:
        """Run ``wait`` (a quorum, which blocks while a group is out) in a thread while this one
        reports liveness (``StepHooks.keepalive``: the in-job layer's heartbeat), so the rank
        monitor does not take a survivor waiting for its peers for a hung rank. The main thread
        does nothing meanwhile: the heal torchft applies in ``wait`` touches no state it uses.
        Past ``WAITING_EVENT_S`` it says once that it waits (``replica_waiting``); returns
        whether it did."""
        failure: list[BaseException] = []
        since, announced = time.time(), False

        def run() -> None:
            try:
                wait()
            except BaseException as err:  # re-raised in the main thread
                failure.append(err)

        thread = threading.Thread(target=run, name="replica-quorum", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.05)
            self.hooks.keepalive()
            if not announced and thread.is_alive() and time.time() - since >= WAITING_EVENT_S:
                announced = True
                self._emit("replica_waiting", step=step, since=round(since, 4))
        if failure:
            raise failure[0]
        return announced

    def _emit(self, kind: str, **extra: Any) -> None:
        self.events.emit(kind, group=self.topology.group, pid=os.getpid(), **extra)

    # -- the step ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        trained_here = self._participants > 0  # not this process's first quorum (its start)
        elapsed, waited, healed = self._quorum()
        if trained_here and waited and not healed:
            # A group went out between steps: this survivor's stall is the wait at the quorum.
            self._emit("replica_stall", step=self.step + 1, stall_s=round(elapsed, 4))

    def train_step(self) -> torch.Tensor:
        while True:
            sampler_state, rng = self.sampler.state_dict(), torch.get_rng_state()
            optimizer = self.optimizer
            gate = _CommitGate(optimizer, self.manager)
            self.optimizer = gate  # type: ignore[assignment]
            try:
                loss = super().train_step()
            finally:
                self.optimizer = optimizer
            if gate.committed:
                if self._shrink:
                    self._record_skipped_samples(
                        step=self.step + 1, position=int(sampler_state["consumed_samples"])
                    )
                return loss
            # A group failed during this step: nothing of it is kept, and every group redoes it.
            self.sampler.load_state_dict(sampler_state)
            torch.set_rng_state(rng)
            self._emit(
                "replica_step_discarded",
                step=self.step + 1,
                cause=str(self.manager.errored() or "should_commit is False").split("\n")[0][:300],
            )
            started = time.perf_counter()
            step = self.step
            self._quorum()
            if self.step != step:
                raise RuntimeError(
                    f"replica group {self.topology.group} healed in the middle of step {step + 1}"
                    f" (to step {self.step}): its own step counter would be wrong; restarting it"
                )
            self._emit(
                "replica_stall",
                step=self.step + 1,
                stall_s=round(time.perf_counter() - started, 4),
            )

    def fit(self, **kwargs: Any) -> Any:
        try:
            return super().fit(**kwargs)
        finally:
            # The Manager's server and checkpoint transport threads would outlive the run.
            self.manager.shutdown(wait=False)

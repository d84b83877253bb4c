"""The plan: per size x failure rate, each mode's best FSx and interval (chosen together), the
spare count, the ETTR with its range and Monte Carlo spread, and the recommendation.

For every mode and every candidate FSx (``planner.fsx.fsx_options``) the interval is the whole
number of steps that maximises the ETTR (``planner.ettr``: commit lag and write drag included);
the FSx is the one whose hourly price plus the GPU-hours its ETTR loses costs least
(``facts.prices``). The best shipped mode is the one with the highest ETTR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

from facts.checkpoint import checkpoint_bytes
from facts.prices import fsx_usd_per_hour
from planner import costs, ettr, failures, spares, tiers
from planner.costs import CostModel, Job, Term
from planner.fsx import FsxPlan, fsx_options, given_fsx

ALL_MODES: tuple[str, ...] = tuple(tiers.ROWS)
"""Modes with a closed form and a Monte Carlo: the product's and the planner's own rows
(``replica`` is first-order, see costs)."""
SPARE_SWEEP: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """Everything the plan depends on."""

    params: float
    """Model parameters."""
    bytes_per_param: float
    """Checkpointed bytes per parameter (facts.checkpoint: 12 for this trainer)."""
    gpus: tuple[int, ...]
    """Cluster sizes to evaluate."""
    gpus_per_node: int
    """GPUs per node (8 on p5.48xlarge); failure rates are per node."""
    step_time_s: float
    """Seconds per optimizer step: intervals are whole steps."""
    failure_rates: dict[str, float]
    """Failures per 1,000 node-days, by name."""
    hardware_share: float | None
    """Override of the Llama 3 hardware share (None: the paper's table)."""
    hot_spares: int | None
    """Spare nodes (None: the product's count from manifests.sizes, else the recommendation)."""
    lemon_share: float
    """Share of hardware failures from lemon nodes."""
    exclude_lemons: bool
    """Lemon nodes are removed (their failures vanish)."""
    keep: int
    """Committed checkpoints retained (training keep_last); FSx holds keep + 1."""
    fsx_capacity_gib: int | None
    """An existing file system's capacity (None: choose one)."""
    fsx_tier: int | None
    """An existing file system's MB/s/TiB (None: choose one)."""
    model: CostModel
    """The cost model in force."""
    days: float
    """Length of each simulated job."""
    trials: int
    """Simulated jobs per configuration."""
    seed: int
    """Monte Carlo seed."""
    interval_steps: int | None = None
    """Evaluate this trainer interval (``--checkpoint.interval``) instead of optimising it."""
    per_job_software: bool = False
    """Software faults per job (Llama 3's count at any size) instead of per node."""
    tiers: tiers.TierConfig = tiers.ON
    """Restore tiers (planner.tiers); ``tiers.OFF``: every restart reads FSx."""

    @property
    def ckpt_bytes(self) -> float:
        """Bytes of one full checkpoint."""
        return checkpoint_bytes(params=self.params, bytes_per_param=self.bytes_per_param)

    def failure_model(self, rate: float, hot_spares: int = 0) -> failures.FailureModel:
        """The failure model at one rate."""
        return failures.FailureModel(
            rate_per_1000_node_days=rate,
            kinds=failures.llama3_mix(
                hardware_share=self.hardware_share, per_job_software=self.per_job_software
            ),
            hot_spares=hot_spares,
            lemon_share=self.lemon_share,
            exclude_lemons=self.exclude_lemons,
        )


@dataclass(frozen=True)
class Recovery:
    """One outcome's recovery in one mode."""

    outcome: failures.Outcome
    seconds: float
    terms: tuple[Term, ...]
    source: str = tiers.STORAGE
    """The tier it restores from (planner.tiers)."""
    peer_lost: float = 0.0
    """``peer`` only: the chance that a second loss took the copy; FSx then, in ``fallback_s``."""
    fallback_s: float = 0.0
    """R when the peer copy is lost (a restore from storage)."""


@dataclass(frozen=True, kw_only=True)
class ModeResult:
    """One mode at one size and rate, at its own best FSx and interval."""

    mode: str
    fsx: FsxPlan
    write_s: float
    """Seconds to write one checkpoint to this FSx (the commit lag)."""
    interval_steps: int
    interval_s: float
    memory_interval_steps: int
    """``--checkpoint.memory_interval`` (0: no failure restores from memory in this mode)."""
    recoveries: tuple[Recovery, ...]
    outage_s: float
    """X: expected seconds from a failure to training again (failures during it included)."""
    ettr: float
    """Closed form (planner.ettr.ettr_model), published start-up costs."""
    ettr_low_startup: float
    """The same with NCCL start-up and rendezvous at the low ends of their ranges."""
    cost_usd_per_h: float
    """GPU-hours the ETTR loses plus the FSx, per hour."""
    fsx_usd_per_h: float
    """The chosen FSx's price per hour."""
    fsx_near: FsxPlan
    """The cheapest FSx whose ETTR (at its own best interval) is within 0.1 pt of the choice."""
    fsx_near_usd_per_h: float
    mc: ettr.MonteCarlo | None
    """Monte Carlo at the same settings (None for modes without one)."""
    split: ettr.Split
    """The failures split by restore tier (planner.ettr.split)."""
    snapshot_stall_per_s: float
    """Memory snapshots' blocking time per second of training."""
    tiers_off_ettr: float
    """The same mode with every restart from FSx, at its own best FSx and interval."""
    tiers_off_interval_steps: int

    @property
    def mean_recovery_s(self) -> float:
        """Mean R over the outcomes (no failure during the recovery)."""
        return sum(r.outcome.share * r.seconds for r in self.recoveries)


@dataclass(frozen=True, kw_only=True)
class Spares:
    """The spare decision at one size and rate."""

    in_force: spares.SparesInForce
    recommended: int
    """Fewest spares that keep the chance of finding none below 1%."""
    load: float
    """Node failures per refill time (the pool's Erlang load)."""
    no_spare_chance: float
    """Chance that a node failure finds no spare, at the count in force."""
    idle_gpu_share: float
    """Spare GPUs / job GPUs."""
    idle_usd_per_h: float
    """What the idle spares cost per hour."""
    sweep: tuple[tuple[int, float, float], ...]
    """(spares, chance of none, best mode's ETTR) over SPARE_SWEEP + the recommendation."""


@dataclass(frozen=True, kw_only=True)
class RateResult:
    """One failure rate at one size."""

    rate_name: str
    rate: float
    mtbf_s: float
    spares: Spares
    modes: dict[str, ModeResult]
    replica: ReplicaResult
    """``--restart replica`` (its own row: planner.costs.replica_recovery)."""
    best: str
    """Best shipped mode."""
    runner_up: str
    margins: tuple[float, ...]
    """Best minus runner-up ETTR: published costs, low start-up costs, estimates x0.5, x2."""
    losses: tuple[tuple[str, float], ...]
    """First-order ETTR loss by term for the best mode, largest first."""
    planned_loss: float
    """ETTR lost to planned interruptions (Llama 3's 47 in 54 days, whole-job restart, no
    rollback), not in ``modes``."""

    @property
    def within_error(self) -> bool:
        """The best mode's lead over the runner-up is not robust to the uncertain terms."""
        return min(self.margins) <= 0.0 or self.margins[0] < 0.001


@dataclass(frozen=True)
class SizePlan:
    """One cluster size."""

    job: Job
    stall_s: float
    terms: dict[str, Term]
    """Terms at the best mode's FSx for the first rate."""
    rates: list[RateResult]


def _job(inputs: Inputs, gpus: int, fsx_bytes_per_s: float) -> Job:
    return Job(
        gpus=gpus,
        gpus_per_node=inputs.gpus_per_node,
        ckpt_bytes=inputs.ckpt_bytes,
        step_time_s=inputs.step_time_s,
        fsx_bytes_per_s=fsx_bytes_per_s,
    )


def _fsx_price(model: CostModel, fsx: FsxPlan) -> float:
    table = {
        tier: model.params[f"fsx_usd_per_gb_month_{tier}"]
        for tier in (125, 250, 500, 1000)
        if f"fsx_usd_per_gb_month_{tier}" in model.params
    }
    if fsx.tier_mbps_per_tib not in table:
        return 0.0
    return fsx_usd_per_hour(
        capacity_gib=fsx.capacity_gib,
        tier_mbps_per_tib=fsx.tier_mbps_per_tib,
        usd_per_gb_month=table,
    )


def _recoveries(
    model: CostModel,
    job: Job,
    mode: str,
    outs: tuple[failures.Outcome, ...],
    tier_config: tiers.TierConfig,
    node_rate_per_s: float,
) -> tuple[Recovery, ...]:
    """Each outcome's recovery, its restore source and (peer) the fallback to FSx."""
    out = []
    t = costs.terms(model=model, job=job) if model.name == "cluster" else None
    for o in outs:
        source = tiers.restore_source(mode=mode, outcome=o, nodes=job.nodes, tiers=tier_config)
        tr = costs.recovery(
            model=model, job=job, mode=mode, outcome=o, precomputed=t, source=source
        )
        seconds = sum(x.seconds for x in tr)
        lost, fallback = 0.0, 0.0
        if source == tiers.PEER:
            lost = tiers.peer_lost_chance(node_rate_per_s=node_rate_per_s, window_s=seconds)
            fallback = sum(
                x.seconds
                for x in costs.recovery(model=model, job=job, mode=mode, outcome=o, precomputed=t)
            )
        out.append(Recovery(o, seconds, tuple(tr), source, lost, fallback))
    return tuple(out)


def _kinds(recs: tuple[Recovery, ...], *, recompute_s: float) -> list[ettr.Kind]:
    """The ETTR's kinds: a peer restore splits into the copy found and the copy lost (FSx)."""
    out = []
    for r in recs:
        idle = r.outcome.strikes_idle
        keeps = r.source != tiers.STORAGE
        share = r.outcome.share * (1.0 - r.peer_lost)
        out.append(
            ettr.Kind(
                share=share,
                recovery_s=r.seconds,
                strikes_idle=idle,
                resets=not keeps,
                recompute_s=recompute_s if keeps else 0.0,
            )
        )
        if r.peer_lost > 0:
            out.append(
                ettr.Kind(
                    share=r.outcome.share * r.peer_lost, recovery_s=r.fallback_s, strikes_idle=idle
                )
            )
    return out


def _memory_interval(
    inputs: Inputs, *, recs: tuple[Recovery, ...], mtbf: float, snapshot_stall_s: float
) -> int:
    """``checkpoint.memory_interval`` for this mode: as given, or Young's optimum for the
    failures that restore from memory (0 when none does)."""
    memory_share = sum(
        r.outcome.share * (1.0 - r.peer_lost) for r in recs if r.source != tiers.STORAGE
    )
    if memory_share <= 0:
        return 0
    if inputs.tiers.memory_interval_steps is not None:
        return inputs.tiers.memory_interval_steps
    return ettr.memory_interval_steps(
        step_s=inputs.step_time_s,
        snapshot_stall_s=snapshot_stall_s,
        memory_rate_per_s=memory_share / mtbf,
    )


def _sim_kinds(
    model: CostModel,
    job: Job,
    mode: str,
    fm: failures.FailureModel,
    *,
    tier_config: tiers.TierConfig,
    recompute_s: float,
) -> list[ettr.SimKind]:
    """The failure kinds for the Monte Carlo, with both recoveries (the pool picks one); a peer
    restore splits into the copy found and the copy lost (at the no-spare window: the longer)."""
    rates = failures.kind_rates_per_s(model=fm, nodes=job.nodes)
    total = sum(rates.values())
    node_rate = failures.node_failure_rate_per_s(model=fm, nodes=job.nodes) / job.nodes
    out = []
    for k in fm.kinds:
        base = failures.Outcome(
            kind=k.name,
            share=rates[k.name] / total,
            needs_node=k.needs_node,
            hangs=k.hangs,
            host=k.host,
            manual=k.manual,
            strikes_idle=k.strikes_idle,
            base=k.name,
        )
        spare = replace(base, spare=True)
        src = tiers.restore_source(mode=mode, outcome=base, nodes=job.nodes, tiers=tier_config)
        src_spare = tiers.restore_source(
            mode=mode, outcome=spare, nodes=job.nodes, tiers=tier_config
        )
        r = costs.recovery_s(model=model, job=job, mode=mode, outcome=base, source=src)
        r_spare = (
            costs.recovery_s(model=model, job=job, mode=mode, outcome=spare, source=src_spare)
            if k.needs_node
            else r
        )
        lost = 0.0
        if tiers.PEER in (src, src_spare):
            lost = tiers.peer_lost_chance(node_rate_per_s=node_rate, window_s=max(r, r_spare))
        common = {"needs_node": k.needs_node, "strikes_idle": k.strikes_idle}
        out.append(
            ettr.SimKind(
                share=base.share * (1.0 - lost),
                recovery_s=r,
                spare_recovery_s=r_spare,
                resets=src == tiers.STORAGE,
                recompute_s=recompute_s if src != tiers.STORAGE else 0.0,
                spare_resets=src_spare == tiers.STORAGE,
                spare_recompute_s=recompute_s if src_spare != tiers.STORAGE else 0.0,
                **common,
            )
        )
        if lost > 0:
            out.append(
                ettr.SimKind(
                    share=base.share * lost,
                    recovery_s=costs.recovery_s(model=model, job=job, mode=mode, outcome=base),
                    spare_recovery_s=costs.recovery_s(
                        model=model, job=job, mode=mode, outcome=spare
                    ),
                    **common,
                )
            )
    return out


@dataclass(frozen=True)
class _Eval:
    fsx: FsxPlan
    write_s: float
    steps: int
    memory_steps: int
    recs: tuple[Recovery, ...]
    outage: float
    ettr: float
    cost: float
    split: ettr.Split
    snapshot_stall_per_s: float


def _evaluate(
    inputs: Inputs,
    *,
    gpus: int,
    mode: str,
    fsx: FsxPlan,
    outs: tuple[failures.Outcome, ...],
    stall: float,
    mtbf: float,
    model: CostModel,
    steps: int | None = None,
    tier_config: tiers.TierConfig | None = None,
) -> _Eval:
    tier_config = inputs.tiers if tier_config is None else tier_config
    job = _job(inputs, gpus, fsx.bytes_per_s)
    write = inputs.ckpt_bytes / fsx.bytes_per_s
    drag = model.params.get("write_drag", 0.0)
    node_rate = _node_rate_per_node(inputs, outs=outs, mtbf=mtbf, nodes=job.nodes)
    recs = _recoveries(model, job, mode, outs, tier_config, node_rate)
    snapshot = _snapshot_stall_s(model, job)
    memory_steps = _memory_interval(inputs, recs=recs, mtbf=mtbf, snapshot_stall_s=snapshot)
    span = memory_steps * inputs.step_time_s
    kinds = _kinds(recs, recompute_s=span / 2.0)
    sp = ettr.split(mtbf_s=mtbf, kinds=kinds)
    outage = sp.mean_outage
    per_s = snapshot / span if memory_steps else 0.0
    kw = {
        "stall_s": stall,
        "write_s": write,
        "drag": drag,
        "mtbf_s": mtbf,
        "outage": sp.outage,
        "reset_share": sp.reset_share,
        "dilation": sp.dilation,
        "snapshot_stall_per_s": per_s,
    }
    if steps is None:
        steps = inputs.interval_steps or ettr.best_interval_steps(step_s=inputs.step_time_s, **kw)
    value = float(ettr.ettr_model(interval_s=steps * inputs.step_time_s, **kw))
    gpu_usd = model.params.get("gpu_hour_usd", 0.0)
    cost = gpus * gpu_usd * (1.0 - value) + _fsx_price(model, fsx)
    return _Eval(fsx, write, steps, memory_steps, recs, outage, value, cost, sp, per_s)


def _node_rate_per_node(
    inputs: Inputs, *, outs: tuple[failures.Outcome, ...], mtbf: float, nodes: int
) -> float:
    """One node's rate of failures that need a node (the peer copy's exposure)."""
    return sum(o.share for o in outs if o.needs_node) / mtbf / nodes


def _snapshot_stall_s(model: CostModel, job: Job) -> float:
    """Seconds one memory snapshot blocks training."""
    if model.name != "cluster":
        return 0.0
    return costs.terms(model=model, job=job)["memory_snapshot_stall_s"].seconds


@dataclass(frozen=True, kw_only=True)
class ReplicaResult:
    """``--restart replica`` at one size and rate (planner.costs.replica_recovery), at nested's
    FSx and checkpoint interval (a fault restores from a live peer group, not a checkpoint, so
    the interval only prices the checkpoints' stall)."""

    ettr: float
    """The default semantics (``costs.REPLICA_DEFAULT``, the trainer's)."""
    other_ettr: float
    """The other semantics (``resilience.replica_semantics``; docs/replica-groups.md)."""
    losses: tuple[tuple[str, float], ...]
    """First-order ETTR loss by term (the default semantics), largest first."""


def _replica_loss(model: CostModel, job: Job, outs, *, semantics: str) -> dict[str, float]:
    """Expected job-wide seconds per failure, by term."""
    out: dict[str, float] = {}
    for o in outs:
        for t in costs.replica_recovery(model=model, job=job, outcome=o, semantics=semantics):
            out[t.name] = out.get(t.name, 0.0) + o.share * t.seconds
    return out


def _replica_result(
    inputs: Inputs,
    *,
    gpus: int,
    at: _Eval,
    outs: tuple[failures.Outcome, ...],
    stall: float,
    mtbf: float,
) -> ReplicaResult:
    """First-order ETTR of replica groups at a given FSx and interval: the checkpoints' cycle,
    then each failure's job-wide loss (``replica_recovery``), plus a second failure while a
    group recovers (``failures during recoveries``: the chance 1 - exp(-R / MTBF) of another
    failure in the stall, each costing about one more recovery; when it hits another group,
    no peer may be left to heal from and the groups restore from their tiers)."""
    model = inputs.model
    if model.name != "cluster":
        return ReplicaResult(ettr=math.nan, other_ettr=math.nan, losses=())
    job = _job(inputs, gpus, at.fsx.bytes_per_s)
    tau = at.steps * inputs.step_time_s
    c = ettr.cycle_s(
        interval_s=tau, stall_s=stall, write_s=at.write_s, drag=model.params["write_drag"]
    )
    kept = tau / c
    results = {}
    for semantics in costs.REPLICA_SEMANTICS:
        by_term = _replica_loss(model, job, outs, semantics=semantics)
        loss = sum(by_term.values())
        again = -math.expm1(-loss / mtbf) * loss
        results[semantics] = (max(0.0, kept * (1.0 - (loss + again) / mtbf)), by_term, again)
    (other,) = (s for s in costs.REPLICA_SEMANTICS if s != costs.REPLICA_DEFAULT)
    default, by_term, again = results[costs.REPLICA_DEFAULT]
    split = {"checkpoint stall": 1.0 - kept, "failures during recoveries": kept * again / mtbf}
    split.update({name: kept * seconds / mtbf for name, seconds in by_term.items()})
    return ReplicaResult(
        ettr=default,
        other_ettr=results[other][0],
        losses=tuple(sorted(((k, v) for k, v in split.items() if v > 0), key=lambda kv: -kv[1])),
    )


def _losses(
    inputs: Inputs, *, best: ModeResult, stall: float, mtbf: float
) -> list[tuple[str, float]]:
    """First-order split of 1 - ETTR: checkpointing, rollback, commit lag, each recovery term."""
    tau = best.interval_s
    drag = inputs.model.params.get("write_drag", 0.0)
    cycle = ettr.cycle_s(interval_s=tau, stall_s=stall, write_s=best.write_s, drag=drag)
    snapshots = tau * best.snapshot_stall_per_s
    c = cycle + snapshots
    reset = best.split.reset_share
    kept = sum(
        r.outcome.share * (1 - r.peer_lost) for r in best.recoveries if r.source != tiers.STORAGE
    )
    out: dict[str, float] = {
        "checkpoint stall": (cycle - tau - drag * min(best.write_s, tau)) / c,
        "memory snapshots": snapshots / c,
        "write drag": drag * min(best.write_s, tau) / c,
        "rollback (half an interval)": reset * c / 2 / mtbf,
        "commit lag (FSx write)": reset * best.write_s / mtbf,
        "recompute (half a memory interval)": kept
        * best.memory_interval_steps
        * inputs.step_time_s
        / 2
        / mtbf,
    }
    mean_r = best.mean_recovery_s
    extra = max(0.0, best.outage_s - mean_r)
    if extra > 0:
        out["failures during recoveries"] = extra / mtbf
    for rec in best.recoveries:
        for t in rec.terms:
            out[t.name] = out.get(t.name, 0.0) + rec.outcome.share * t.seconds / mtbf
    return sorted(((k, v) for k, v in out.items() if v > 0), key=lambda kv: -kv[1])


def plan(*, inputs: Inputs, simulate: bool = True) -> list[SizePlan]:
    """The whole plan (deterministic for a seed)."""
    model = inputs.model
    low = costs.low_startup(model)
    job_s = inputs.days * failures.SECONDS_PER_DAY
    refill = model.params.get("spare_refill_s", costs.DEFAULTS["spare_refill_s"].value)
    mtbfs = {
        g: {
            n: 1.0
            / failures.job_failure_rate_per_s(
                model=inputs.failure_model(r), nodes=_job(inputs, g, 1.0).nodes
            )
            for n, r in inputs.failure_rates.items()
        }
        for g in inputs.gpus
    }
    min_mtbf = min(m for mt in mtbfs.values() for m in mt.values())
    shared = ettr.draws(trials=inputs.trials, max_failures_mean=job_s / min_mtbf, seed=inputs.seed)

    if inputs.fsx_capacity_gib is not None and inputs.fsx_tier is not None:
        options = [
            given_fsx(
                capacity_gib=inputs.fsx_capacity_gib,
                tier_mbps_per_tib=inputs.fsx_tier,
                ckpt_bytes=inputs.ckpt_bytes,
                keep=inputs.keep,
            )
        ]
    else:
        options = fsx_options(ckpt_bytes=inputs.ckpt_bytes, keep=inputs.keep)

    out: list[SizePlan] = []
    for g in inputs.gpus:
        draft = _job(inputs, g, 1.0)
        stall = costs.checkpoint_stall_s(model=model, job=draft)
        rates: list[RateResult] = []
        first_terms: dict[str, Term] = {}
        for name, rate in inputs.failure_rates.items():
            mtbf = mtbfs[g][name]
            fm0 = inputs.failure_model(rate)
            load = failures.node_failure_rate_per_s(model=fm0, nodes=draft.nodes) * refill
            recommended = spares.spares_needed(load=load)
            in_force = spares.spares_in_force(
                nodes=draft.nodes, given=inputs.hot_spares, recommended=recommended
            )
            fm = inputs.failure_model(rate, hot_spares=in_force.count)
            outs = failures.outcomes(model=fm, nodes=draft.nodes, refill_s=refill)
            evals: dict[str, _Eval] = {}
            near: dict[str, _Eval] = {}
            # Every evaluation at this size shares these.
            evaluate = partial(_evaluate, inputs, gpus=g, outs=outs, stall=stall, mtbf=mtbf)
            for mode in ALL_MODES:
                cands = [evaluate(mode=mode, fsx=f, model=model) for f in options]
                evals[mode] = min(cands, key=lambda e: e.cost)
                near[mode] = min(
                    (e for e in cands if e.ettr >= evals[mode].ettr - 0.001),
                    key=lambda e: _fsx_price(model, e.fsx),
                )
            modes: dict[str, ModeResult] = {}
            used: dict[str, tiers.TierConfig] = {}
            for mode, e in evals.items():
                used[mode] = inputs.tiers
                off = e
                if inputs.tiers.enabled:
                    off = evaluate(mode=mode, fsx=e.fsx, model=model, tier_config=tiers.OFF)
                    if off.ettr > e.ettr and inputs.tiers.memory_interval_steps is None:
                        # Snapshots are a choice (checkpoint.memory_interval 0 = off): where
                        # they cost more than they save, the plan goes without them.
                        e = off
                        used[mode] = tiers.OFF
                    if mode in costs.MODES and tiers.row(mode).keeps_pod:
                        # The comparison: the storage-only model at its own best FSx.
                        off = min(
                            (
                                evaluate(mode=mode, fsx=f, model=model, tier_config=tiers.OFF)
                                for f in options
                            ),
                            key=lambda x: x.cost,
                        )
                evals[mode] = e
                lo = evaluate(
                    mode=mode, fsx=e.fsx, model=low, steps=e.steps, tier_config=used[mode]
                )
                mc = None
                if simulate:
                    job = _job(inputs, g, e.fsx.bytes_per_s)
                    mc = ettr.simulate(
                        draws=shared,
                        mtbf_s=mtbf,
                        kinds=_sim_kinds(
                            model,
                            job,
                            mode,
                            fm,
                            tier_config=used[mode],
                            recompute_s=e.memory_steps * inputs.step_time_s / 2.0,
                        ),
                        spares=in_force.count,
                        refill_s=refill,
                        interval_s=e.steps * inputs.step_time_s,
                        stall_s=stall,
                        write_s=e.write_s,
                        drag=model.params.get("write_drag", 0.0),
                        job_s=job_s,
                        snapshot_stall_per_s=e.snapshot_stall_per_s,
                    )
                modes[mode] = ModeResult(
                    mode=mode,
                    fsx=e.fsx,
                    write_s=e.write_s,
                    interval_steps=e.steps,
                    interval_s=e.steps * inputs.step_time_s,
                    memory_interval_steps=e.memory_steps,
                    recoveries=e.recs,
                    outage_s=e.outage,
                    ettr=e.ettr,
                    ettr_low_startup=lo.ettr,
                    cost_usd_per_h=e.cost,
                    fsx_usd_per_h=_fsx_price(model, e.fsx),
                    fsx_near=near[mode].fsx,
                    fsx_near_usd_per_h=_fsx_price(model, near[mode].fsx),
                    mc=mc,
                    split=e.split,
                    snapshot_stall_per_s=e.snapshot_stall_per_s,
                    tiers_off_ettr=off.ettr,
                    tiers_off_interval_steps=off.steps,
                )
            ranked = sorted(costs.MODES, key=lambda m: -modes[m].ettr)
            best, second = ranked[0], ranked[1]
            margins = [
                modes[best].ettr - modes[second].ettr,
                modes[best].ettr_low_startup - modes[second].ettr_low_startup,
            ]
            for factor in (0.5, 2.0):
                scaled = costs.scaled_estimates(model, factor)
                at = {
                    m: _evaluate(
                        inputs,
                        gpus=g,
                        mode=m,
                        fsx=modes[m].fsx,
                        outs=outs,
                        stall=costs.checkpoint_stall_s(model=scaled, job=draft),
                        mtbf=mtbf,
                        model=scaled,
                        steps=modes[m].interval_steps,
                        tier_config=used[m],
                    ).ettr
                    for m in (best, second)
                }
                margins.append(at[best] - at[second])
            sweep = []
            for k in sorted({*SPARE_SWEEP, recommended, in_force.count}):
                fk = inputs.failure_model(rate, hot_spares=k)
                ok = failures.outcomes(model=fk, nodes=draft.nodes, refill_s=refill)
                e = _evaluate(
                    inputs,
                    gpus=g,
                    mode=best,
                    fsx=modes[best].fsx,
                    outs=ok,
                    stall=stall,
                    mtbf=mtbf,
                    model=model,
                    steps=modes[best].interval_steps,
                    tier_config=used[best],
                )
                sweep.append((k, spares.erlang_b(spares=k, load=load), e.ettr))
            gpu_usd = model.params.get("gpu_hour_usd", 0.0)
            spare_gpus = in_force.count * inputs.gpus_per_node
            sp = Spares(
                in_force=in_force,
                recommended=recommended,
                load=load,
                no_spare_chance=spares.erlang_b(spares=in_force.count, load=load),
                idle_gpu_share=spare_gpus / g,
                idle_usd_per_h=spare_gpus * gpu_usd,
                sweep=tuple(sweep),
            )
            best_job = _job(inputs, g, modes[best].fsx.bytes_per_s)
            planned_r = sum(
                t.seconds
                for t in costs.recovery(
                    model=model,
                    job=best_job,
                    mode="none",
                    outcome=failures.Outcome(
                        kind="planned", share=1.0, needs_node=False, hangs=False
                    ),
                )[1:]
            )
            planned_rate = failures.PLANNED_PER_DAY / failures.SECONDS_PER_DAY
            rates.append(
                RateResult(
                    rate_name=name,
                    rate=rate,
                    mtbf_s=mtbf,
                    spares=sp,
                    modes=modes,
                    replica=_replica_result(
                        inputs, gpus=g, at=evals["nested"], outs=outs, stall=stall, mtbf=mtbf
                    ),
                    best=best,
                    runner_up=second,
                    margins=tuple(margins),
                    losses=tuple(_losses(inputs, best=modes[best], stall=stall, mtbf=mtbf)),
                    planned_loss=planned_rate * planned_r / (1.0 + planned_rate * planned_r),
                )
            )
            if not first_terms:
                first_terms = costs.terms(model=model, job=best_job)
        out.append(SizePlan(draft, stall, first_terms, rates))
    return out

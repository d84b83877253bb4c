"""The plan: per size x failure rate x mode, the interval, recoveries and ETTR; FSx per size."""

from __future__ import annotations

import math
from dataclasses import dataclass

from facts.checkpoint import checkpoint_bytes
from planner import costs, ettr, failures
from planner.costs import CostModel, Job, Term
from planner.fsx import FsxPlan, given_fsx, size_fsx


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
    hot_spares: int
    """Spare nodes waiting to replace a failed one."""
    lemon_share: float
    """Share of hardware failures from lemon nodes."""
    exclude_lemons: bool
    """Lemon nodes are removed (their failures vanish)."""
    keep: int
    """Committed checkpoints retained (training keep_last); FSx holds keep + 1."""
    fsx_capacity_gib: int | None
    """An existing file system's capacity (None: size one)."""
    fsx_tier: int | None
    """An existing file system's MB/s/TiB (None: size one)."""
    model: CostModel
    """The cost model in force."""
    days: float
    """Length of each simulated job."""
    trials: int
    """Simulated jobs per configuration."""
    seed: int
    """Monte Carlo seed."""

    @property
    def ckpt_bytes(self) -> float:
        """Bytes of one full checkpoint."""
        return checkpoint_bytes(params=self.params, bytes_per_param=self.bytes_per_param)

    def failure_model(self, rate: float) -> failures.FailureModel:
        """The failure model at one rate."""
        return failures.FailureModel(
            rate_per_1000_node_days=rate,
            kinds=failures.llama3_mix(hardware_share=self.hardware_share),
            hot_spares=self.hot_spares,
            lemon_share=self.lemon_share,
            exclude_lemons=self.exclude_lemons,
        )


@dataclass(frozen=True)
class Recovery:
    """One outcome's recovery in one mode."""

    outcome: failures.Outcome
    seconds: float
    terms: tuple[Term, ...]


@dataclass(frozen=True)
class ModeResult:
    """ETTR of one mode at one size and rate."""

    mode: str
    recoveries: tuple[Recovery, ...]
    mean_recovery_s: float
    ettr_first_order: float
    ettr_formula: float
    mc: ettr.MonteCarlo


@dataclass(frozen=True)
class RateResult:
    """One failure rate at one size."""

    rate_name: str
    rate: float
    mtbf_s: float
    interval_young_s: float
    interval_daly_s: float
    interval_s: float
    interval_steps: int
    fsx_limited: bool
    """The interval was lengthened because FSx cannot write a checkpoint within Daly's."""
    modes: dict[str, ModeResult]


@dataclass(frozen=True)
class SizePlan:
    """One cluster size."""

    job: Job
    stall_s: float
    fsx: FsxPlan
    terms: dict[str, Term]
    rates: list[RateResult]


def _steps(seconds: float, step_s: float) -> int:
    return max(1, round(seconds / step_s))


def plan(*, inputs: Inputs) -> list[SizePlan]:
    """The whole plan (deterministic for a seed)."""
    job_s = inputs.days * failures.SECONDS_PER_DAY
    pre: dict[int, tuple[Job, float, dict[str, float]]] = {}
    for g in inputs.gpus:
        # FSx throughput does not enter the stall or node terms: a placeholder is enough here.
        draft = Job(
            gpus=g,
            gpus_per_node=inputs.gpus_per_node,
            ckpt_bytes=inputs.ckpt_bytes,
            step_time_s=inputs.step_time_s,
            fsx_bytes_per_s=1.0,
        )
        stall = costs.checkpoint_stall_s(model=inputs.model, job=draft)
        mtbf = {
            name: 1.0
            / failures.job_failure_rate_per_s(model=inputs.failure_model(r), nodes=draft.nodes)
            for name, r in inputs.failure_rates.items()
        }
        pre[g] = (draft, stall, mtbf)
    min_mtbf = min(m for _, _, mt in pre.values() for m in mt.values())
    shared = ettr.draws(trials=inputs.trials, max_failures_mean=job_s / min_mtbf, seed=inputs.seed)

    out: list[SizePlan] = []
    for g in inputs.gpus:
        draft, stall, mtbf = pre[g]
        daly = {
            n: _steps(ettr.daly_interval_s(stall_s=stall, mtbf_s=m), inputs.step_time_s)
            * inputs.step_time_s
            for n, m in mtbf.items()
        }
        if inputs.fsx_capacity_gib is not None and inputs.fsx_tier is not None:
            fsx = given_fsx(
                capacity_gib=inputs.fsx_capacity_gib,
                tier_mbps_per_tib=inputs.fsx_tier,
                ckpt_bytes=inputs.ckpt_bytes,
                keep=inputs.keep,
            )
        else:
            # The shortest interval (highest rate) is the one the background write must meet.
            fsx = size_fsx(
                ckpt_bytes=inputs.ckpt_bytes, keep=inputs.keep, write_within_s=min(daly.values())
            )
        job = Job(
            gpus=g,
            gpus_per_node=inputs.gpus_per_node,
            ckpt_bytes=inputs.ckpt_bytes,
            step_time_s=inputs.step_time_s,
            fsx_bytes_per_s=fsx.bytes_per_s,
        )
        t = costs.terms(model=inputs.model, job=job)
        write_s = t["ckpt_write_s"].seconds
        rates: list[RateResult] = []
        for name, rate in inputs.failure_rates.items():
            m = mtbf[name]
            steps = _steps(daly[name], inputs.step_time_s)
            limited = write_s > steps * inputs.step_time_s
            if limited:
                steps = math.ceil(write_s / inputs.step_time_s)
            tau = steps * inputs.step_time_s
            outs = failures.outcomes(
                model=inputs.failure_model(rate),
                nodes=job.nodes,
                node_replace_s=t["node_replace_s"].seconds,
            )
            shares = [o.share for o in outs]
            modes: dict[str, ModeResult] = {}
            for mode in costs.MODES:
                recs = tuple(
                    Recovery(o, sum(x.seconds for x in tr), tuple(tr))
                    for o in outs
                    for tr in [costs.recovery(model=inputs.model, job=job, mode=mode, outcome=o)]
                )
                rs = [r.seconds for r in recs]
                kw = {
                    "interval_s": tau,
                    "stall_s": stall,
                    "mtbf_s": m,
                    "shares": shares,
                    "recoveries_s": rs,
                }
                modes[mode] = ModeResult(
                    mode=mode,
                    recoveries=recs,
                    mean_recovery_s=sum(p * r for p, r in zip(shares, rs, strict=True)),
                    ettr_first_order=ettr.ettr_first_order(**kw),
                    ettr_formula=ettr.ettr_mixed(**kw),
                    mc=ettr.simulate_ettr(draws=shared, job_s=job_s, **kw),
                )
            rates.append(
                RateResult(
                    rate_name=name,
                    rate=rate,
                    mtbf_s=m,
                    interval_young_s=ettr.young_interval_s(stall_s=stall, mtbf_s=m),
                    interval_daly_s=daly[name],
                    interval_s=tau,
                    interval_steps=steps,
                    fsx_limited=limited,
                    modes=modes,
                )
            )
        out.append(SizePlan(job=job, stall_s=stall, fsx=fsx, terms=t, rates=rates))
    return out

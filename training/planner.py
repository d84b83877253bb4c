"""Goodput planner: checkpoint interval, expected ETTR at 1k-100k GPUs, and FSx throughput.

    python -m training.planner --params 70e9 --gpus 1024,16384,100000   # or: make planner ARGS=...

Model (all times in seconds of wall clock):

- Failures are a Poisson process at ``r`` failures per node-day over ``N = ceil(gpus / 8)``
  nodes, so the job's mean time between failures is ``M = 86400 / (r * N)``. Rates are per
  1,000 node-days: Llama 3 training 3.8, Meta RSC-1 6.5, RSC-2 2.34.
- The job computes for ``tau`` seconds, then stalls ``delta`` seconds to checkpoint (the async
  checkpoint's blocking time), and repeats. A failure throws away the work since the last
  committed checkpoint and costs a restart of ``R`` seconds (a failure during a restart starts it
  again). ``R`` depends on the restart mode: in-process, in-job (new processes, same pods) or cold
  (new pods/nodes).
- Optimal interval: Young (1974) ``tau = sqrt(2 * delta * M)``; Daly (2006) higher order
  ``tau = sqrt(2 delta M) * (1 + sqrt(delta / (2M)) / 3 + (delta / (2M)) / 9) - delta`` for
  ``delta < 2M`` (else ``tau = M``). The planner uses Daly's, rounded to whole steps.
- Expected ETTR (productive / wall), two forms:
  first order ``ETTR1 = tau / (tau + delta) * (1 - (R + (tau + delta) / 2) / M)`` (each failure
  costs the restart plus on average half an interval), and Daly's (2006) exact form for this model
  ``ETTR = tau / (M * exp(R / M) * (exp((tau + delta) / M) - 1))``, which the Monte Carlo
  simulation reproduces in expectation (up to the first segment, which has no restart, and the
  last, whose uncommitted work counts because the job ends cleanly).
- Checkpoint size: ``params * bytes_per_param``; the default 16 bytes/param is the usual
  mixed-precision AdamW training state as FSDP shards it: bf16 weights (2) + fp32 master weights
  (4) + fp32 Adam m and v (8) + bf16 gradients (2); every GPU writes its 1/gpus shard. It is an
  upper bound: a checkpoint without gradients (and with fp32 params only) is 12-14 bytes/param,
  see ``--bytes-per-param``.

J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974.
J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3), 2006.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np

SECONDS_PER_DAY = 86_400.0
TIB = 2**40
MB = 1e6  # FSx quotes throughput in MB/s (decimal) per TiB of storage

# Failures per 1,000 node-days (8 GPUs per node).
FAILURE_RATES: dict[str, float] = {"llama3": 3.8, "rsc1": 6.5, "rsc2": 2.34}

# Built-in defaults, used when bench/results/*.json is absent. Chosen as typical numbers for a
# p5 cluster: NVRx async checkpointing blocks only for the GPU->pinned-host copy; an in-process
# restart re-forms NCCL groups in the live processes; in-job restarts new processes in the same
# pods and reloads the checkpoint; cold reschedules pods (and maybe a node) before all that.
BUILTIN_CKPT_STALL_S = 3.0
BUILTIN_RESTART_S: dict[str, float] = {"inprocess": 30.0, "injob": 120.0, "cold": 600.0}
BENCH_RESTART_KEYS = {"inprocess": "inprocess_p50_s", "injob": "injob_p50_s", "cold": "cold_p50_s"}

# FSx for Lustre PERSISTENT_2 throughput tiers (MB/s per TiB) and storage sizing (SSD):
# 1.2 TiB, then increments of 2.4 TiB.
FSX_TIERS_MBPS_PER_TIB = (125, 250, 500, 1000)
FSX_MIN_TIB, FSX_STEP_TIB = 1.2, 2.4


@dataclass(frozen=True)
class PlannerInputs:
    """Everything the plan depends on."""

    params: float
    """Model parameters."""
    bytes_per_param: float
    """Checkpointed bytes per parameter (16: mixed-precision AdamW, see the module docstring)."""
    gpus: tuple[int, ...]
    """Cluster sizes to evaluate."""
    gpus_per_node: int
    """GPUs per node (8 on p5.48xlarge); failure rates are per node."""
    step_time_s: float
    """Seconds per optimizer step: the checkpoint interval is rounded to whole steps."""
    ckpt_stall_s: float
    """Seconds training stalls per checkpoint (delta)."""
    restart_s: dict[str, float]
    """Restart cost R in seconds, per restart mode."""
    failure_rates: dict[str, float]
    """Failures per 1,000 node-days, per named source."""
    target_stall_s: float
    """Target stall of a synchronous save, for the FSx throughput table."""
    days: float
    """Wall-clock length of each simulated job."""
    trials: int
    """Monte Carlo jobs simulated per configuration."""
    seed: int
    """Seed of the Monte Carlo generator."""
    sources: dict[str, str]
    """Where ckpt_stall_s and restart_s came from (flag, bench file or built-in)."""


@dataclass(frozen=True)
class MonteCarlo:
    """ETTR over simulated jobs."""

    mean: float
    """Mean ETTR."""
    p5: float
    """5th percentile ETTR (an unlucky job)."""
    p95: float
    """95th percentile ETTR."""
    failures_mean: float
    """Mean failures per job."""


@dataclass(frozen=True)
class PlanRow:
    """One configuration: cluster size x failure rate x restart mode."""

    gpus: int
    """GPUs in the job."""
    nodes: int
    """Nodes in the job."""
    rate_name: str
    """llama3, rsc1, rsc2 or the number given."""
    failures_per_1000_node_days: float
    """The failure rate."""
    mode: str
    """Restart mode (inprocess, injob, cold or custom)."""
    restart_s: float
    """Restart cost R."""
    mtbf_s: float
    """Job mean time between failures M."""
    interval_young_s: float
    """Young's optimal interval sqrt(2 delta M)."""
    interval_s: float
    """Daly's optimal interval rounded to whole steps (what the plan uses)."""
    interval_steps: int
    """interval_s in optimizer steps."""
    ettr_first_order: float
    """First-order ETTR at interval_s."""
    ettr_formula: float
    """Daly's exact-model ETTR at interval_s."""
    mc: MonteCarlo
    """Monte Carlo ETTR at interval_s."""


@dataclass(frozen=True)
class FsxNeed:
    """FSx throughput (and PERSISTENT_2 capacity) to write a full checkpoint in a time."""

    label: str
    """What the time is (a sync stall target, or an async write within the interval)."""
    seconds: float
    """Time allowed to write the whole checkpoint."""
    throughput_gbps: float
    """Aggregate write throughput needed, GB/s (decimal)."""
    capacity_tib: dict[int, float]
    """Storage (TiB, rounded up to a valid PERSISTENT_2 size) per MB/s/TiB tier."""


def format_params(params: float) -> str:
    """70e9 -> '70B', 1.5e12 -> '1.5T', 125e6 -> '125M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if params >= scale:
            return f"{params / scale:.3g}{suffix}"
    return f"{params:.3g}"


# --- formulas -------------------------------------------------------------------------------


def job_mtbf_s(*, failures_per_1000_node_days: float, gpus: int, gpus_per_node: int) -> float:
    """Mean time between failures of the whole job (a partial node still fails like a node)."""
    nodes = math.ceil(gpus / gpus_per_node)
    return SECONDS_PER_DAY / (failures_per_1000_node_days / 1000.0 * nodes)


def young_interval_s(*, stall_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 delta M)."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval_s(*, stall_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum; tau = M once the stall reaches 2M."""
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = stall_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * stall_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall_s


def ettr_first_order(
    *, interval_s: float, stall_s: float, restart_s: float, mtbf_s: float
) -> float:
    """tau/(tau+delta) * (1 - (R + (tau+delta)/2) / M), floored at 0."""
    cycle = interval_s + stall_s
    return max(0.0, interval_s / cycle * (1.0 - (restart_s + cycle / 2.0) / mtbf_s))


def ettr_formula(*, interval_s: float, stall_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly (2006) for exponential failures: tau / (M e^(R/M) (e^((tau+delta)/M) - 1))."""
    return interval_s / (
        mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + stall_s) / mtbf_s)
    )


def simulate_ettr(
    *,
    unit_arrivals: np.ndarray,
    mtbf_s: float,
    interval_s: float,
    stall_s: float,
    restart_s: float,
    job_s: float,
) -> MonteCarlo:
    """ETTR of simulated jobs of job_s seconds.

    unit_arrivals is (trials, n): cumulative sums of unit exponentials, so ``unit_arrivals *
    mtbf_s`` are Poisson failure times at rate 1/M. Sharing it across configurations (common
    random numbers) makes comparisons between modes and sizes far less noisy. Its last column
    must reach job_s for every trial. Between two failures (a segment) the job restarts (R, none
    for the first segment), then runs whole tau+delta cycles; a failure loses the unfinished
    cycle, the end of the job keeps the work since the last checkpoint.
    """
    arrivals = unit_arrivals * mtbf_s
    if (arrivals[:, -1] < job_s).any():
        raise ValueError("unit_arrivals too short for this job length and MTBF")
    ends = np.minimum(arrivals, job_s)
    starts = np.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    length = ends - starts  # 0 for segments after the job's end
    cost = np.full(length.shape, restart_s)
    cost[:, 0] = 0.0
    usable = np.maximum(length - cost, 0.0)
    cycle = interval_s + stall_s
    cycles = np.floor(usable / cycle)
    work = cycles * interval_s
    by_failure = arrivals < job_s
    tail = np.minimum(usable - cycles * cycle, interval_s)
    work = np.where(by_failure, work, work + tail)
    ettr = work.sum(axis=1) / job_s
    return MonteCarlo(
        mean=float(ettr.mean()),
        p5=float(np.percentile(ettr, 5)),
        p95=float(np.percentile(ettr, 95)),
        failures_mean=float(by_failure.sum(axis=1).mean()),
    )


def unit_arrivals(*, trials: int, max_failures_mean: float, seed: int) -> np.ndarray:
    """Cumulative unit exponentials, long enough for a Poisson count of mean max_failures_mean."""
    # 10 standard deviations past the mean: running short is then practically impossible, and
    # simulate_ettr checks anyway.
    n = int(max_failures_mean + 10.0 * math.sqrt(max_failures_mean) + 20)
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0, size=(trials, n)), axis=1)


def plan(*, inputs: PlannerInputs) -> list[PlanRow]:
    """Every gpus x failure rate x restart mode configuration, by formula and by simulation."""
    job_s = inputs.days * SECONDS_PER_DAY
    mtbfs = {
        (g, name): job_mtbf_s(
            failures_per_1000_node_days=rate, gpus=g, gpus_per_node=inputs.gpus_per_node
        )
        for g in inputs.gpus
        for name, rate in inputs.failure_rates.items()
    }
    units = unit_arrivals(
        trials=inputs.trials, max_failures_mean=job_s / min(mtbfs.values()), seed=inputs.seed
    )
    rows: list[PlanRow] = []
    for g in inputs.gpus:
        for name, rate in inputs.failure_rates.items():
            mtbf = mtbfs[(g, name)]
            young = young_interval_s(stall_s=inputs.ckpt_stall_s, mtbf_s=mtbf)
            daly = daly_interval_s(stall_s=inputs.ckpt_stall_s, mtbf_s=mtbf)
            # A checkpoint can only happen between steps: round to whole steps (at least one).
            steps = max(1, round(daly / inputs.step_time_s))
            tau = steps * inputs.step_time_s
            for mode, restart in inputs.restart_s.items():
                kw = {
                    "interval_s": tau,
                    "stall_s": inputs.ckpt_stall_s,
                    "restart_s": restart,
                    "mtbf_s": mtbf,
                }
                rows.append(
                    PlanRow(
                        gpus=g,
                        nodes=math.ceil(g / inputs.gpus_per_node),
                        rate_name=name,
                        failures_per_1000_node_days=rate,
                        mode=mode,
                        restart_s=restart,
                        mtbf_s=mtbf,
                        interval_young_s=young,
                        interval_s=tau,
                        interval_steps=steps,
                        ettr_first_order=ettr_first_order(**kw),
                        ettr_formula=ettr_formula(**kw),
                        mc=simulate_ettr(unit_arrivals=units, job_s=job_s, **kw),
                    )
                )
    return rows


def fsx_capacity_tib(*, throughput_mbps: float, tier_mbps_per_tib: int) -> float:
    """Smallest valid PERSISTENT_2 size (1.2 TiB + n x 2.4 TiB) giving the throughput."""
    raw = throughput_mbps / tier_mbps_per_tib
    if raw <= FSX_MIN_TIB:
        return FSX_MIN_TIB
    # Round to 9 decimals first so that an exact size does not round up by float noise.
    return FSX_MIN_TIB + math.ceil(round((raw - FSX_MIN_TIB) / FSX_STEP_TIB, 9)) * FSX_STEP_TIB


def fsx_need(*, state_bytes: float, seconds: float, label: str) -> FsxNeed:
    """Throughput to write state_bytes in seconds, and the storage each tier needs for it."""
    mbps = state_bytes / seconds / MB
    return FsxNeed(
        label=label,
        seconds=seconds,
        throughput_gbps=mbps / 1000.0,
        capacity_tib={
            t: fsx_capacity_tib(throughput_mbps=mbps, tier_mbps_per_tib=t)
            for t in FSX_TIERS_MBPS_PER_TIB
        },
    )


def fsx_needs(*, inputs: PlannerInputs, rows: list[PlanRow]) -> list[FsxNeed]:
    """A sync save within the target stall, and per size an async write within the interval."""
    state = inputs.params * inputs.bytes_per_param
    needs = [fsx_need(state_bytes=state, seconds=inputs.target_stall_s, label="sync save")]
    for g in inputs.gpus:
        # The shortest interval (highest failure rate) is the one the background write must meet.
        tau = min(r.interval_s for r in rows if r.gpus == g)
        needs.append(fsx_need(state_bytes=state, seconds=tau, label=f"async @ {g} GPUs"))
    return needs


# --- defaults from the benchmarks -----------------------------------------------------------


def _bench_value(path: Path, key: str) -> float | None:
    """A positive number under key in a JSON file, or None (file absent, unreadable or no key)."""
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def bench_defaults(*, bench_dir: Path) -> tuple[float, dict[str, float], dict[str, str]]:
    """Checkpoint stall and restart costs from bench/results, else the built-in defaults."""
    sources: dict[str, str] = {}
    ckpt_file = bench_dir / "checkpoint.json"
    stall = _bench_value(ckpt_file, "nvrx_async_blocking_s")
    sources["ckpt_stall_s"] = f"{ckpt_file} nvrx_async_blocking_s" if stall else "built-in"
    restart: dict[str, float] = {}
    restart_file = bench_dir / "restart.json"
    for mode, key in BENCH_RESTART_KEYS.items():
        value = _bench_value(restart_file, key)
        restart[mode] = value if value is not None else BUILTIN_RESTART_S[mode]
        sources[f"restart_s.{mode}"] = f"{restart_file} {key}" if value is not None else "built-in"
    return (stall if stall is not None else BUILTIN_CKPT_STALL_S), restart, sources


# --- CLI ------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (naming the flag) and exit 2, without the usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(v)) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated GPU counts like 1024,4096, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive GPU counts, got {text!r}")
    return tuple(sorted(set(values)))


def _failure_rates(text: str) -> dict[str, float]:
    rates: dict[str, float] = {}
    for item in (v.strip() for v in text.split(",")):
        if item.lower() in FAILURE_RATES:
            rates[item.lower()] = FAILURE_RATES[item.lower()]
            continue
        try:
            value = float(item)
        except ValueError:
            value = float("nan")
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(
                f"expected {'|'.join(FAILURE_RATES)} or failures per 1000 node-days, got {item!r}"
            )
        rates[item] = value
    return rates


def _restart_costs(text: str) -> dict[str, float]:
    """'30' (one mode, "custom") or 'inprocess=30,cold=600' (override those modes)."""
    if "=" not in text:
        return {"custom": _positive(text)}
    costs: dict[str, float] = {}
    for item in text.split(","):
        mode, _, value = item.partition("=")
        mode = mode.strip()
        if mode not in BUILTIN_RESTART_S:
            raise argparse.ArgumentTypeError(
                f"unknown restart mode {mode!r}: use {', '.join(BUILTIN_RESTART_S)} or one number"
            )
        costs[mode] = _positive(value)
    return costs


def build_parser() -> argparse.ArgumentParser:
    """The planner's command line."""
    p = _Parser(
        prog="python -m training.planner",
        description="Optimal checkpoint interval, expected ETTR and FSx throughput for a cluster.",
    )
    p.add_argument("--params", type=_positive, default=70e9, help="model parameters (70e9)")
    p.add_argument("--bytes-per-param", type=_positive, default=16.0, help="checkpoint bytes/param")
    p.add_argument(
        "--gpus", type=_gpu_list, default=(1024, 4096, 16384, 65536, 100000), help="GPU counts"
    )
    p.add_argument("--gpus-per-node", type=_positive_int, default=8)
    p.add_argument("--step-time-s", type=_positive, default=10.0, help="seconds per step (10)")
    p.add_argument(
        "--ckpt-stall-s", type=_positive, help="checkpoint stall; default: bench or built-in"
    )
    p.add_argument(
        "--restart-s",
        type=_restart_costs,
        help="restart cost: one number, or mode=seconds,... (inprocess, injob, cold)",
    )
    p.add_argument(
        "--failure-rate",
        type=_failure_rates,
        default=dict(FAILURE_RATES),
        help="llama3|rsc1|rsc2|<failures per 1000 node-days>, comma-separated (all three)",
    )
    p.add_argument(
        "--target-stall-s", type=_positive, default=30.0, help="sync save stall target (30)"
    )
    p.add_argument("--days", type=_positive, default=7.0, help="simulated job length (7)")
    p.add_argument("--trials", type=_positive_int, default=400, help="simulated jobs per config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--out", type=Path, default=Path("docs/planner.png"), help="plot path")
    p.add_argument("--no-plot", action="store_true", help="skip the plot")
    return p


def inputs_from_args(args: argparse.Namespace) -> PlannerInputs:
    """Resolve flags, bench results and built-in defaults into PlannerInputs."""
    stall, restart, sources = bench_defaults(bench_dir=args.bench_dir)
    if args.ckpt_stall_s is not None:
        stall, sources["ckpt_stall_s"] = args.ckpt_stall_s, "--ckpt-stall-s"
    if args.restart_s is not None:
        if "custom" in args.restart_s:
            restart = dict(args.restart_s)
            sources = {k: v for k, v in sources.items() if not k.startswith("restart_s.")}
        else:
            restart = {**restart, **args.restart_s}
        for mode in args.restart_s:
            sources[f"restart_s.{mode}"] = "--restart-s"
    return PlannerInputs(
        params=args.params,
        bytes_per_param=args.bytes_per_param,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        step_time_s=args.step_time_s,
        ckpt_stall_s=stall,
        restart_s=restart,
        failure_rates=args.failure_rate,
        target_stall_s=args.target_stall_s,
        days=args.days,
        trials=args.trials,
        seed=args.seed,
        sources=sources,
    )


def format_tables(*, inputs: PlannerInputs, rows: list[PlanRow], fsx: list[FsxNeed]) -> str:
    """Plain-text tables: inputs, intervals, ETTR, FSx."""
    out = ["Inputs"]
    state = inputs.params * inputs.bytes_per_param
    out.append(
        f"  model {format_params(inputs.params)} params x {inputs.bytes_per_param:g} B = "
        f"{state / 1e12:.3g} TB checkpoint; step {inputs.step_time_s:g} s; "
        f"{inputs.gpus_per_node} GPUs/node; {inputs.days:g}-day jobs x {inputs.trials} trials, "
        f"seed {inputs.seed}"
    )
    out.append(f"  checkpoint stall {inputs.ckpt_stall_s:g} s  [{inputs.sources['ckpt_stall_s']}]")
    for mode, r in inputs.restart_s.items():
        out.append(
            f"  restart {mode:<9} {r:g} s  [{inputs.sources.get(f'restart_s.{mode}', 'built-in')}]"
        )
    rates = ", ".join(f"{k} {v:g}" for k, v in inputs.failure_rates.items())
    out.append(f"  failures per 1000 node-days: {rates}")

    out += ["", "Optimal checkpoint interval (Young 1974 / Daly 2006; plan uses Daly, whole steps)"]
    out.append(
        f"  {'GPUs':>7} {'nodes':>6} {'rate':<8} {'MTBF':>8} {'Young':>8} {'Daly':>8} {'steps':>6} "
        f"{'GB/GPU':>7}"
    )
    seen: set[tuple[int, str]] = set()
    for r in rows:
        if (r.gpus, r.rate_name) in seen:
            continue
        seen.add((r.gpus, r.rate_name))
        out.append(
            f"  {r.gpus:>7} {r.nodes:>6} {r.rate_name:<8} {r.mtbf_s / 3600:>7.2f}h "
            f"{r.interval_young_s:>7.0f}s {r.interval_s:>7.0f}s {r.interval_steps:>6} "
            f"{state / r.gpus / 1e9:>7.2f}"
        )

    out += ["", "Expected ETTR (formula: first order | Daly; Monte Carlo: mean [p5, p95])"]
    out.append(
        f"  {'GPUs':>7} {'rate':<8} {'mode':<9} {'R':>6} {'1st-ord':>8} {'Daly':>7} "
        f"{'MC mean':>8} {'[p5, p95]':>16} {'fails/job':>9}"
    )
    for r in rows:
        out.append(
            f"  {r.gpus:>7} {r.rate_name:<8} {r.mode:<9} {r.restart_s:>5.0f}s "
            f"{r.ettr_first_order:>8.1%} {r.ettr_formula:>7.1%} {r.mc.mean:>8.1%} "
            f"  [{r.mc.p5:>5.1%}, {r.mc.p95:>5.1%}] {r.mc.failures_mean:>9.1f}"
        )

    out += [
        "",
        "FSx for Lustre PERSISTENT_2 to write the whole checkpoint in time "
        "(capacity rounded up to 1.2 TiB + n x 2.4 TiB)",
    ]
    tiers = "".join(f"{f'@{t} MB/s/TiB':>16}" for t in FSX_TIERS_MBPS_PER_TIB)
    out.append(f"  {'requirement':<20} {'within':>8} {'GB/s':>8}{tiers}")
    for n in fsx:
        caps = "".join(f"{n.capacity_tib[t]:>12.1f} TiB" for t in FSX_TIERS_MBPS_PER_TIB)
        out.append(f"  {n.label:<20} {n.seconds:>7.0f}s {n.throughput_gbps:>8.2f}{caps}")
    return "\n".join(out)


def plot_plan(*, inputs: PlannerInputs, rows: list[PlanRow], out: Path) -> Path:
    """ETTR vs GPUs (log x): Daly formula lines and Monte Carlo markers with p5-p95 bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6), dpi=100)
    colors = plt.get_cmap("tab10")
    styles = ["-", "--", ":", "-."]
    grid = np.geomspace(min(inputs.gpus), max(inputs.gpus), 60)
    for ri, (rname, rate) in enumerate(inputs.failure_rates.items()):
        for mi, (mode, restart) in enumerate(inputs.restart_s.items()):
            line = []
            for g in grid:
                mtbf = job_mtbf_s(
                    failures_per_1000_node_days=rate,
                    gpus=int(g),
                    gpus_per_node=inputs.gpus_per_node,
                )
                tau = (
                    max(
                        1,
                        round(
                            daly_interval_s(stall_s=inputs.ckpt_stall_s, mtbf_s=mtbf)
                            / inputs.step_time_s
                        ),
                    )
                    * inputs.step_time_s
                )
                line.append(
                    ettr_formula(
                        interval_s=tau, stall_s=inputs.ckpt_stall_s, restart_s=restart, mtbf_s=mtbf
                    )
                )
            color = colors(mi % 10)
            ax.plot(
                grid,
                line,
                styles[ri % len(styles)],
                color=color,
                lw=1.3,
                label=f"{mode} (R={restart:g}s), {rname} ({rate:g}/1k node-days)",
            )
            sel = [r for r in rows if r.rate_name == rname and r.mode == mode]
            xs = np.array([r.gpus for r in sel], dtype=float)
            ys = np.array([r.mc.mean for r in sel])
            err = np.array(
                [[r.mc.mean - r.mc.p5 for r in sel], [r.mc.p95 - r.mc.mean for r in sel]]
            )
            ax.errorbar(xs, ys, yerr=err, fmt="o", ms=4, color=color, capsize=2, lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (productive / wall)")
    ax.set_title(
        f"Expected ETTR, {format_params(inputs.params)}-param model, checkpoint stall "
        f"{inputs.ckpt_stall_s:g} s at Daly's interval\n"
        f"lines: Daly (2006) formula; markers: Monte Carlo mean, p5-p95 "
        f"({inputs.trials} x {inputs.days:g}-day jobs)",
        fontsize=10,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: print the tables and (unless --no-plot) write the plot."""
    args = build_parser().parse_args(argv)
    inputs = inputs_from_args(args)
    rows = plan(inputs=inputs)
    print(format_tables(inputs=inputs, rows=rows, fsx=fsx_needs(inputs=inputs, rows=rows)))
    if not args.no_plot:
        print(f"\nwrote {plot_plan(inputs=inputs, rows=rows, out=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

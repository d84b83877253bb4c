"""Failure rates and the mix of failure kinds, each with the recovery it needs.

Rates are failures per 1,000 node-days (8 GPUs per node). Llama 3: 419 unexpected interruptions
in 54 days on 2,048 nodes = 3.79 (``llama3``); Meta's research clusters RSC-1 6.5 and RSC-2 2.34
(``rsc1``, ``rsc2``).

The mix comes from the counts of the Llama 3 paper's Table 5 (419 unexpected interruptions by
root cause). The paper's text says "~78%" hardware and its table's percentages do not add up
to its counts; the counts are the primary data, so the planner uses them:

- ``gpu`` (268: faulty GPU 148, HBM3 72, SRAM 19, GPU system processor 17, silent data corruption
  6, thermal interface + sensor 6): a GPU fault. EKS node auto repair replaces the node after
  its ``AcceleratedHardwareReady`` condition has failed for 10 min.
- ``host`` (53: unplanned host maintenance 32, NIC 7, SSD 3, power supply 3, server chassis 2,
  IO expansion board 2, CPU 2, system memory 2): the host itself. Repair waits 30 min on the
  node's ``Ready`` condition (EKS User Guide, node-repair.html; grouping: an estimate).
- ``software`` (56: software bugs 54, dependencies 2): a process raises or exits; recoverable in
  place. Per node (the default, as Llama 3's rate is quoted) or per job (``per_job_software``:
  a bug in the training code fails the job at the same rate whatever its size; Llama 3's count
  is then 56 in 54 days for the whole job).
- ``network`` (42: switch/cable 35, NCCL watchdog timeouts 7): ranks hang; recoverable in place.
- ``manual``: "significant manual intervention was required only three times" in the same 54
  days (Llama 3, sec. 3.3.4): 3 of the 419, taken from every kind in proportion, each waiting
  for a person (``manual_intervention_s``, an estimate) before a whole-job restart.

Planned interruptions (47 in the same 54 days: firmware upgrades, configuration and dataset
updates) checkpoint first and lose no work; the report charges them separately
(``planned_per_day``), per job.

Which kinds strike an idle cluster (during a recovery): node hardware (``gpu``, ``host``) fails
whether or not it trains; software faults and NCCL timeouts need the training code running.
An estimate (no publication splits failures by load): ``strikes_idle`` per kind.

Hot spares are in ``planner.spares`` (an Erlang loss pool). Lemon nodes: a share of hardware
failures that come from repeat offenders (Kokolis et al. describe detecting and removing them);
``exclude_lemons`` removes that share. No published share for a Llama 3-like job: default 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.spares import erlang_b

SECONDS_PER_DAY = 86_400.0

FAILURE_RATES: dict[str, float] = {"llama3": 3.8, "rsc1": 6.5, "rsc2": 2.34}
"""Failures per 1,000 node-days (sources: llama3 -> Dubey et al. 2024; rsc1/rsc2 -> Kokolis et
al. 2025)."""
RATE_SOURCES: dict[str, str] = {"llama3": "llama3", "rsc1": "rsc", "rsc2": "rsc"}

LLAMA3_COUNTS: dict[str, int] = {"hardware": 321, "software": 56, "network": 42}
"""Table 5 of the Llama 3 paper, grouped by the recovery each needs (419 in all)."""
LLAMA3_HARDWARE: dict[str, int] = {"gpu": 268, "host": 53}
"""Table 5's hardware rows split by the EKS repair condition they trip (sums to 321)."""
LLAMA3_MANUAL = 3
"""Interruptions that needed significant manual intervention (sec. 3.3.4)."""
LLAMA3_PLANNED = 47
"""Planned interruptions in the same snapshot (sec. 3.3.4)."""
LLAMA3_DAYS = 54
LLAMA3_NODES = 2048
PLANNED_PER_DAY = LLAMA3_PLANNED / LLAMA3_DAYS
"""Planned interruptions per day of one job (Llama 3)."""


@dataclass(frozen=True, kw_only=True)
class FailureKind:
    """One kind of failure and the recovery it needs."""

    name: str
    """gpu, host, software, network or manual."""
    share: float
    """Fraction of all failures (at Llama 3's size when some kinds are per job)."""
    needs_node: bool
    """True when the node must be replaced (no restart in place)."""
    hangs: bool
    """True when peers block until a timeout notices (no exception, no exit)."""
    host: bool = False
    """The node stops answering: repair waits on the node's Ready condition (30 min)."""
    manual: bool = False
    """A person must intervene before the job can restart."""
    strikes_idle: bool = False
    """Also strikes while the job is recovering (estimate, see the module docstring)."""
    per_job: bool = False
    """The rate is per job, not per node (scaled from Llama 3's 2,048 nodes)."""


def llama3_mix(
    *, hardware_share: float | None = None, per_job_software: bool = False
) -> tuple[FailureKind, ...]:
    """The Llama 3 mix; ``hardware_share`` rescales gpu + host, the rest keeps its proportions."""
    total = sum(LLAMA3_COUNTS.values())
    shares = {k: v / total for k, v in LLAMA3_COUNTS.items()}
    if hardware_share is not None:
        if not 0.0 <= hardware_share <= 1.0:
            raise ValueError(f"hardware share must be within [0, 1], got {hardware_share}")
        rest = 1.0 - shares["hardware"]
        shares = {
            k: hardware_share if k == "hardware" else v / rest * (1.0 - hardware_share)
            for k, v in shares.items()
        }
    keep = 1.0 - LLAMA3_MANUAL / total
    hw = sum(LLAMA3_HARDWARE.values())
    return (
        FailureKind(
            name="gpu",
            share=keep * shares["hardware"] * LLAMA3_HARDWARE["gpu"] / hw,
            needs_node=True,
            hangs=True,
            strikes_idle=True,
        ),
        FailureKind(
            name="host",
            share=keep * shares["hardware"] * LLAMA3_HARDWARE["host"] / hw,
            needs_node=True,
            hangs=True,
            host=True,
            strikes_idle=True,
        ),
        FailureKind(
            name="software",
            share=keep * shares["software"],
            needs_node=False,
            hangs=False,
            per_job=per_job_software,
        ),
        FailureKind(name="network", share=keep * shares["network"], needs_node=False, hangs=True),
        FailureKind(
            name="manual", share=LLAMA3_MANUAL / total, needs_node=False, hangs=True, manual=True
        ),
    )


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A failure kind as it plays out: with or without a hot spare."""

    kind: str
    """The failure kind's name (``gpu+spare`` when a spare took over)."""
    share: float
    """Probability that a failure is this outcome."""
    needs_node: bool
    """A node had to be replaced (by a spare or a new one)."""
    hangs: bool
    """Detected by a timeout."""
    spare: bool = False
    """A hot spare was free and took the failed node's place."""
    host: bool = False
    """Repair waits on the node's Ready condition."""
    manual: bool = False
    """A person intervenes first."""
    strikes_idle: bool = False
    """Also strikes during a recovery."""
    base: str = ""
    """The failure kind this outcome belongs to (``gpu`` for ``gpu+spare``)."""


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """Rate and mix of failures for a job."""

    rate_per_1000_node_days: float
    """All failures, before lemon exclusion."""
    kinds: tuple[FailureKind, ...]
    """The mix (shares sum to 1)."""
    hot_spares: int = 0
    """Nodes waiting, joined and with the image, to replace a failed node."""
    lemon_share: float = 0.0
    """Share of hardware failures from lemon nodes."""
    exclude_lemons: bool = False
    """Lemon nodes are detected and removed: their failures do not happen."""

    def __post_init__(self) -> None:
        if not self.rate_per_1000_node_days > 0:
            raise ValueError("failure rate must be > 0")
        if abs(sum(k.share for k in self.kinds) - 1.0) > 1e-9:
            raise ValueError("failure kind shares must sum to 1")
        if self.hot_spares < 0:
            raise ValueError("hot spares must be >= 0")
        if not 0.0 <= self.lemon_share <= 1.0:
            raise ValueError("lemon share must be within [0, 1]")


def kind_rates_per_s(*, model: FailureModel, nodes: int) -> dict[str, float]:
    """Failures per second of the whole job, by kind, after lemon exclusion."""
    drop = model.lemon_share if model.exclude_lemons else 0.0
    out = {}
    for k in model.kinds:
        scale = LLAMA3_NODES if k.per_job else nodes
        keep = (1.0 - drop) if k.needs_node else 1.0
        out[k.name] = model.rate_per_1000_node_days * k.share * keep / 1000.0 * scale
    return {name: r / SECONDS_PER_DAY for name, r in out.items()}


def job_failure_rate_per_s(*, model: FailureModel, nodes: int) -> float:
    """Failures per second of the whole job."""
    return sum(kind_rates_per_s(model=model, nodes=nodes).values())


def node_failure_rate_per_s(*, model: FailureModel, nodes: int) -> float:
    """Failures per second that need a node (and so a spare)."""
    rates = kind_rates_per_s(model=model, nodes=nodes)
    return sum(rates[k.name] for k in model.kinds if k.needs_node)


def poisson_sf(*, k: int, mean: float) -> float:
    """P(X >= k) for X ~ Poisson(mean), summed from the tail (no 1 - cdf cancellation)."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    term = math.exp(-mean + k * math.log(mean) - math.lgamma(k + 1))
    total, i = 0.0, k
    # Terms fall once i > mean; stop when they no longer change the sum.
    while term > 0 and (i <= mean or term > total * 1e-17):
        total += term
        i += 1
        term *= mean / i
    return min(1.0, total)


def no_spare_chance(*, model: FailureModel, nodes: int, refill_s: float) -> float:
    """The chance that a node failure finds no spare (Erlang B, planner.spares)."""
    load = node_failure_rate_per_s(model=model, nodes=nodes) * refill_s
    return erlang_b(spares=model.hot_spares, load=load)


def outcomes(*, model: FailureModel, nodes: int, refill_s: float) -> tuple[Outcome, ...]:
    """The outcomes of a failure and their probabilities (sum 1), hot spares considered."""
    rates = kind_rates_per_s(model=model, nodes=nodes)
    total = sum(rates.values())
    blocked = no_spare_chance(model=model, nodes=nodes, refill_s=refill_s)
    out: list[Outcome] = []
    for k in model.kinds:
        share = rates[k.name] / total
        common = {
            "needs_node": k.needs_node,
            "hangs": k.hangs,
            "host": k.host,
            "manual": k.manual,
            "strikes_idle": k.strikes_idle,
            "base": k.name,
        }
        if k.needs_node and model.hot_spares > 0:
            out.append(
                Outcome(kind=f"{k.name}+spare", share=share * (1.0 - blocked), spare=True, **common)
            )
            share *= blocked
        out.append(Outcome(kind=k.name, share=share, **common))
    return tuple(o for o in out if o.share > 0)

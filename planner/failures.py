"""Failure rates and the mix of failure kinds, each with the recovery it needs.

Rates are failures per 1,000 node-days (8 GPUs per node). Llama 3: 419 interruptions in 54
days on 2,048 nodes = 3.79 (``llama3``); Meta's research clusters RSC-1 6.5 and RSC-2 2.34
(``rsc1``, ``rsc2``).

The mix comes from the Llama 3 paper's Table 5 (419 unexpected interruptions, by root cause):

- ``hardware`` (321: faulty GPU 148, HBM3 72, unplanned host maintenance 32, SRAM 19, GPU
  system processor 17, NIC 7, silent data corruption 6, thermal 6, SSD 3, power 3, chassis 2,
  IO board 2, CPU 2, DRAM 2): 76.6%, which the paper rounds with the suspected cases to
  "approximately 78%". The node has to be replaced; its peers hang in a collective until a
  timeout notices.
- ``software`` (56: software bugs 54, dependencies 2): 13.4%, a process raises or exits;
  recoverable in place.
- ``network`` (42: switch/cable 35, NCCL watchdog timeouts 7): 10.0%, ranks hang; recoverable
  in place once the fabric re-routes.

The same mix is applied to every rate (only Llama 3 published one for a single large job).

Hot spares: ``K`` nodes already joined and with the image pulled. A spare is used up until the
failed node is replaced (``node_replace_s``), so the spares in repair are Poisson with mean
``lambda_hw * node_replace_s``; a hardware failure finds no spare with probability
``P(Poisson >= K)``, and then waits for a new node.

Lemon nodes: a share of hardware failures that come from repeat offenders (Kokolis et al.
describe detecting and removing them). ``--exclude-lemons`` removes that share of the hardware
rate. No published share for a Llama 3-like job exists, so the default share is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400.0

FAILURE_RATES: dict[str, float] = {"llama3": 3.8, "rsc1": 6.5, "rsc2": 2.34}
"""Failures per 1,000 node-days (sources: llama3 -> Dubey et al. 2024; rsc1/rsc2 -> Kokolis et
al. 2025)."""
RATE_SOURCES: dict[str, str] = {"llama3": "llama3", "rsc1": "rsc", "rsc2": "rsc"}


@dataclass(frozen=True, kw_only=True)
class FailureKind:
    """One kind of failure and the recovery it needs."""

    name: str
    """hardware, software or network."""
    share: float
    """Fraction of all failures."""
    needs_node: bool
    """True when the node must be replaced (no restart in place)."""
    hangs: bool
    """True when peers block until a timeout notices (no exception, no exit)."""


LLAMA3_COUNTS: dict[str, int] = {"hardware": 321, "software": 56, "network": 42}
"""Table 5 of the Llama 3 paper, grouped by the recovery each needs (419 in all)."""


def llama3_mix(*, hardware_share: float | None = None) -> tuple[FailureKind, ...]:
    """The Llama 3 mix; ``hardware_share`` rescales hardware, the rest keeps its proportions."""
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
    return (
        FailureKind(name="hardware", share=shares["hardware"], needs_node=True, hangs=True),
        FailureKind(name="software", share=shares["software"], needs_node=False, hangs=False),
        FailureKind(name="network", share=shares["network"], needs_node=False, hangs=True),
    )


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A failure kind as it plays out: with or without a hot spare."""

    kind: str
    """The failure kind's name (``hardware+spare`` when a spare took over)."""
    share: float
    """Probability that a failure is this outcome."""
    needs_node: bool
    """A node had to be replaced (by a spare or a new one)."""
    hangs: bool
    """Detected by a timeout."""
    spare: bool = False
    """A hot spare was free and took the failed node's place."""


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


def _weights(model: FailureModel) -> dict[str, float]:
    """Failures per 1,000 node-days by kind, after lemon exclusion."""
    drop = model.lemon_share if model.exclude_lemons else 0.0
    return {
        k.name: model.rate_per_1000_node_days * k.share * ((1.0 - drop) if k.needs_node else 1.0)
        for k in model.kinds
    }


def job_failure_rate_per_s(*, model: FailureModel, nodes: int) -> float:
    """Failures per second of the whole job."""
    return sum(_weights(model).values()) / 1000.0 * nodes / SECONDS_PER_DAY


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


def outcomes(*, model: FailureModel, nodes: int, node_replace_s: float) -> tuple[Outcome, ...]:
    """The outcomes of a failure and their probabilities (sum 1), hot spares considered."""
    weights = _weights(model)
    total = sum(weights.values())
    out: list[Outcome] = []
    for k in model.kinds:
        share = weights[k.name] / total
        if k.needs_node and model.hot_spares > 0:
            hw_rate = weights[k.name] / 1000.0 * nodes / SECONDS_PER_DAY
            no_spare = poisson_sf(k=model.hot_spares, mean=hw_rate * node_replace_s)
            out.append(
                Outcome(
                    kind=f"{k.name}+spare",
                    share=share * (1.0 - no_spare),
                    needs_node=True,
                    hangs=k.hangs,
                    spare=True,
                )
            )
            share *= no_spare
        out.append(Outcome(kind=k.name, share=share, needs_node=k.needs_node, hangs=k.hangs))
    return tuple(o for o in out if o.share > 0)

"""Published results the model is checked against, reproduced from their own inputs
(``python -m planner --sanity``).

Each row gives the publication's figure, what the planner computes from the publication's own
inputs (where it published them) and what the planner adds or leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner import ettr
from planner.costs import cluster_model
from planner.failures import FAILURE_RATES, SECONDS_PER_DAY
from planner.plan import Inputs, plan
from planner.tiers import OFF
from training.tables import text_table


@dataclass(frozen=True, kw_only=True)
class Row:
    """One published result and the planner's reproduction."""

    source: str
    claim: str
    published: str
    planner: str
    notes: str


def kokolis(*, interval_min: float) -> tuple[float, float]:
    """Kokolis et al.'s 16k-GPU projection on RSC-1: their first-order E[ETTR] and the planner's
    exact form, from their inputs (2,048 nodes, 6.5 failures/1,000 node-days, restart overhead
    u0 = 5 min, non-blocking checkpoints, no queueing)."""
    mttf_s = SECONDS_PER_DAY / (FAILURE_RATES["rsc1"] / 1000.0 * 2048)
    u0 = 300.0
    tau = interval_min * 60.0
    first_order = 1.0 - (u0 + tau / 2.0) / mttf_s
    exact = float(
        ettr.ettr_model(
            interval_s=tau, stall_s=0.0, write_s=0.0, drag=0.0, mtbf_s=mttf_s, outage=u0
        )
    )
    return first_order, exact


def _inputs(*, gpus: int, params: float, hot_spares: int | None) -> Inputs:
    return Inputs(
        params=params,
        bytes_per_param=12.0,
        gpus=(gpus,),
        gpus_per_node=8,
        step_time_s=10.0,
        failure_rates={"llama3": FAILURE_RATES["llama3"]},
        hardware_share=None,
        hot_spares=hot_spares,
        lemon_share=0.0,
        exclude_lemons=False,
        keep=3,
        fsx_capacity_gib=None,
        fsx_tier=None,
        model=cluster_model(),
        days=7.0,
        trials=1,
        seed=0,
    )


def rows() -> list[Row]:
    """The sanity table."""
    out: list[Row] = []
    llama = {
        k: plan(inputs=_inputs(gpus=16_384, params=405e9, hot_spares=k), simulate=False)[0].rates[0]
        for k in (0, None)
    }
    no_sp, sp = llama[0], llama[None]
    out.append(
        Row(
            source="llama3",
            claim="16,384 H100, 405B, 54 days: '>90% effective training time'",
            published=">90%",
            planner=(
                f"in-job {no_sp.modes['injob'].ettr:.1%}, nested {no_sp.modes['nested'].ettr:.1%}"
                f" (no spares); {sp.modes['nested'].ettr:.1%} with {sp.spares.in_force.count} "
                f"spares; planned stops -{no_sp.planned_loss:.1%}"
            ),
            notes=(
                "inputs: the paper's rate (419 in 54 days) and Table 5 mix; its restart and "
                "checkpoint times are not published, so the planner's cost model stands in. "
                "Adds commit lag, host-fault repair waits, manual interventions; omits Meta's "
                "own tooling (NCCLX start-up, fast diagnosis) and the 47 planned stops' exact cost"
            ),
        )
    )
    size = plan(inputs=_inputs(gpus=9_600, params=70e9, hot_spares=None), simulate=False)[0]
    tiered = size.rates[0].modes["nested"]
    # The mean outage X that would give 97% at the storage-only interval (that closed form,
    # where every failure restores from FSx, solved for X).
    size = plan(
        inputs=replace(_inputs(gpus=9_600, params=70e9, hot_spares=None), tiers=OFF),
        simulate=False,
    )[0]
    bytedance = size.rates[0]
    nested = bytedance.modes["nested"]
    m = bytedance.mtbf_s
    c = float(
        ettr.cycle_s(
            interval_s=nested.interval_s, stall_s=size.stall_s, write_s=nested.write_s, drag=0.0
        )
    )
    needed = nested.interval_s * math.exp(-nested.write_s / m) / (0.97 * math.expm1(c / m)) - m
    out.append(
        Row(
            source="byterobust",
            claim="9,600 GPUs, three months, warm standby: 97% ETTR",
            published="97%",
            planner=(
                f"nested {tiered.ettr:.1%} with {bytedance.spares.in_force.count} spares and the "
                f"restore tiers; {nested.ettr:.1%} from FSx only (mean outage "
                f"{nested.outage_s:.0f} s; 97% needs <= {max(needed, 0):.0f} s)"
            ),
            notes=(
                "inputs: ByteRobust's failure rate and recovery times were not found in what "
                "was searched, so Llama 3's rate and the planner's costs stand in (70B, 10 s "
                "steps). Adds commit lag and host repair waits; omits in-place hot updates "
                "and its per-step near-zero-overhead checkpoints (an interval of 1 step)"
            ),
        )
    )
    for minutes, claim in ((60.0, "0.70"), (5.0, "0.93")):
        first, exact = kokolis(interval_min=minutes)
        out.append(
            Row(
                source="kokolis-projection",
                claim=f"16,384 GPUs on RSC-1, {minutes:g}-min checkpoints, u0 = 5 min",
                published=claim,
                planner=f"their first-order form {first:.2f}; exact form {exact:.2f}",
                notes=(
                    "inputs: theirs (6.5/1,000 node-days, 2,048 nodes, u0 = 5 min, writes "
                    "non-blocking, no queueing). The exact form keeps the e^(tau/M) growth "
                    "their linear form drops; omits commit lag and failures during recoveries"
                ),
            )
        )
    return out


def format_sanity() -> str:
    """The sanity table as text."""
    found = rows()
    table = [[r.source, r.claim, r.published, r.planner] for r in found]
    lines = ["Sanity: published results vs the planner from their own inputs", ""]
    lines += text_table(
        table, headers=["source", "claim", "published", "planner"], align="<<><", indent="  "
    )
    lines.append("")
    notes = dict.fromkeys(f"  [{r.source}] {r.notes}" for r in found)
    lines += list(notes)
    return "\n".join(lines)

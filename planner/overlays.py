"""The product's own overlays (manifests/sizes.py): their spare counts against the planner's
recommendation, their ETTR with the restore tiers on and off, and what one lost node costs:
the published cluster timers (EKS repair waits, boot, image pull) next to the restart measured
in the pod emulation (bench/results/node_loss.json, labelled as emulation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from facts.recipes import RECIPES
from manifests.sizes import SIZES, OverlaySize
from planner import costs, failures, plan, spares, tiers
from planner.costs import RESTORE_TERMS, Job, Term
from planner.measured import NODE_LOSS_COMMAND, NODE_LOSS_FILE, NodeLoss
from training.modes import MODES
from training.tables import text_table

RESTART_TERMS = ("worker_start_s", "rendezvous_s", "nccl_init_s", *RESTORE_TERMS.values())
"""The terms of a node-loss recovery after the replacement pod runs: what the emulation measures
as ``restart_p50_s``."""


@dataclass(frozen=True, kw_only=True)
class OverlayPlan:
    """One overlay at the first failure rate."""

    size: OverlaySize
    recommended: dict[str, int]
    """Rate name -> the fewest spares keeping P(no spare) below 1%."""
    result: plan.RateResult
    """The plan at the overlay's size, recipe and spare count."""
    inputs: plan.Inputs
    """The inputs of that plan."""

    @property
    def mode(self) -> plan.ModeResult:
        """The overlay's restart mode."""
        return self.result.modes[self.size.restart]

    def lost_node(self, *, spare: bool) -> tuple[str, list[Term]]:
        """A silent host (the node-loss emulation's fault), with or without a spare: its restore
        source and recovery terms in the overlay's mode, at the plan's FSx and tiers."""
        outcome = failures.Outcome(
            kind="host", share=1.0, needs_node=True, hangs=True, host=True, spare=spare
        )
        job = Job(
            gpus=self.size.world_size,
            gpus_per_node=self.size.node_type.gpus,
            ckpt_bytes=self.inputs.ckpt_bytes,
            step_time_s=self.inputs.step_time_s,
            fsx_bytes_per_s=self.mode.fsx.bytes_per_s,
        )
        mode = self.size.restart
        used = self.inputs.tiers if self.mode.memory_interval_steps else tiers.OFF
        source = tiers.restore_source(mode=mode, outcome=outcome, nodes=job.nodes, tiers=used)
        terms = costs.recovery(
            model=self.inputs.model, job=job, mode=mode, outcome=outcome, source=source
        )
        return source, terms

    def lost_node_s(self, *, spare: bool) -> float:
        """Seconds from the loss to training again."""
        return sum(t.seconds for t in self.lost_node(spare=spare)[1])

    def restart_s(self, *, spare: bool) -> float:
        """The model's restart once the replacement runs."""
        return sum(t.seconds for t in self.lost_node(spare=spare)[1] if t.name in RESTART_TERMS)


def overlay_plans(*, inputs: plan.Inputs) -> list[OverlayPlan]:
    """Every overlay, at its recipe's parameters and step time, its spares, the first rate."""
    name, rate = next(iter(inputs.failure_rates.items()))
    refill = inputs.model.params["spare_refill_s"]
    out = []
    for size in SIZES.values():
        recipe = RECIPES[size.recipe]
        recommended = {
            n: spares.spares_needed(
                load=failures.node_failure_rate_per_s(
                    model=inputs.failure_model(r), nodes=size.nodes
                )
                * refill
            )
            for n, r in inputs.failure_rates.items()
        }
        at = replace(
            inputs,
            gpus=(size.world_size,),
            gpus_per_node=size.node_type.gpus,
            params=float(recipe.params),
            step_time_s=recipe.step_time_s,
            failure_rates={name: rate},
            hot_spares=None,
            interval_steps=None,
        )
        result = plan.plan(inputs=at, simulate=False)[0].rates[0]
        out.append(OverlayPlan(size=size, recommended=recommended, result=result, inputs=at))
    return out


def format_overlays(
    *, inputs: plan.Inputs, plans: list[OverlayPlan], measured: NodeLoss | None
) -> list[str]:
    """The overlay table and the lost-node comparison."""
    rate = next(iter(inputs.failure_rates))
    rates = "/".join(inputs.failure_rates)
    rows = []
    for op in plans:
        sp = op.result.spares
        m = op.mode
        rows.append(
            [
                op.size.name,
                str(op.size.nodes),
                op.size.recipe,
                op.size.restart,
                f"{op.size.spares} ({'/'.join(str(v) for v in op.recommended.values())})",
                f"{sp.no_spare_chance:.2%}",
                f"{m.ettr:.2%} | {m.tiers_off_ettr:.2%}",
                f"{op.lost_node_s(spare=True):.0f} | {op.lost_node_s(spare=False):.0f}",
            ]
        )
    out = [
        "",
        f"Overlays (manifests/sizes.py), {rate} rate, each at its recipe and restart mode",
        *text_table(
            rows,
            headers=[
                "overlay",
                "nodes",
                "recipe",
                "mode",
                f"spares (recommended {rates})",
                "P(no spare)",
                "ETTR tiers on | off",
                "lost node s: spare | none",
            ],
            align="<><<>>>>",
            indent="  ",
        ),
        "  A lost node = a silent host: the Job replaces its pod once it is Failed (50 s grace, "
        "the node fencer's wait, EC2 termination, out-of-service taint, PodGC), then the restart; "
        "docs/node-loss.md.",
    ]
    out += _measured(plans=plans, measured=measured)
    return out


def _measured(*, plans: list[OverlayPlan], measured: NodeLoss | None) -> list[str]:
    """The emulation's restart next to the model's, per overlay with more than one node."""
    if measured is None:
        return [
            f"  Node-loss emulation: no bench/results/{NODE_LOSS_FILE} "
            f"(run `{NODE_LOSS_COMMAND}`); published figures only."
        ]
    scale = measured.timer_scale
    out = [
        f"  Node-loss EMULATION (bench/results/{NODE_LOSS_FILE}: {measured.source}); p50 seconds "
        f"from the fault; Kubernetes timers x{scale} = the documented ones they emulate:"
    ]
    rows = []
    for name, case in measured.cases.items():
        ph = case.phases_p50_s
        running = ph["replacement_running"]
        rows.append(
            [
                name,
                str(case.runs),
                f"{ph['pod_failed']:.1f} (x{scale}: {ph['pod_failed'] * scale:.0f})",
                f"{running:.1f} (x{scale}: {running * scale:.0f})",
                f"{case.fault_to_first_step_p50_s:.1f}",
                f"{case.restart_p50_s:.1f}",
                "yes" if case.bit_identical else "NO",
            ]
        )
    out += text_table(
        rows,
        headers=[
            "case",
            "runs",
            "pod Failed",
            "replacement runs",
            "first step",
            "restart (measured)",
            "bit-identical",
        ],
        align="<>>>>>>",
        indent="    ",
    )
    for op in plans:
        if op.size.nodes < 2 or not MODES[op.size.restart].keeps_nodes:
            continue
        case = measured.cases[f"{op.size.restart}/{'spare' if op.size.spares else 'no-spare'}"]
        spare = bool(op.size.spares)
        source = op.lost_node(spare=spare)[0]
        out.append(
            f"  {op.size.name}: restart after the replacement runs: model "
            f"{op.restart_s(spare=spare):.0f} s (workers, rendezvous, NCCL, restore from "
            f"{source}); emulation {case.restart_p50_s:.1f} s (CPU ranks, gloo, tiny model: no "
            "NCCL over EFA, no 70B restore)"
        )
    return out

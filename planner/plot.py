"""docs/planner.png: ETTR per mode against GPUs, and what a recovery costs per mode."""

from __future__ import annotations

from pathlib import Path

from planner.costs import MODE_LABELS, MODES
from planner.plan import Inputs, SizePlan


def plot_plan(*, inputs: Inputs, plans: list[SizePlan], out: Path) -> Path:
    """Left: ETTR (formula lines, Monte Carlo p5-p95 bars) per mode and rate. Right: mean R."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.5), dpi=100)
    colors = plt.get_cmap("tab10")
    styles = ["-", "--", ":", "-."]
    xs = [p.job.gpus for p in plans]
    for ri, rate in enumerate(inputs.failure_rates):
        for mi, mode in enumerate(MODES):
            rows = [next(r for r in p.rates if r.rate_name == rate).modes[mode] for p in plans]
            ys = [m.ettr_formula for m in rows]
            label = f"{MODE_LABELS[mode]}, {rate}"
            ax.plot(xs, ys, styles[ri % 4], color=colors(mi), lw=1.3, label=label)
            mc = [m.mc.mean for m in rows]
            err = [[m.mc.mean - m.mc.p5 for m in rows], [m.mc.p95 - m.mc.mean for m in rows]]
            ax.errorbar(xs, mc, yerr=err, fmt="o", ms=3, color=colors(mi), capsize=2, lw=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (productive / wall)")
    ax.set_title(
        f"ETTR, {inputs.params / 1e9:.0f}B params, cost model '{inputs.model.name}'\n"
        f"lines: closed form; markers: Monte Carlo mean, p5-p95 ({inputs.trials} x "
        f"{inputs.days:g}-day jobs)",
        fontsize=9,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, loc="lower left")

    first = next(iter(inputs.failure_rates))
    for mi, mode in enumerate(MODES):
        ys = [
            next(r for r in p.rates if r.rate_name == first).modes[mode].mean_recovery_s / 60
            for p in plans
        ]
        bx.plot(xs, ys, "o-", color=colors(mi), label=MODE_LABELS[mode])
    bx.set_xscale("log")
    bx.set_xlabel("GPUs")
    bx.set_ylabel("mean recovery per failure (minutes)")
    bx.set_title(f"Mean recovery R over the failure mix ({first} rate)", fontsize=9)
    bx.grid(alpha=0.3, which="both")
    bx.legend(fontsize=7)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out

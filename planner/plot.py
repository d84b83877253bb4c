"""docs/planner.png: ETTR per mode against GPUs, and where a recovery's time goes."""

from __future__ import annotations

from pathlib import Path

from planner import tiers
from planner.costs import MODE_LABELS, MODES
from planner.plan import ALL_MODES, Inputs, SizePlan

# Recovery terms grouped for the breakdown (term name prefix -> group).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("detection", ("detect_",)),
    ("node / pods", ("node_replace", "spare_swap", "pod_")),
    ("processes + rendezvous", ("worker_", "rendezvous", "inprocess_")),
    ("NCCL init", ("nccl_init",)),
    ("state read back (FSx, memory, peer)", ("ckpt_load", "restore_")),
    ("manual intervention", ("manual_",)),
    ("measured (CPU)", ("measured",)),
)


def _group(term: str) -> str:
    return next(g for g, prefixes in GROUPS if term.startswith(prefixes))


def plot_plan(*, inputs: Inputs, plans: list[SizePlan], out: Path) -> Path:
    """Left: ETTR per mode at the first rate (closed form, its start-up range, Monte Carlo p5),
    other rates faint. Right: mean recovery per failure at the largest size, by term group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.5), dpi=100)
    colors = plt.get_cmap("tab10")
    xs = [p.job.gpus for p in plans]
    first = next(iter(inputs.failure_rates))
    for rate in inputs.failure_rates:
        for mi, mode in enumerate(ALL_MODES):
            rows = [next(r for r in p.rates if r.rate_name == rate).modes[mode] for p in plans]
            ys = [m.ettr for m in rows]
            style = "-" if mode in MODES else "--"  # dashed: not shipped
            if rate != first:
                ax.plot(xs, ys, ":", color=colors(mi), lw=0.8, alpha=0.6)
                continue
            ax.plot(xs, ys, style, color=colors(mi), lw=1.5, label=MODE_LABELS[mode])
            lows = [m.ettr_low_startup for m in rows]
            ax.fill_between(xs, ys, lows, color=colors(mi), alpha=0.12, lw=0)
            if all(m.mc for m in rows):
                ax.plot(xs, [m.mc.p5 for m in rows], "v", ms=4, color=colors(mi))
            spec = tiers.row(mode)
            # The shipped mode with both restart layers: its ETTR with every restore from FSx.
            if mode in MODES and spec.keeps_processes and spec.keeps_nodes and inputs.tiers.enabled:
                ax.plot(
                    xs,
                    [m.tiers_off_ettr for m in rows],
                    "-.",
                    color=colors(mi),
                    lw=1.0,
                    label="nested, every restart from FSx (--tiers off)",
                )
    others = ", ".join(r for r in inputs.failure_rates if r != first)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (productive / wall)")
    ax.set_title(
        f"ETTR, {inputs.params / 1e9:.0f}B params, cost model '{inputs.model.name}', spares as "
        f"recommended, restore tiers {'on' if inputs.tiers.enabled else 'off'}, {first} rate\n"
        "lines: closed form, shaded to low NCCL/rendezvous start-up; "
        f"triangles: Monte Carlo p5 ({inputs.trials} x {inputs.days:g}-day jobs)"
        + (f"\ndotted: {others}" if others else ""),
        fontsize=8,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower left")

    big = plans[-1]
    rate = next(r for r in big.rates if r.rate_name == first)
    names = [g for g, _ in GROUPS]
    left = [0.0] * len(ALL_MODES)
    for gi, group in enumerate(names):
        widths = []
        for mode in ALL_MODES:
            mr = rate.modes[mode]
            widths.append(
                sum(
                    rec.outcome.share * t.seconds / 60
                    for rec in mr.recoveries
                    for t in rec.terms
                    if _group(t.name) == group
                )
            )
        if any(widths):
            bx.barh(ALL_MODES, widths, left=left, color=colors(gi + 4), label=group)
            left = [a + b for a, b in zip(left, widths, strict=True)]
    bx.invert_yaxis()
    bx.set_xlabel("mean recovery per failure (minutes), weighted by the failure mix")
    bx.set_title(
        f"Where a recovery's time goes at {big.job.gpus:,} GPUs ({first} rate)", fontsize=9
    )
    bx.grid(alpha=0.3, axis="x")
    bx.legend(fontsize=8, loc="lower right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out

"""Plain-text tables of a plan: inputs, cost terms with sources, recoveries, ETTR, FSx."""

from __future__ import annotations

from planner import costs
from planner.costs import DEFAULTS, MODE_LABELS, MODES
from planner.failures import RATE_SOURCES
from planner.plan import Inputs, SizePlan
from planner.sources import SOURCES
from training.tables import text_table

# The terms table, in the order a recovery meets them: (label, term name).
TERM_ROWS: tuple[tuple[str, str], ...] = (
    ("detect: exception, in-process", "detect_exception_inprocess_s"),
    ("detect: hang, in-process", "detect_hang_inprocess_s"),
    ("detect: lost node, in-process", "detect_lost_rank_inprocess_s"),
    ("detect: exit, in-job", "detect_exit_injob_s"),
    ("detect: hang/lost node, in-job", "detect_hang_injob_s"),
    ("detect: exit, no resilience", "detect_exit_none_s"),
    ("detect: hang/lost node, none", "detect_hang_none_s"),
    ("in-process abort (+1 step)", "inprocess_abort_s"),
    ("in-process store barrier", "inprocess_barrier_s"),
    ("stop surviving workers", "worker_stop_s"),
    ("start worker processes", "worker_start_s"),
    ("rendezvous / TCPStore at N", "rendezvous_s"),
    ("NCCL init at N ranks", "nccl_init_s"),
    ("checkpoint load from FSx", "ckpt_load_s"),
    ("pod teardown (whole job)", "pod_teardown_s"),
    ("pod replacement (all pods)", "pod_replace_all_s"),
    ("node replacement (+image)", "node_replace_s"),
    ("hot spare takes over", "spare_swap_s"),
    ("checkpoint stall (D2H+fixed)", "ckpt_stall_s"),
    ("checkpoint write to FSx", "ckpt_write_s"),
)


def _params(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def _term_source(model: costs.CostModel, term: str) -> str:
    """The source key of a term, with [est] when a parameter it uses is an estimate."""
    uses = {
        "inprocess_barrier_s": ["inprocess_barrier_s_at_16k"],
        "rendezvous_s": ["rendezvous_s_at_98k"],
        "nccl_init_s": ["nccl_init_s_at_96k"],
        "pod_replace_all_s": ["pod_start_s", "pod_schedule_rate"],
        "node_replace_s": ["node_repair_wait_s", "node_boot_s", "image_pull_s", "pod_start_s"],
        "spare_swap_s": ["pod_start_s"],
        "ckpt_stall_s": ["save_fixed_s", "d2h_gbps"],
        "ckpt_load_s": [],
        "ckpt_write_s": [],
    }.get(term, [term])
    if not uses:
        return "fsx"
    keys: list[str] = []
    for p in uses:
        src = model.sources[p]
        tag = src + ("*" if src != "override" and DEFAULTS[p].estimate else "")
        if tag not in keys:
            keys.append(tag)
    return ", ".join(keys)


def format_report(*, inputs: Inputs, plans: list[SizePlan], measured_lines: list[str]) -> str:
    """All tables, then the sources cited."""
    model = inputs.model
    gb = inputs.ckpt_bytes / 1e9
    fm = inputs.failure_model(next(iter(inputs.failure_rates.values())))
    mix = ", ".join(
        f"{k.name} {k.share:.1%} ({'node replaced' if k.needs_node else 'in place'}"
        f"{', hangs' if k.hangs else ', exits'})"
        for k in fm.kinds
    )
    rates = ", ".join(
        f"{n} {r:g} [{RATE_SOURCES.get(n, 'given')}]" for n, r in inputs.failure_rates.items()
    )
    out = [f"Goodput planner, cost model: {model.name}"]
    if model.name == "measured-cpu":
        out.append(
            "  MEASURED ON A 2-CORE CPU (gloo, tiny model, local disk) [bench]: not cluster-scale "
            "costs; the cluster model (the default) is what to plan with."
        )
        out += [f"    {line}" for line in measured_lines]
    out += [
        f"  model {_params(inputs.params)} params x {inputs.bytes_per_param:g} B = {gb:,.0f} GB "
        f"checkpoint [checkpoint]; step {inputs.step_time_s:g} s; {inputs.gpus_per_node} "
        f"GPUs/node; FSx keeps {inputs.keep} + 1 checkpoints",
        f"  failures per 1,000 node-days: {rates}",
        f"  mix [llama3]: {mix}",
        f"  hot spares {inputs.hot_spares}; lemon share {inputs.lemon_share:g}"
        f"{' (excluded)' if inputs.exclude_lemons else ''}; Monte Carlo {inputs.trials} x "
        f"{inputs.days:g}-day jobs, seed {inputs.seed}",
    ]

    sizes = [p.job.gpus for p in plans]
    if model.name == "cluster":
        out += ["", "Cost terms, seconds at each GPU count (* = estimate, no published figure)"]
        rows = [
            [label, *(f"{p.terms[name].seconds:.1f}" for p in plans), _term_source(model, name)]
            for label, name in TERM_ROWS
        ]
        headers = ["term", *(str(g) for g in sizes), "source"]
        out += text_table(rows, headers=headers, align="<" + ">" * len(sizes), indent="  ")
    else:
        out += ["", "Checkpoint stall, seconds (measured-cpu) " + f"{plans[0].stall_s:.2f}"]

    first = next(iter(inputs.failure_rates))
    out += ["", f"Recovery R per failure, seconds ({first} rate; share of failures in brackets)"]
    recoveries = [next(x for x in p.rates if x.rate_name == first) for p in plans]
    # The failure mix is the inputs', so every GPU count has the same kinds and shares.
    kinds = [
        f"{rec.outcome.kind} [{rec.outcome.share:.0%}]"
        for rec in recoveries[0].modes[MODES[0]].recoveries
    ]
    rows = [
        [
            str(p.job.gpus) if i == 0 else "",
            mode,
            *(f"{rec.seconds:.0f}" for rec in r.modes[mode].recoveries),
            f"{r.modes[mode].mean_recovery_s:.0f}",
        ]
        for p, r in zip(plans, recoveries, strict=True)
        for i, mode in enumerate(MODES)
    ]
    headers = ["GPUs", "mode", *kinds, "mean"]
    out += text_table(rows, headers=headers, align="><" + ">" * (len(kinds) + 1), indent="  ")

    out += [
        "",
        "ETTR: formula | Monte Carlo mean (interval = Daly's optimum in whole steps)",
        "  " + "; ".join(f"{m} = {MODE_LABELS[m]}" for m in MODES),
    ]
    rows = [
        [
            str(p.job.gpus),
            r.rate_name,
            f"{r.mtbf_s / 60:.1f}m",
            f"{p.stall_s:.2f}s",
            f"{r.interval_s:.0f}s" + ("!" if r.fsx_limited else ""),
            *(f"{r.modes[m].ettr_formula:.1%} | {r.modes[m].mc.mean:.1%}" for m in MODES),
        ]
        for p in plans
        for r in p.rates
    ]
    headers = ["GPUs", "rate", "MTBF", "stall", "interval", *MODES]
    out += text_table(rows, headers=headers, align="><>>>" + ">" * len(MODES), indent="  ")
    if any(r.fsx_limited for p in plans for r in p.rates):
        out.append("  ! interval lengthened: FSx cannot write a checkpoint within Daly's interval")

    out += [
        "",
        "FSx for Lustre PERSISTENT_2 (valid sizes: 1200, 2400, n x 2400 GiB; "
        "125/250/500/1000 MB/s/TiB) [fsx]",
    ]
    rows = [
        [
            str(p.job.gpus),
            f"{p.fsx.storage_need_gib:,.0f}",
            f"{p.fsx.write_need_mbps:,.0f}" if p.fsx.write_need_mbps else "(given)",
            f"{p.fsx.capacity_gib:,}",
            str(p.fsx.tier_mbps_per_tib),
            f"{p.fsx.throughput_mbps / 1000:.1f}",
            f"{p.terms['ckpt_write_s'].seconds:.0f}s",
            f"{p.terms['ckpt_load_s'].seconds:.0f}s",
            p.fsx.cdk_context(),
        ]
        for p in plans
    ]
    headers = ["GPUs", "needs GiB", "write MB/s", "capacity", "tier", "GB/s", "write", "load"]
    out += text_table(
        rows, headers=[*headers, "cdk deploy context"], align=">" * len(headers), indent="  "
    )
    if plans and plans[0].fsx.chosen_by == "sized":
        tiers = list(plans[0].fsx.by_tier)
        out.append("  smallest valid capacity (GiB) meeting both needs, per tier (MB/s/TiB):")
        rows = [[str(p.job.gpus), *(f"{p.fsx.by_tier[t]:,}" for t in tiers)] for p in plans]
        headers = ["GPUs", *(str(t) for t in tiers)]
        out += text_table(rows, headers=headers, align=">" * len(headers), indent="  ")

    out += ["", "Sources ([override] = set with --set)"]
    out += [f"  [{k}] {text}" for k, text in SOURCES.items()]
    return "\n".join(out)

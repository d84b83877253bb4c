"""Plain text: the answer first (mode, interval in steps, spares, FSx flags), then the tables."""

from __future__ import annotations

from planner import costs, tiers
from planner.costs import DEFAULTS, MODE_LABELS, MODES
from planner.failures import PLANNED_PER_DAY, RATE_SOURCES
from planner.plan import ALL_MODES, Inputs, RateResult, Recovery, SizePlan
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
    ("restore from process memory", "restore_memory_s"),
    ("restore from pod memory", "restore_pod_memory_s"),
    ("restore from a peer (EFA)", "restore_peer_s"),
    ("pod teardown (whole job)", "pod_teardown_s"),
    ("pod replacement (all pods)", "pod_replace_all_s"),
    ("node replacement, GPU fault", "node_replace_s"),
    ("node replacement, host fault", "node_replace_host_s"),
    ("manual intervention", "manual_intervention_s"),
    ("hot spare takes over", "spare_swap_s"),
    ("hot spare, silent node", "spare_swap_host_s"),
    ("hot spare refill", "spare_refill_s"),
    ("checkpoint stall (D2H+fixed)", "ckpt_stall_s"),
    ("memory snapshot stall", "memory_snapshot_stall_s"),
    ("checkpoint write to FSx", "ckpt_write_s"),
)
SHORT: dict[str, str] = {
    tiers.MEMORY: "mem",
    tiers.POD_MEMORY: "pod",
    tiers.PEER: "peer",
    tiers.LOCAL: "nvme",
    tiers.STORAGE: "fsx",
}
LOSS_LABELS: dict[str, str] = {
    **{label_name: label for label, label_name in TERM_ROWS},
    "replica_heal_s": "heal from a peer group (EFA)",
    "replica_rejoin_s": "rejoin (quorum, heal handshake; emulation)",
    "replica_redo_step_s": "the discarded step, redone",
    "replica_quorum_s": "quorum without the group (shrink; emulation)",
    "replica_survivors_wait_s": "survivors blocked on a hung group (shrink)",
}


def _params(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def _term_source(model: costs.CostModel, term: str) -> str:
    """The source key of a term, with * when a parameter it uses is an estimate."""
    uses = {
        "inprocess_barrier_s": ["inprocess_barrier_s_at_16k"],
        "rendezvous_s": ["rendezvous_s_at_98k"],
        "nccl_init_s": ["nccl_init_s_at_96k"],
        "pod_replace_all_s": ["pod_start_s", "pod_schedule_rate"],
        "node_replace_s": ["node_repair_wait_s", "node_boot_s", "image_pull_s", "pod_start_s"],
        "node_replace_host_s": [
            "node_monitor_grace_s",
            "fence_wait_s",
            "fence_poll_s",
            "instance_terminate_s",
            "node_boot_s",
            "image_pull_s",
        ],
        "spare_swap_s": ["pod_start_s"],
        "spare_swap_host_s": [
            "node_monitor_grace_s",
            "fence_wait_s",
            "fence_poll_s",
            "instance_terminate_s",
            "podgc_loop_s",
        ],
        "ckpt_stall_s": ["save_fixed_s", "d2h_gbps"],
        "restore_memory_s": ["d2h_gbps"],
        "restore_pod_memory_s": ["d2h_gbps"],
        "restore_peer_s": ["efa_gbps", "d2h_gbps"],
        "memory_snapshot_stall_s": ["memory_snapshot_s", "efa_gbps", "d2h_gbps"],
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


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _answer(inputs: Inputs, p: SizePlan, r: RateResult) -> list[str]:
    """The recommendation block for one size and rate."""
    best = r.modes[r.best]
    second = r.modes[r.runner_up]
    lo, hi = sorted((best.ettr, best.ettr_low_startup))
    spread = hi - lo
    margin = r.margins[0]
    lead = (
        f"{min(r.margins) * 100:+.1f} to {max(r.margins) * 100:+.1f} pt over the start-up range "
        "and estimates x0.5-x2"
    )
    verdict = (
        f" - within the model's error ({lead}; under 0.1 pt or the order flips)"
        if r.within_error
        else f" ({lead})"
    )
    mc = best.mc
    mc_text = f"; Monte Carlo p5 {_pct(mc.p5)} (one week in twenty)" if mc else ""
    rng = f" ({_pct(lo)}-{_pct(hi)} over NCCL/rendezvous start-up)" if spread >= 0.001 else ""
    sp = r.spares
    origin = {
        "recommended": "recommended; no overlay in manifests/sizes.py has this many nodes",
        "--hot-spares": "given with --hot-spares",
    }.get(sp.in_force.origin, f"the product's count, {sp.in_force.origin}")
    gpu_usd = inputs.model.params.get("gpu_hour_usd", 0.0)
    point_usd = p.job.gpus * 0.01 * gpu_usd
    refill_h = inputs.model.params["spare_refill_s"] / 3600
    # First-order terms, scaled to share out the points actually lost (they overcount once
    # outages approach the MTBF).
    total = sum(v for _, v in r.losses) or 1.0
    lost = 1.0 - best.ettr
    top = ", ".join(
        f"{LOSS_LABELS.get(k, k)} {v / total * lost * 100:.1f} pt" for k, v in r.losses[:3]
    )
    memory = (
        f" --checkpoint.memory_interval={best.memory_interval_steps}"
        if best.memory_interval_steps
        else ""
    )
    return [
        f"{p.job.gpus:,} GPUs, {r.rate_name} rate ({r.rate:g} failures/1,000 node-days, "
        f"MTBF {r.mtbf_s / 60:.0f} min)",
        f"  mode      {r.best}: ETTR {_pct(best.ettr)}{rng}{mc_text}",
        f"            {margin * 100:+.1f} pt over {r.runner_up} ({_pct(second.ettr)}){verdict}",
        *_tiers_lines(inputs, r),
        f"  interval  --checkpoint.interval={best.interval_steps}{memory}  "
        f"({best.interval_s:.0f} s at {inputs.step_time_s:g} s/step; checkpoint commits "
        f"{best.write_s:.0f} s after its stall)"
        + ("  [as given]" if inputs.interval_steps else ""),
        f"  spares    {sp.in_force.count} hot spares ({origin}): P(no spare) "
        f"{sp.no_spare_chance:.2%} at a {refill_h:g} h refill (1% needs {sp.recommended}); idle "
        f"{sp.in_force.count * inputs.gpus_per_node} GPUs = {sp.idle_gpu_share:.2%} of the job, "
        f"${sp.idle_usd_per_h:,.0f}/h",
        f"  FSx       cdk deploy {best.fsx.cdk_context()}  (${best.fsx_usd_per_h:,.0f}/h; "
        f"{best.fsx.throughput_mbps / 1000:.1f} GB/s; 1 ETTR pt = ${point_usd:,.0f}/h of GPUs)",
        *(
            [
                f"            within 0.1 pt for less: {best.fsx_near.cdk_context()}  "
                f"(${best.fsx_near_usd_per_h:,.0f}/h)"
            ]
            if best.fsx_near != best.fsx
            else []
        ),
        f"  dominant  {top} (of {lost * 100:.1f} pt lost)",
        *_replica_lines(p, r),
    ]


def _replica_lines(p: SizePlan, r: RateResult) -> list[str]:
    """``--restart replica`` beside the best tier-model mode: its ETTR and what holds it back."""
    rep = r.replica
    if rep.ettr != rep.ettr:  # nan: the measured-CPU model has no replica row
        return []
    lost = 1.0 - rep.ettr
    total = sum(v for _, v in rep.losses) or 1.0
    top = ", ".join(
        f"{LOSS_LABELS.get(k, k)} {v / total * lost * 100:.1f} pt" for k, v in rep.losses[:4]
    )
    best = r.modes[r.best]
    return [
        f"  replica   ETTR {_pct(rep.ettr)} ({(rep.ettr - best.ettr) * 100:+.1f} pt over "
        f"{r.best}; --restart replica, {costs.REPLICA_DEFAULT} semantics (default), "
        f"{_group_gpus(p)}-GPU groups; {_OTHER} {_pct(rep.other_ettr)}); held back by {top} (of "
        f"{lost * 100:.1f} pt lost)",
    ]


_OTHER = next(s for s in costs.REPLICA_SEMANTICS if s != costs.REPLICA_DEFAULT)
"""The replica semantics that is not the default: its ETTR beside the default's."""


def _group_gpus(p: SizePlan) -> int:
    return min(p.job.gpus, int(costs.DEFAULTS["replica_group_gpus"].value))


def restore_mix(recoveries: tuple[Recovery, ...]) -> str:
    """Share of failures per restore source, e.g. ``memory 23%, peer 76%, storage 1%``."""
    shares: dict[str, float] = {}
    for rec in recoveries:
        kept = rec.outcome.share * (1.0 - rec.peer_lost)
        shares[rec.source] = shares.get(rec.source, 0.0) + kept
        if rec.peer_lost:
            lost = rec.outcome.share * rec.peer_lost
            shares[tiers.STORAGE] = shares.get(tiers.STORAGE, 0.0) + lost
    return ", ".join(
        f"{src} {shares[src]:.0%}" for src in tiers.SOURCES if shares.get(src, 0.0) > 0
    )


def _tiers_lines(inputs: Inputs, r: RateResult) -> list[str]:
    """Restore tiers on against off (every restart from FSx), for the shipped modes."""
    best = r.modes[r.best]
    if not inputs.tiers.enabled:
        return ["  tiers     off: every restart reads FSx (--tiers on restores from memory/peers)"]
    pairs = ", ".join(
        f"{m} {_pct(r.modes[m].ettr)} vs {_pct(r.modes[m].tiers_off_ettr)}"
        for m in MODES
        if tiers.row(m).keeps_pod
    )
    return [
        f"  tiers     restores: {restore_mix(best.recoveries)}",
        f"            ETTR with tiers vs every restart from FSx (--tiers off): {pairs}",
    ]


def format_answer(*, inputs: Inputs, plans: list[SizePlan]) -> list[str]:
    """One block per size and rate, then what the blocks leave out."""
    out = ["ANSWER (per GPU count and failure rate; details: --full)"]
    for p in plans:
        for r in p.rates:
            out += ["", *_answer(inputs, p, r)]
    big = plans[-1].rates[0]
    out += [
        "",
        f"  Not in the ETTR above: planned interruptions (Llama 3: {PLANNED_PER_DAY:.2f}/day, "
        f"whole-job restart, no rollback) cost a further {big.planned_loss:.1%} at "
        f"{plans[-1].job.gpus:,} GPUs.",
    ]
    return out


def _summary(inputs: Inputs, plans: list[SizePlan]) -> list[str]:
    out = [
        "",
        "ETTR per mode at its own best FSx and interval: formula | Monte Carlo p5 "
        f"({inputs.trials} x {inputs.days:g}-day jobs)",
        "  " + "; ".join(f"{m} = {MODE_LABELS[m]}" for m in (*ALL_MODES, "replica")),
    ]
    rows = []
    for p in plans:
        for r in p.rates:
            cells = []
            for m in ALL_MODES:
                mr = r.modes[m]
                cells.append(f"{_pct(mr.ettr)} | {_pct(mr.mc.p5)}" if mr.mc else _pct(mr.ettr))
            rows.append(
                [
                    str(p.job.gpus),
                    r.rate_name,
                    f"{r.mtbf_s / 60:.0f}m",
                    str(r.spares.in_force.count),
                    *cells,
                    _pct(r.replica.ettr),
                    _pct(r.replica.other_ettr),
                ]
            )
    headers = ["GPUs", "rate", "MTBF", "spares", *ALL_MODES, "replica", _OTHER]
    out += text_table(rows, headers=headers, align="><>>" + ">" * (len(ALL_MODES) + 2), indent="  ")
    out.append(
        "  reserve: NOT SHIPPED (what would close the gap); replica: --restart replica, "
        f"{costs.REPLICA_DEFAULT} semantics (the default), its group's restart priced at the "
        "group's size, its quorum and rejoin measured in emulation (replica-emulation); "
        f"{_OTHER}: --resilience.replica_semantics={_OTHER}"
    )
    return out


def _full(inputs: Inputs, plans: list[SizePlan]) -> list[str]:
    model = inputs.model
    sizes = [p.job.gpus for p in plans]
    out: list[str] = []
    if model.name == "cluster":
        out += [
            "",
            "Cost terms, seconds at each GPU count (best mode's FSx, first rate; * = estimate)",
        ]
        rows = [
            [label, *(f"{p.terms[name].seconds:.1f}" for p in plans), _term_source(model, name)]
            for label, name in TERM_ROWS
        ]
        out += text_table(
            rows,
            headers=["term", *map(str, sizes), "source"],
            align="<" + ">" * len(sizes),
            indent="  ",
        )
        out.append(
            f"  NCCL init low end {model.params['nccl_init_low_s_at_96k']:g} s and rendezvous "
            f"{model.params['rendezvous_low_s_at_98k']:g} s at 98,304 ranks (estimates) give "
            "the ETTR ranges."
        )

    first = next(iter(inputs.failure_rates))
    out += ["", f"Recovery R per failure, seconds ({first} rate; share of failures in brackets)"]
    for p in plans:
        r = next(x for x in p.rates if x.rate_name == first)
        kinds = [
            f"{rec.outcome.kind} [{rec.outcome.share:.0%}]" for rec in r.modes["none"].recoveries
        ]
        rows = [
            [
                mode,
                *(f"{rec.seconds:.0f} {SHORT[rec.source]}" for rec in r.modes[mode].recoveries),
                f"{r.modes[mode].mean_recovery_s:.0f}",
                f"{r.modes[mode].outage_s:.0f}",
            ]
            for mode in ALL_MODES
        ]
        out.append(
            f"  {p.job.gpus:,} GPUs (X = expected outage, failures during it included; restore "
            "from: mem process memory, pod pod memory, peer a peer's memory, fsx FSx)"
        )
        out += text_table(
            rows,
            headers=["mode", *kinds, "mean R", "X"],
            align="<" + ">" * (len(kinds) + 2),
            indent="    ",
        )

    out += [
        "",
        "Hot spares: chance a node failure finds none | best mode's ETTR, by spare count",
        "  (closed form; when the pool is often empty it is conservative by up to a few points,",
        "  the Monte Carlo simulates the pool: docs/planner.md)",
    ]
    for p in plans:
        for r in p.rates:
            cells = ", ".join(f"{k}: {b:.1%} | {_pct(e)}" for k, b, e in r.spares.sweep)
            out.append(f"  {p.job.gpus:>7,} {r.rate_name:<7} load {r.spares.load:.2f}  {cells}")

    out += ["", "FSx chosen per mode (capacity GiB / tier MB/s/TiB, write s, interval steps)"]
    rows = [
        [
            str(p.job.gpus),
            r.rate_name,
            *(
                f"{r.modes[m].fsx.capacity_gib}/{r.modes[m].fsx.tier_mbps_per_tib} "
                f"{r.modes[m].write_s:.0f}s {r.modes[m].interval_steps}"
                for m in MODES
            ),
        ]
        for p in plans
        for r in p.rates
    ]
    out += text_table(
        rows, headers=["GPUs", "rate", *MODES], align="><" + ">" * len(MODES), indent="  "
    )

    out += ["", "Sources ([override] = set with --set)"]
    out += [f"  [{k}] {text}" for k, text in SOURCES.items()]
    return out


def format_report(
    *,
    inputs: Inputs,
    plans: list[SizePlan],
    measured_lines: list[str],
    brief: bool = False,
    full: bool = False,
) -> str:
    """The answer; then (unless brief) the ETTR table; then (with full) every table and source."""
    model = inputs.model
    gb = inputs.ckpt_bytes / 1e9
    fm = inputs.failure_model(next(iter(inputs.failure_rates.values())))
    mix = ", ".join(f"{k.name} {k.share:.1%}" for k in fm.kinds)
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
        f"checkpoint; step {inputs.step_time_s:g} s; {inputs.gpus_per_node} GPUs/node; "
        f"FSx keeps {inputs.keep} + 1 checkpoints; write drag {model.params['write_drag']:g}"
        + (" (not charged: no published figure)" if not model.params["write_drag"] else ""),
        f"  failures per 1,000 node-days: {rates}; mix [llama3 Table 5 counts]: {mix}"
        + ("; software per job" if inputs.per_job_software else ""),
        "",
    ]
    out += format_answer(inputs=inputs, plans=plans)
    if not brief:
        out += _summary(inputs, plans)
    if full:
        out += _full(inputs, plans)
    else:
        out += ["", "(--full: cost terms with sources, recoveries, spare sweep, FSx per mode)"]
    return "\n".join(out)

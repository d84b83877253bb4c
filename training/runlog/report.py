"""Run report: summary.json, timeline.png and a compact table for one run directory.

    python -m training.runlog.report runs/local      # or: make report RUN=local

The accounting (what counts as productive, what a restart cost) lives in
`training.runlog.accounting`; this module draws and prints it. Exit status 2 when the run
directory is missing or empty.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from training import exits
from training.runlog.accounting import (
    PhaseMark,
    Restart,
    RunDirError,
    RunSummary,
    load_run,
    summarize,
)
from training.runlog.files import EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, TIMELINE_FILE
from training.runlog.phases import PHASES
from training.tables import text_table

__all__ = [
    "PhaseMark",
    "Restart",
    "RunDirError",
    "RunSummary",
    "format_phases",
    "format_replica",
    "format_summary",
    "main",
    "plot_timeline",
    "summarize",
    "write_report",
]


def _fmt_s(seconds: float | None) -> str:
    """Seconds as a short human string (s below 2 min, then min, then h)."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


# Column headings of the phase table (the full names are in summary.json).
PHASE_SHORT: dict[str, str] = {
    "detected": "detect",
    "survivors_stopped": "stop",
    "processes_up": "procs",
    "rendezvous_done": "rdzv",
    "process_group_up": "pg",
    "model_built": "model",
    "checkpoint_loaded": "ckpt",
    "first_step": "step1",
}


def _fmt_num(seconds: float) -> str:
    return f"{seconds:.2f}" if seconds < 100 else f"{seconds:.0f}"


def format_phases(summary: RunSummary) -> list[str]:
    """The phase table: seconds each phase added, one row per restart (and the start-up).

    Empty when no restart_phase events were recorded. Columns follow ``PHASES``; a row's phases
    were reached in time order, which may differ (see `training.runlog.accounting.PhaseMark`).
    """
    rows: list[tuple[str, tuple[PhaseMark, ...], str]] = []
    if summary.startup_phases:
        rows.append(("start", summary.startup_phases, ""))
    for n, r in enumerate(summary.restarts, 1):
        if r.phases:
            rows.append((str(n), r.phases, r.costliest_phase or ""))
    if not rows:
        return []
    present = {m.phase for _, marks, _ in rows for m in marks}
    cols = [p for p in PHASES if p in present]
    cells = []
    for label, marks, worst in rows:
        by_phase = {m.phase: m for m in marks}
        times = [_fmt_num(by_phase[p].duration_s) if p in by_phase else "-" for p in cols]
        cells.append([label, *times, worst])
    headers = ["#", *(PHASE_SHORT.get(p, p).rjust(6) for p in cols), "costliest"]
    return [
        "restart phases (s since the phase reached before it; restarts from the fault)",
        *text_table(cells, headers=headers, align=">" * (len(cols) + 1), gap=" "),
    ]


def _fmt_restore(r: Restart) -> str:
    """Where a restart restored from and what it cost: ``pod_memory@10 0.12s 45.0 MB``."""
    if r.restore_source is None:
        return "-"
    size = f" {r.restore_bytes / 1e6:,.1f} MB" if r.restore_bytes else ""
    return f"{r.restore_source}@{r.restore_step} {_fmt_s(r.restore_s)}{size}"


def format_summary(summary: RunSummary) -> str:
    """A compact plain-text table of the summary (what the launcher prints at the end of a run)."""
    s = summary
    rows = [
        ("run", s.run_dir),
        ("status", f"{s.status or 'unknown'}" + (f" ({s.cause})" if s.cause else "")),
        (
            "steps completed",
            f"{s.steps_completed}" + (f" (last {s.final_step})" if s.final_step else ""),
        ),
        ("attempts", str(s.attempts)),
        ("wall time", _fmt_s(s.wall_s)),
        ("productive time", _fmt_s(s.productive_s)),
        ("ETTR", f"{s.ettr:.1%}"),
        ("faults / restarts", f"{s.faults} / {len(s.restarts)}"),
        ("time lost to restarts", _fmt_s(s.lost_s)),
        ("checkpoints committed", str(s.checkpoints_committed)),
        ("ckpt blocking (median)", _fmt_s(s.ckpt_blocking_median_s)),
        (
            "tokens/s (median)",
            f"{s.tokens_per_s_median:,.0f}" if s.tokens_per_s_median is not None else "-",
        ),
        ("MFU (median)", f"{s.mfu_median:.1%}" if s.mfu_median is not None else "-"),
        ("final loss", f"{s.final_loss:.4f}" if s.final_loss is not None else "-"),
    ]
    if s.straggler_reports:
        slowest = min(s.straggler_lowest.items(), key=lambda kv: kv[1], default=None)
        rows.append(
            (
                "straggler reports",
                f"{s.straggler_reports}"
                + (f" (lowest: {slowest[0]} {slowest[1]:.2f})" if slowest else ""),
            )
        )
        if s.evicted_nodes:
            rows.append(("evicted nodes", ", ".join(s.evicted_nodes)))
    if s.skipped_lines:
        rows.append(("skipped lines", f"{s.skipped_lines} (truncated/invalid JSON)"))
    lines = text_table(rows)
    if s.restarts:
        lines.append("")
        restarts = [
            [
                str(n),
                r.mode,
                r.fault or "-",
                *(_fmt_s(t) for t in (r.begin_s, r.downtime_s, r.recompute_s, r.lost_s)),
                _fmt_restore(r),
            ]
            for n, r in enumerate(s.restarts, 1)
        ]
        headers = ["#", "mode", "fault", "at", "down", "redo", "lost", "restored from"]
        lines += text_table(restarts, headers=headers, align="><<>>>><", gap=" ")
    phase_lines = format_phases(summary)
    if phase_lines:
        lines.append("")
        lines.extend(phase_lines)
    replica_lines = format_replica(summary)
    if replica_lines:
        lines.append("")
        lines.extend(replica_lines)
    return "\n".join(lines)


def format_replica(summary: RunSummary) -> list[str]:
    """``restart=replica``: this group's quorum changes, heals and survivors' stalls, on one
    time axis with the run (seconds since its start). Empty for other modes."""
    r = summary.replica
    if r is None:
        return []
    t0 = summary.start_time
    stalls = (
        f"{len(r.stalls)} (p50 {_fmt_s(r.stall_p50_s)}, max {_fmt_s(r.stall_max_s)})"
        if r.stalls
        else "0"
    )
    heals = f"{len(r.heals)} ({r.heal_bytes_total / 1e6:,.1f} MB from peers)" if r.heals else "0"
    head = [
        ("replica group", f"{r.group} of {r.groups or '?'}" if r.group is not None else "-"),
        ("steps discarded", str(r.steps_discarded)),
        ("survivors' stalls", stalls),
        ("heals", heals),
    ]
    if r.samples_skipped:
        head.append(
            (
                "samples skipped",
                f"{r.samples_skipped} (shrink: {len(r.steps_skipped)} group-steps without a group)",
            )
        )
    if r.waiting_since is not None:
        head.append(("waiting for a group since", _fmt_s(r.waiting_since - t0)))
    rows = [
        (
            q.time - t0,
            "quorum",
            q.step,
            f"{q.participants}/{q.groups or '?'} groups",
            f"waited {_fmt_s(q.wait_s)}",
        )
        for q in r.quorum_changes
    ]
    rows += [
        (
            h.time - t0,
            "heal",
            h.step,
            f"from step {h.from_step}",
            f"{_fmt_s(h.heal_s)} {h.bytes / 1e6:,.1f} MB",
        )
        for h in r.heals
    ]
    rows += [(s.time - t0, "stall", s.step, "", _fmt_s(s.stall_s)) for s in r.stalls]
    cells = [[_fmt_s(t), kind, str(step), who, what] for t, kind, step, who, what in sorted(rows)]
    return [
        *text_table(head),
        "replica timeline",
        *text_table(cells, headers=["at", "event", "step", "groups", "cost"], align=">><<<"),
    ]


def _plot_phases(ax, summary: RunSummary) -> None:
    """One horizontal stacked bar per restart: each phase's span, from the restart's begin."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    colors = {p: cmap(k % 10) for k, p in enumerate(PHASES)}
    labelled: set[str] = set()
    rows = [(n, r) for n, r in enumerate(summary.restarts, 1) if r.phases]
    for y, (_, r) in enumerate(rows):
        for m in r.phases:
            if m.duration_s <= 0:
                continue
            ax.barh(
                y,
                m.duration_s,
                left=m.offset_s - m.duration_s,
                height=0.6,
                color=colors.get(m.phase, "grey"),
                label=m.phase if m.phase not in labelled else None,
            )
            labelled.add(m.phase)
        worst = max(r.phases, key=lambda m: m.duration_s)
        ax.text(
            worst.offset_s - worst.duration_s / 2,
            y,
            f"{worst.phase} {worst.duration_s:.1f} s",
            ha="center",
            va="center",
            fontsize=7,
            color="white",
            clip_on=True,
        )
        # Where the downtime ends (the first step after the restart starts).
        ax.plot([r.downtime_s] * 2, [y - 0.4, y + 0.4], color="black", lw=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"#{n}" for n, _ in rows], fontsize=7)  # the restart table's numbers
    ax.invert_yaxis()  # restart 1 on top
    ax.set_title("restart phases", loc="left", fontsize=8)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the restart began (| = downtime ends)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    if labelled:
        # In PHASES order, whatever order the bars were drawn in.
        handles, labels = ax.get_legend_handles_labels()
        pairs = sorted(zip(labels, handles, strict=True), key=lambda x: PHASES.index(x[0]))
        ax.legend(
            [h for _, h in pairs],
            [lbl for lbl, _ in pairs],
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=7,
        )


def plot_timeline(*, run_dir: Path, summary: RunSummary, out: Path) -> Path:
    """Draw steps over wall time with faults, restarts and checkpoint commits, plus the summary."""
    import matplotlib

    matplotlib.use("Agg")  # headless: the launcher runs this in pods and CI
    import matplotlib.pyplot as plt

    logs = load_run(run_dir=run_dir)
    t0 = summary.start_time
    with_phases = any(r.phases for r in summary.restarts)
    if with_phases:  # room below the step plot for the phase bars
        fig = plt.figure(figsize=(13, 7.5), dpi=100)
        ax = fig.add_axes((0.06, 0.42, 0.58, 0.52))
        _plot_phases(fig.add_axes((0.06, 0.07, 0.58, 0.25)), summary)
    else:
        fig = plt.figure(figsize=(13, 5), dpi=100)
        ax = fig.add_axes((0.06, 0.12, 0.58, 0.78))
    # One line per attempt, so the repeated steps after a restart show as a step back.
    attempts = sorted({s.attempt for s in logs.steps})
    cmap = plt.get_cmap("tab10")
    for k, a in enumerate(attempts):
        pts = [(s.time - t0, s.step) for s in logs.steps if s.attempt == a]
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, ".-", ms=2, lw=1, color=cmap(k % 10), label=f"attempt {a}")

    ymax = max((s.step for s in logs.steps), default=1)
    for n, r in enumerate(summary.restarts):
        end = r.resumed_s if r.resumed_s is not None else summary.wall_s
        ax.axvspan(
            r.begin_s, end, color="orange", alpha=0.25, lw=0, label="restart" if n == 0 else None
        )
        ax.text(
            r.begin_s,
            ymax * 0.02,
            f" {r.mode}",
            fontsize=7,
            color="darkorange",
            rotation=90,
            va="bottom",
        )
    # Faults: one line per distinct (time, kind) — every rank may log the same fault.
    seen: set[tuple[float, str]] = set()
    first = True
    for e in logs.events:
        if e["kind"] != "fault":
            continue
        x, kind = float(e["time"]) - t0, str(e.get("fault", "fault"))
        key = (round(x, 0), kind)
        if key in seen:
            continue
        seen.add(key)
        ax.axvline(x, color="red", lw=1, label="fault" if first else None)
        ax.text(x, ymax * 0.98, f" {kind}", color="red", fontsize=8, rotation=90, va="top")
        first = False
    commits = sorted(
        {float(e["time"]) - t0 for e in logs.events if e["kind"] == "checkpoint_committed"}
    )
    if commits:
        ax.plot(
            commits,
            [0] * len(commits),
            "|",
            color="green",
            ms=12,
            mew=1.5,
            label="checkpoint committed",
        )
    if summary.replica is not None:  # restart=replica: what the other groups cost this one
        for n, stall in enumerate(summary.replica.stalls):
            end = stall.time - t0
            ax.axvspan(
                end - stall.stall_s,
                end,
                color="purple",
                alpha=0.2,
                lw=0,
                label="waited for a group" if n == 0 else None,
            )
        for n, heal in enumerate(summary.replica.heals):
            ax.axvline(
                heal.time - t0,
                color="purple",
                ls="--",
                lw=1,
                label="healed from a peer group" if n == 0 else None,
            )
    ax.set_xlim(0, max(summary.wall_s, 1e-9))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("step")
    ax.set_title(f"{Path(summary.run_dir).name}: ETTR {summary.ettr:.1%}", loc="left")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.text(
        0.66,
        0.94 if with_phases else 0.9,
        format_summary(summary),
        family="monospace",
        fontsize=6 if with_phases else 7,
        va="top",
    )
    fig.savefig(out)
    plt.close(fig)
    return out


def write_report(*, run_dir: Path) -> RunSummary:
    """Write summary.json and timeline.png into run_dir and return the summary."""
    run_dir = Path(run_dir)
    summary = summarize(run_dir=run_dir)
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary.to_json(), indent=2) + "\n")
    plot_timeline(run_dir=run_dir, summary=summary, out=run_dir / TIMELINE_FILE)
    return summary


def run_dir_main(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    action: Callable[[Path], str],
    failures: tuple[type[Exception], ...] = (),
) -> int:
    """The command line of a tool over one run directory: ``action(run_dir)`` and print what it
    returns. A missing or empty run directory exits USAGE, one of ``failures`` FAILED, each with
    one ``error:`` line."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("run_dir", type=Path, help="the run directory, e.g. runs/local")
    args = parser.parse_args(argv)
    try:
        said = action(args.run_dir)
    except RunDirError as err:
        print(f"error: {err}", file=sys.stderr)
        return exits.USAGE
    except failures as err:
        print(f"error: {err}", file=sys.stderr)
        return exits.FAILED
    print(said)
    return exits.OK


def main(argv: list[str] | None = None) -> int:
    """CLI: recompute the summary and timeline of a run directory and print the table."""

    def report(run_dir: Path) -> str:
        summary = write_report(run_dir=run_dir)
        wrote = f"wrote {run_dir / SUMMARY_FILE} and {run_dir / TIMELINE_FILE}"
        return f"{format_summary(summary)}\n\n{wrote}"

    return run_dir_main(
        argv,
        prog="python -m training.runlog.report",
        description=f"Summarize a run directory ({METRICS_FILE}, {EVENTS_FILE}) into "
        f"{SUMMARY_FILE} and {TIMELINE_FILE}.",
        action=report,
    )


if __name__ == "__main__":
    sys.exit(main())

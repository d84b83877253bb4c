"""Run report: summary.json, timeline.png and a compact table for one run directory.

    python -m training.report runs/local      # or: make report RUN=local

The accounting (what counts as productive, what a restart cost) lives in `training.accounting`;
this module draws and prints it. Exit status 2 when the run directory is missing or empty.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from training.accounting import (
    EVENTS_FILE,
    METRICS_FILE,
    Restart,
    RunDirError,
    RunSummary,
    load_run,
    summarize,
)

__all__ = [
    "Restart",
    "RunDirError",
    "RunSummary",
    "format_summary",
    "main",
    "plot_timeline",
    "summarize",
    "write_report",
]

SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.png"


def _fmt_s(seconds: float | None) -> str:
    """Seconds as a short human string (s below 2 min, then min, then h)."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


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
    if s.skipped_lines:
        rows.append(("skipped lines", f"{s.skipped_lines} (truncated/invalid JSON)"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if s.restarts:
        lines.append("")
        lines.append(
            f"{'#':>2} {'mode':<9} {'fault':<13} {'at':>9} {'down':>9} {'redo':>9} {'lost':>9}"
        )
        for n, r in enumerate(s.restarts, 1):
            lines.append(
                f"{n:>2} {r.mode:<9} {(r.fault or '-'):<13} {_fmt_s(r.begin_s):>9} "
                f"{_fmt_s(r.downtime_s):>9} {_fmt_s(r.recompute_s):>9} {_fmt_s(r.lost_s):>9}"
            )
    return "\n".join(lines)


def plot_timeline(*, run_dir: Path, summary: RunSummary, out: Path) -> Path:
    """Draw steps over wall time with faults, restarts and checkpoint commits, plus the summary."""
    import matplotlib

    matplotlib.use("Agg")  # headless: the launcher runs this in pods and CI
    import matplotlib.pyplot as plt

    logs = load_run(run_dir=run_dir)
    t0 = summary.start_time
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
    ax.set_xlim(0, max(summary.wall_s, 1e-9))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("step")
    ax.set_title(f"{Path(summary.run_dir).name}: ETTR {summary.ettr:.1%}", loc="left")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.text(0.66, 0.9, format_summary(summary), family="monospace", fontsize=7, va="top")
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


def main(argv: list[str] | None = None) -> int:
    """CLI: recompute the summary and timeline of a run directory and print the table."""
    parser = argparse.ArgumentParser(
        prog="python -m training.report",
        description=f"Summarize a run directory ({METRICS_FILE}, {EVENTS_FILE}) into "
        f"{SUMMARY_FILE} and {TIMELINE_FILE}.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory, e.g. runs/local")
    args = parser.parse_args(argv)
    try:
        summary = write_report(run_dir=args.run_dir)
    except RunDirError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"\nwrote {args.run_dir / SUMMARY_FILE} and {args.run_dir / TIMELINE_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

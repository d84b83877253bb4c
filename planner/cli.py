"""Command line: ``python -m planner`` (``make planner ARGS=...``)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NoReturn

from facts.checkpoint import BYTES_PER_PARAM
from facts.recipes import RECIPES
from manifests.sizes import SIZES
from planner.costs import DEFAULTS, ZERO_OK, cluster_model
from planner.failures import FAILURE_RATES
from planner.measured import describe, measured_cpu_model, node_loss
from planner.overlays import format_overlays, overlay_plans
from planner.plan import Inputs, plan
from planner.report import format_report
from planner.sanity import format_sanity
from planner.sources import SOURCES
from planner.tiers import TierConfig
from training import exits
from training.tables import text_table

PROG = "python -m planner"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (naming the flag) and exit 2, without the usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(exits.USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _count(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction within [0, 1], got {text!r}")
    return value


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(v)) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive GPU counts like 16384,100000, got {text!r}"
        )
    return tuple(sorted(set(values)))


def _failure_rates(text: str) -> dict[str, float]:
    rates: dict[str, float] = {}
    for item in (v.strip() for v in text.split(",")):
        if item.lower() in FAILURE_RATES:
            rates[item.lower()] = FAILURE_RATES[item.lower()]
            continue
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(
                f"expected {'|'.join(FAILURE_RATES)} or failures per 1000 node-days, got {item!r}"
            )
        rates[item] = value
    return rates


def _overrides(text: str) -> dict[str, float]:
    """'name=value[,name=value...]' for cost parameters."""
    out: dict[str, float] = {}
    for item in (v.strip() for v in text.split(",") if v.strip()):
        name, eq, value = item.partition("=")
        if not eq or name.strip() not in DEFAULTS:
            raise argparse.ArgumentTypeError(
                f"expected NAME=VALUE with a cost parameter NAME (see --list-costs), got {item!r}"
            )
        name = name.strip()
        if name in ZERO_OK:
            out[name] = _fraction(value)
        else:
            out[name] = _positive(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The planner's command line."""
    p = _Parser(
        prog=PROG,
        description="Expected ETTR per restart mode, checkpoint interval and FSx sizing for "
        "a cluster, from a cost model whose terms grow with the job and cite their sources.",
    )
    p.add_argument("--params", type=_positive, default=70e9, help="model parameters (70e9)")
    p.add_argument(
        "--bytes-per-param",
        type=_positive,
        default=float(BYTES_PER_PARAM),
        help=f"checkpoint bytes per parameter ({BYTES_PER_PARAM}: facts/checkpoint.py)",
    )
    p.add_argument(
        "--gpus", type=_gpu_list, default=(1024, 4096, 16384, 65536, 100000), help="GPU counts"
    )
    p.add_argument("--gpus-per-node", type=_positive_int, default=8)
    p.add_argument("--step-time-s", type=_positive, default=10.0, help="seconds per step (10)")
    p.add_argument(
        "--failure-rate",
        type=_failure_rates,
        default=dict(FAILURE_RATES),
        help="llama3|rsc1|rsc2|<failures per 1000 node-days>, comma-separated (all three)",
    )
    p.add_argument(
        "--hardware-share",
        type=_fraction,
        help="share of failures that need a new node (default: Llama 3 Table 5, 76.6%%)",
    )
    p.add_argument(
        "--hot-spares",
        type=_count,
        help="spare nodes waiting (default: manifests/sizes.py's count for the size when it has "
        "one, else the fewest that keep the chance of finding none below 1%%)",
    )
    p.add_argument(
        "--interval-steps",
        type=_positive_int,
        help="evaluate this trainer interval (--checkpoint.interval) instead of optimising it",
    )
    p.add_argument(
        "--tiers",
        choices=("on", "off"),
        default="on",
        help="on: restore from process memory, pod memory or a peer where the failure leaves "
        "them (planner/tiers.py); off: every restart reads FSx. The answer shows both",
    )
    p.add_argument(
        "--memory-interval-steps",
        type=_positive_int,
        help="evaluate this --checkpoint.memory_interval instead of choosing it",
    )
    p.add_argument(
        "--overlay",
        choices=sorted(SIZES),
        help="plan one overlay of manifests/sizes.py: its GPUs, its recipe's --params and "
        "--step-time-s, its spare count",
    )
    p.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        help="take --params and --step-time-s from a trainer recipe (facts/recipes.py)",
    )
    p.add_argument(
        "--software-per-job",
        action="store_true",
        help="software faults per job (Llama 3's count at any size) instead of per node",
    )
    p.add_argument("--brief", action="store_true", help="print only the answer")
    p.add_argument("--full", action="store_true", help="add every table and the sources")
    p.add_argument(
        "--sanity",
        action="store_true",
        help="print the published results the model is checked against, and exit",
    )
    p.add_argument(
        "--lemon-share", type=_fraction, default=0.0, help="share of hardware failures from lemons"
    )
    p.add_argument("--exclude-lemons", action="store_true", help="lemon nodes are removed")
    p.add_argument(
        "--costs",
        choices=("cluster", "measured-cpu"),
        default="cluster",
        help="cluster: cited cluster-scale model (default); measured-cpu: make bench's CPU "
        "numbers, for comparison only",
    )
    p.add_argument(
        "--set",
        type=_overrides,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override cost parameters (repeatable; see --list-costs)",
    )
    p.add_argument("--list-costs", action="store_true", help="print the cost parameters and exit")
    p.add_argument(
        "--keep", type=_positive_int, default=3, help="retained checkpoints (training keep_last: 3)"
    )
    p.add_argument("--fsx-capacity-gib", type=_positive_int, help="evaluate this FSx capacity")
    p.add_argument("--fsx-tier", type=_positive_int, help="... at this MB/s/TiB")
    p.add_argument("--days", type=_positive, default=7.0, help="simulated job length (7)")
    p.add_argument("--trials", type=_positive_int, default=200, help="simulated jobs per config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--out", type=Path, default=Path("docs/planner.png"), help="plot path")
    p.add_argument("--no-plot", action="store_true", help="skip the plot")
    return p


def list_costs() -> str:
    """The cost parameters, their defaults and sources."""
    rows = [
        [name, f"{prm.value:g}", prm.unit, f"{prm.source}{'*' if prm.estimate else ''}: {prm.help}"]
        for name, prm in DEFAULTS.items()
    ]
    lines = text_table(
        rows, headers=["name", "default", "unit", "source: what"], align="<><", gap=" "
    )
    lines.append("* = estimate. Sources:")
    lines += [f"  [{k}] {v}" for k, v in SOURCES.items()]
    return "\n".join(lines)


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    """Flags -> Inputs; raises ValueError with a message for the user."""
    if (args.fsx_capacity_gib is None) != (args.fsx_tier is None):
        raise ValueError("--fsx-capacity-gib and --fsx-tier go together")
    if args.memory_interval_steps is not None and args.tiers == "off":
        raise ValueError("--memory-interval-steps needs --tiers on (no restore reads memory)")
    if args.overlay:
        if args.recipe:
            raise ValueError("--overlay sets the recipe: leave out --recipe")
        size = SIZES[args.overlay]
        args.recipe = size.recipe
        args.gpus = (size.world_size,)
        args.gpus_per_node = size.node_type.gpus
    if args.recipe:
        recipe = RECIPES[args.recipe]
        args.params = float(recipe.params)
        args.step_time_s = recipe.step_time_s
    overrides: dict[str, float] = {}
    for chunk in args.set:
        overrides.update(chunk)
    if args.costs == "measured-cpu":
        if overrides:
            raise ValueError("--set applies to the cluster cost model, not to --costs measured-cpu")
        model = measured_cpu_model(bench_dir=args.bench_dir)
    else:
        model = cluster_model(overrides=overrides)
    return Inputs(
        params=args.params,
        bytes_per_param=args.bytes_per_param,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        step_time_s=args.step_time_s,
        failure_rates=args.failure_rate,
        hardware_share=args.hardware_share,
        hot_spares=args.hot_spares,
        lemon_share=args.lemon_share,
        exclude_lemons=args.exclude_lemons,
        keep=args.keep,
        fsx_capacity_gib=args.fsx_capacity_gib,
        fsx_tier=args.fsx_tier,
        model=model,
        days=args.days,
        trials=args.trials,
        seed=args.seed,
        interval_steps=args.interval_steps,
        per_job_software=args.software_per_job,
        tiers=TierConfig(
            enabled=args.tiers == "on", memory_interval_steps=args.memory_interval_steps
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """Print the report and (unless --no-plot) write the plot."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_costs:
        print(list_costs())
        return exits.OK
    if args.sanity:
        print(format_sanity())
        return exits.OK
    try:
        inputs = inputs_from_args(args)
        plans = plan(inputs=inputs)
        lost = node_loss(bench_dir=args.bench_dir)
        overlays = (
            [] if args.brief or inputs.model.name != "cluster" else overlay_plans(inputs=inputs)
        )
    except ValueError as e:
        parser.error(str(e))
    measured = describe(bench_dir=args.bench_dir) if args.costs == "measured-cpu" else []
    print(
        format_report(
            inputs=inputs, plans=plans, measured_lines=measured, brief=args.brief, full=args.full
        )
    )
    if overlays:
        print("\n".join(format_overlays(inputs=inputs, plans=overlays, measured=lost)))
    if not args.no_plot:
        from planner.plot import plot_plan

        print(f"\nwrote {plot_plan(inputs=inputs, plans=plans, out=args.out)}")
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())

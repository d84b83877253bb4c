"""Command line: ``python -m training {train,prepare,recipes}``.

- ``train``: run ONE rank (under torchrun, ft_launcher, or alone with world size 1). Any config
  field can be overridden as ``--section.field=value`` (``--train.steps=100``).
- ``prepare``: build token shards from text files (``--stdlib`` uses Python's own library).
- ``recipes``: list the named recipes.

Bad input prints one message naming the field and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from training import exits
from training.config import to_dict
from training.data import DataError, prepare, stdlib_sources
from training.exits import ConfigError
from training.overrides import build_config
from training.recipes import RECIPES


def cmd_train(argv: list[str]) -> int:
    config, print_only = build_config(argv)
    if print_only:
        print(json.dumps(to_dict(config), indent=2))
        return 0
    from training.resilience.layer import run_with_restart_layer

    return run_with_restart_layer(config)


def cmd_prepare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m training prepare")
    parser.add_argument("inputs", nargs="*", type=Path, help="text files or directories")
    parser.add_argument(
        "--stdlib", action="store_true", help="use Python's standard library source (no download)"
    )
    parser.add_argument("--max-mb", type=float, default=16.0, help="cap for --stdlib (MiB)")
    parser.add_argument("--out", type=Path, required=True, help="output shard directory")
    args = parser.parse_args(argv)
    sources = list(args.inputs)
    if args.stdlib:
        sources += stdlib_sources(max_bytes=int(args.max_mb * 1024 * 1024))
    meta = prepare(sources=sources, out_dir=args.out)
    print(
        f"prepared {meta['num_tokens']:,} tokens from {meta['num_sources']} files "
        f"into {len(meta['shards'])} shard(s) at {args.out}"
    )
    return 0


def cmd_recipes(_: list[str]) -> int:
    for recipe in RECIPES.values():
        print(f"{recipe.name:12s} {recipe.description}")
    return 0


COMMANDS = {"train": cmd_train, "prepare": cmd_prepare, "recipes": cmd_recipes}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # launchers pass `-m training -- train ...` to keep flags apart
        argv = argv[1:]
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m training {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return exits.USAGE
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return exits.USAGE


if __name__ == "__main__":  # guarded: NVRx's worker and DCP's writer use spawn
    sys.exit(main())

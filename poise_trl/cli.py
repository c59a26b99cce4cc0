"""`poise-trl`: one command with subcommands (`demo`, `plot`, `eval`, `probe-bench`, `bench`).

Each tool's `cli` module holds its parsers: a function `add_<name>_parser(subparsers)` registers one and stores its
handler as `func` (called with the parsed namespace, returning an exit code). Those modules import only argparse and
light defaults; the handlers import the tool (torch, TRL, the trainer) when they run, so `--help` stays fast.
"""

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .bench.cli import add_bench_parser, add_probe_bench_parser
from .demo.cli import add_demo_parser, add_plot_parser
from .rlvr.cli import add_eval_parser

PARSER_BUILDERS: tuple[Callable[[Any], argparse.ArgumentParser], ...] = (
    add_demo_parser,
    add_plot_parser,
    add_eval_parser,
    add_probe_bench_parser,
    add_bench_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poise-trl", description="POISE for TRL: value baselines from the policy's own internal states."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in PARSER_BUILDERS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""Parsers of `poise-trl bench` and `poise-trl probe-bench`: one module per subcommand, whose docstring is what
its `--help` says the benchmark measures.

Only argparse and the light `common` defaults load here; each handler imports its benchmark when it runs.
"""

import argparse
from typing import Any

from .efficiency import add_efficiency_parser, add_summarize_parser
from .gradient import add_gradient_parser
from .overhead import add_overhead_parser
from .pool_tokens import add_pool_tokens_parser
from .probe_bench import add_probe_bench_parser
from .scalars import add_scalars_parser

__all__ = ["add_bench_parser", "add_efficiency_parser", "add_probe_bench_parser"]


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` with its `efficiency`, `summarize`, `overhead`, `gradient`, `pool-tokens` and `scalars`
    subcommands; each stores its handler as `func`."""
    parser = subparsers.add_parser(
        "bench",
        help="training-efficiency and overhead benchmarks (POISE vs GRPO vs RLOO)",
        description="Training-efficiency and overhead benchmarks of POISE against TRL's GRPOTrainer and RLOOTrainer.",
    )
    bench_subparsers = parser.add_subparsers(
        dest="bench_command", required=True, metavar="{efficiency,summarize,overhead,gradient,pool-tokens,scalars}"
    )
    add_efficiency_parser(bench_subparsers)
    add_summarize_parser(bench_subparsers)
    add_overhead_parser(bench_subparsers)
    add_gradient_parser(bench_subparsers)
    add_pool_tokens_parser(bench_subparsers)
    add_scalars_parser(bench_subparsers)
    return parser

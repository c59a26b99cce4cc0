"""Shared helpers of the bench tests."""

import argparse

from poise_lab.bench.cli import add_bench_parser


def parse_bench(argv: list[str]) -> argparse.Namespace:
    """`poise-trl bench ...` argv through the real parser, as the CLI builds it."""
    parser = argparse.ArgumentParser(prog="poise-trl")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)

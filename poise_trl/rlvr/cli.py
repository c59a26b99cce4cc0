"""Parsers of `poise-trl eval` and `poise-trl train`; the handlers import torch, datasets and TRL when they run."""

import argparse
from typing import Any

from poise_trl.tasks.math_data import BENCHMARKS, DEFAULT_BENCHMARKS

EVAL_DESCRIPTION = """`poise-trl eval`: the paper's avg@k protocol (Table 1, App. C.3) on its olympiad math benchmarks.

For each problem, k completions are sampled (paper: k = 32, temperature 0.6, top-p 0.95, at most 8192 new tokens)
and scored with the training reward; avg@k is the mean over problems of the per-problem mean reward. vLLM is used
when installed, as in the paper; otherwise HF `generate` runs on whatever device is there.
"""


def _run_eval(args: argparse.Namespace) -> int:
    from .evaluation import run_eval

    return run_eval(args)


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `eval` on the CLI's subparsers; its handler is stored as `func` (call `args.func(args)`)."""
    parser = subparsers.add_parser(
        "eval",
        help="avg@k on the paper's math benchmarks",
        description=EVAL_DESCRIPTION,
    )
    parser.add_argument("model", help="model id on the Hub or a local model directory")
    parser.add_argument(
        "--benchmarks",
        nargs="+",
        default=list(DEFAULT_BENCHMARKS),
        help=f"registry names ({', '.join(BENCHMARKS)}), Hub dataset ids, local .jsonl/.parquet files, or NAME=PATH",
    )
    parser.add_argument("--k", type=int, default=32, help="completions sampled per problem")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature, as in the paper")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, as in the paper")
    parser.add_argument("--max-new-tokens", type=int, default=8192, help="longest completion, as in the paper")
    parser.add_argument(
        "--backend", choices=("auto", "hf", "vllm"), default="auto", help="auto: vLLM if installed, else HF"
    )
    parser.add_argument("--device", default=None, help="HF backend only (default: cuda if available, else cpu)")
    parser.add_argument("--batch-size", type=int, default=1, help="HF backend only: prompts per generate call")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--limit", type=int, default=None, help="first N problems of each benchmark, for smoke runs (default: all)"
    )
    parser.add_argument("--output", default="eval_results.json", help="where to write the JSON results")
    parser.set_defaults(func=_run_eval)
    return parser


def _run_train(args: argparse.Namespace) -> int:
    from .train import run

    return run(args.arguments, traceback=getattr(args, "debug", False))


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `train`: its arguments are `TrlParser`'s (`--config RECIPE.yaml` and every config field), so the CLI
    hands them over unparsed (`forwards_arguments`) and `--help` is the training parser's own."""
    parser = subparsers.add_parser(
        "train",
        help="train with POISETrainer (or the GRPO baseline) from a YAML recipe, as `trl grpo` does",
        add_help=False,
    )
    parser.set_defaults(func=_run_train, forwards_arguments=True)
    return parser

"""Will POISE work on my model? The paper's value-prediction benchmark in one command.

1. Collect: sample K rollouts per prompt, score them with the reward, and extract POISE features in one
   teacher-forced pass with the trainer's own feature code, hooking several layers and pooling windows at once.
   Everything is saved (`collection.safetensors`), so fitting can be redone without generation.
2. Split by prompt into train and held-out prompts; a held-out prompt's target is its empirical avg@K.
3. Fit every estimator on the train rows with the trainer's leave-one-out target and score the mean of its
   predictions over each held-out prompt's rollouts: MAE and Pearson r with bootstrap CIs over prompts, and the
   variance reduction it would give as a cross-rollout baseline. Estimators: the POISE probe (release and paper
   presets), feature ablations (paper Table 3), a layer sweep (Tables 6-7), pooling windows (Tables 8-9), MLP probes
   (Table 10), an SPPO-style critic (App. D.1) and trivial references.
4. Report markdown tables in the paper's layout, `results.json`, and `figure1.png` (probe vs critic, paper Fig. 1).
"""

import argparse
from collections.abc import Callable
from typing import Any

from poise_trl.choices import HEADS, PROBE_PRESETS

from ..common import DEFAULT_MLPS, DEFAULT_POOLS
from .collection import add_collection_arguments


def _run_probe_bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    from ..value.report import run_probe_bench

    return run_probe_bench(args, log)


def add_probe_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `probe-bench` on the CLI's subparsers; its handler is `func` (call `args.func(args)`)."""
    parser = subparsers.add_parser(
        "probe-bench",
        help="will POISE work on my model? probe vs critic value prediction, with the paper's ablations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_collection_arguments(parser, num_prompts=320, k=8)
    add = parser.add_argument
    add(
        "--layers",
        default="auto",
        help="comma-separated layers to sweep, or all (auto: all up to 16 layers, else odd)",
    )
    add("--pools", default=",".join(map(str, DEFAULT_POOLS)), help="pooling windows to sweep")
    add(
        "--features",
        nargs="+",
        default=None,
        metavar="BLOCK",
        help="any of prompt, reasoning, entropy, length (default: POISEConfig's)",
    )
    add("--preset", choices=list(PROBE_PRESETS), default=None, help="probe for the sweeps (default: POISEConfig's)")
    add("--test-fraction", type=float, default=0.25, help="share of prompts held out")
    add("--bootstrap", type=int, default=1000, help="bootstrap resamples of held-out prompts for the CIs")
    add("--vr-group-size", type=int, default=2, help="G for the variance-reduction column (POISE uses 2)")
    add("--mlps", default=DEFAULT_MLPS, help="MLP probes, DEPTHxWIDTH comma-separated ('' for none)")
    add(
        "--probe-heads",
        nargs="*",
        default=None,
        choices=list(HEADS),
        metavar="HEAD",
        help=f"the trainer's other value heads (of {', '.join(HEADS)}, as POISEConfig.probe_head takes them) "
        "scored beside the default one at --preset, on the same front end (default: every other one; none when "
        "given alone)",
    )
    add("--no-critic", action="store_true", help="skip the critic baseline")
    add("--critic-epochs", type=int, default=10, help="max epochs (early stopping on 10%% of train prompts)")
    add(
        "--critic-lr",
        type=float,
        default=None,
        help="critic learning rate (default: 1e-5 above 100M parameters, else 3e-4)",
    )
    add("--critic-batch-size", type=int, default=16, help="critic training batch, in rollouts")
    add("--splits", type=int, default=10, help="prompt splits of the beyond-the-paper tables; 0 skips them")
    add("--prefix", action="store_true", help="also the per-prefix probe's variance explained by completion position")
    add("--output-dir", default="runs/probe_bench", help="collection, results.json, results.md, figure1.png")
    add(
        "--from-collection",
        default=None,
        help="refit from a saved collection.safetensors, without generation (default: collect anew)",
    )
    add(
        "--export",
        default=None,
        help="write the release-preset probe here, for POISEConfig(probe_init_path=...) (default: no export)",
    )
    parser.set_defaults(func=_run_probe_bench)
    return parser

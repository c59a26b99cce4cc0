"""Does a rollout scalar in the probe's row lower the value's error? Measured on a pool of `bench gradient`.

Each --columns NAME=MODULE:FUNCTION is a variant: FUNCTION(rollouts) -> (N, k) columns, from the pool's stored tensors
(poise_lab.bench.scalars.PoolRollouts: ids, masks, per-token entropies and log-probabilities, texts, the library's
spans), appended to the probe's default row; each --replace-scalars entry puts its columns in the place of the row's
entropy statistics; each --probe-scalars entry is the row a `probe_scalars` list gives, its rollout scalars
(poise_trl.features.columns.SCALARS) computed by the library's own call. For each of --probes (default: POISE (paper)'s
and POISE (default)'s settings; the POISE authors' recipe, probe_preset="reference", and the recipe with one change are
offered too), the probe of every variant is fitted on the pool's separate probe pool as bench gradient fits it, and
measured at G=2 with the exact instrument: M, the value's error (variance per completion minus the oracle baseline's)
in units of W, and the held-out r of each prompt's mean value with its success rate, each with a paired difference
against the same probe's default row (the row its own probe_scalars give) and, with --against, against that one row,
over the same bootstrap resamples. Pools without per-token entropies get them from `bench pool-tokens`.
"""

import argparse
from typing import Any

from ..common import DEMO_MODEL
from ..probes import DEFAULT_PROBES, PROBES


def _run_scalars(args: argparse.Namespace) -> int:
    from ..scalars import run_scalars

    return run_scalars(args)


def add_scalars_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "scalars",
        help="the value's error M and held-out r with extra rollout scalars in the probe's row, on a cached pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("folder", help="the pool's folder (under --cache-dir/gradient of bench gradient)")
    add(
        "--columns",
        nargs="+",
        default=[],
        metavar="NAME=MODULE:FUNCTION",
        help="a variant per entry, its columns after the default row, e.g. "
        "length=poise_lab.bench.scalars:completion_length",
    )
    add(
        "--replace-scalars",
        nargs="+",
        default=[],
        metavar="NAME=MODULE:FUNCTION",
        help="a variant per entry, its columns in the place of the default row's entropy statistics",
    )
    add(
        "--probe-scalars",
        nargs="+",
        default=[],
        metavar="NAME=ENTRY,ENTRY",
        help="a variant per entry: the row POISEConfig.probe_scalars gives with these rollout scalars (each a name of "
        "poise_trl.features.columns.SCALARS or a group of poise_lab.bench.scalars.SCALAR_SETS: paper, entropy12, "
        "length, repetition, all), computed by the library from the pool's per-token record",
    )
    add(
        "--probes",
        nargs="+",
        default=None,
        choices=list(PROBES),
        metavar="NAME",
        help=f"the probes each variant's row is fitted with (default: {' '.join(DEFAULT_PROBES)}, bench gradient's "
        "POISE (paper) and POISE (default)): any of "
        + "; ".join(f"{k} ({p.label})" for k, p in PROBES.items())
        + "; a probe's default row holds its own probe_scalars",
    )
    add(
        "--against",
        default=None,
        metavar="PROBE:VARIANT",
        help="one row (e.g. poise_reference:default) every other row is also paired with, beside its own probe's "
        "default row",
    )
    add(
        "--tokenizer",
        default=None,
        help="the tokenizer of the model that sampled the pool, for the scalars cut from the decoded text (text_*): "
        f"a model folder, a real model's name (e.g. smollm2-135m, prepared from its package) or {DEMO_MODEL!r} "
        "(the toy demo model's; default: the pool's model_path)",
    )
    add("--bootstrap", type=int, default=1000, help="bootstrap resamples of the pool's prompts for the CIs")
    add("--seed", type=int, default=None, help="the bootstrap's seed (default: the pool's, as bench gradient used)")
    add(
        "--probe-prompts",
        type=int,
        default=None,
        help="prompts of the probe pool to fit on (default: all it holds beyond the measured ones, as sampled)",
    )
    add("--output-dir", default="runs/bench/scalars", help="results.json and results.md")
    parser.set_defaults(func=_run_scalars)
    return parser

"""The per-token entropies of a pool of `bench gradient` sampled before pools kept them.

Teacher-forces the pool's stored completions (pool.safetensors and probe_pool.safetensors of FOLDER) through the
model that sampled them, and writes each file's per-token entropies, log-probabilities and decoded texts beside it
(pool.tokens.safetensors, probe_pool.tokens.safetensors) only if the pass reproduces the file's stored feature rows
(both hidden-state blocks, the entropy statistics, the length) within --tolerance: a model that did not sample the
pool is refused with the differences and nothing is written. Pools sampled since keep them from their own pass.
"""

import argparse
from typing import Any


def _run_pool_tokens(args: argparse.Namespace) -> int:
    from ..pool_tokens import run_pool_tokens

    return run_pool_tokens(args)


def add_pool_tokens_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "pool-tokens",
        help="add per-token entropies to a pool of bench gradient, checked against its stored features",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("folder", help="the pool's folder (under --cache-dir/gradient of bench gradient)")
    add("--model", default=None, help="the model folder that sampled the pool (default: the pool's model_path)")
    add("--batch-size", type=int, default=64, help="rollouts per pass: bench gradient's --feature-batch-size")
    add("--tolerance", type=float, default=1e-3, help="largest |recomputed - stored| of any feature column")
    add("--device", default="cpu", help="cpu (the pools here were made on it), cuda, or auto")
    parser.set_defaults(func=_run_pool_tokens)
    return parser

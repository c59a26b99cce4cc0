"""Does POISE need fewer completions? The error of each method's policy-gradient estimate per
completion, at one fixed policy (run it at the start model and at a trained one).

A pool of NUM_PROMPTS prompts x K rollouts is sampled and scored once; each rollout's gradient of log pi(y|x) is taken
once in two subspaces: the B matrices of a rank-r LoRA on every linear layer (zero at init, so dL/dB is a fixed random
sketch of every layer's weight gradient) and the exact gradient of every norm gain (a check that the ranking does not
depend on the sketch). Each rule's per-completion variance B tr Cov and bias against the true gradient of the prompt
distribution are exact expectations over the pool (U-statistics; no batches, no reference, no centring):
  - GRPO G=8 with and without std scaling, DAPO-DS-carry G=8 (a fixed number of informative groups, charged its
    expected G/q completions per kept group), RLOO k=2, POISE (paper) and POISE (default) at G=2, whose probe is
    fitted on a separate pool of --probe-prompts prompts x 2 rollouts (or is the snapshot's saved estimator);
  - the oracle baseline (the true success rate) and POISE (default) with the oracle prompt sampler, as headroom;
  - with --probe-heads, POISE (default) with each other value head, alone and with its own probe sampler (on a
    snapshot with its saved estimator, that estimator refit with each head on the run's own buffer; if the run kept a
    prompt history, every head also without it: pass the run's training prompts, e.g. a demo's `train` folder, as
    --dataset, so the measured prompts have a history);
  - named in --contenders only, POISE with a per-prefix baseline V(x, y_<t) at every token (alone, and half-mixed
    with the partner's value): exact on the family [g; h], h = grad of sum_t V_t log pi(y_t | x, y_<t) from a second
    backward pass, with the check ||E h||^2 / ||g||^2 (zero for an unbiased V);
  - reported: variance, bias^2, the shares of GRPO G=8's and RLOO k=2's completions for the same error (ratios of
    scale-matched variances) and the between/within-prompt decomposition Bv/W, with 95% percentile bootstrap
    intervals over the prompts.
The pool, its features and Gram matrices are cached (--cache-dir/gradient), so a rerun is the analysis alone.
"""

import argparse
from typing import Any

from poise_trl.choices import HEADS
from poise_trl.settings import DEFAULT_FLOOR

from ..contenders import GRADIENT_CONTENDERS, GRADIENT_PREFIX_ROWS
from .collection import add_collection_arguments


def _run_gradient(args: argparse.Namespace) -> int:
    from ..gradient import run_gradient

    return run_gradient(args)


def add_gradient_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "gradient",
        help="policy-gradient error per completion at a fixed policy: POISE vs GRPO, RLOO, DAPO",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_collection_arguments(parser, num_prompts=64, k=16)
    add = parser.add_argument
    add(
        "--contenders",
        nargs="+",
        choices=[*GRADIENT_CONTENDERS, *GRADIENT_PREFIX_ROWS],
        default=list(GRADIENT_CONTENDERS),
        metavar="NAME",
        help=f"any of {', '.join(GRADIENT_CONTENDERS)}; the per-prefix rows {', '.join(GRADIENT_PREFIX_ROWS)} "
        "(a second gradient pass: V(x, y_<t) from a per-prefix probe on the probe pool) only when named",
    )
    add("--bootstrap", type=int, default=1000, help="bootstrap resamples of the pool's prompts for the CIs")
    add(
        "--probe-prompts",
        type=int,
        default=256,
        help="POISE's probe is fitted on a separate pool of this many prompts x 2 rollouts (the online buffer)",
    )
    add(
        "--prompt-selection-floor",
        type=float,
        default=DEFAULT_FLOOR,
        help="the probe sampler's share of uniform probability (POISEConfig.prompt_selection_floor)",
    )
    add(
        "--probe-heads",
        nargs="+",
        default=[],
        choices=list(HEADS),
        metavar="HEAD",
        help=f"POISE (default) again with each of these value heads (of {', '.join(HEADS)}, as "
        "POISEConfig.probe_head takes them), fitted on the same probe pool (or, for a run's snapshot, its saved "
        "estimator refit on its own buffer), alone and with its own probe sampler; from a cached pool the analysis "
        "alone",
    )
    add("--lora-rank", type=int, default=1, help="rank of the LoRA sketch (its B gradients are stored per rollout)")
    add("--output-dir", default="runs/bench/gradient", help="results.json, results.md, gradient.png")
    parser.set_defaults(func=_run_gradient)
    return parser

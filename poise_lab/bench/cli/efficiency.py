"""Sample efficiency of POISE against GRPO, DAPO's dynamic sampling, RLOO and the peers, per generated rollout.

Every contender trains on the same B completions per optimizer step (paper §2.3: at a fixed budget, fewer rollouts
per prompt means more distinct prompts and a lower-variance gradient). The contenders, each with the prompts a step
covers and what it runs, are listed after the options (the table `poise_lab.bench.contenders`).

Shared by all: the model and its warm start (per seed), the data-order seed, clip range (0.2/0.28), max completion
length, temperature 1, no KL, one generation per optimizer step, the completions budget (`--budget`: every run stops
once it has generated that many) and the held-out evaluator (its own sampling seed, so every contender starts from
the same measured accuracy), run each time another `--eval-every` completions have been generated: one grid for
all. The learning rate is `--learning-rate`, or with `--tune-lr` each contender's own: the best median AUC over
`--lr-grid` on `--tuning-seeds` (disjoint from the evaluation seeds; a best rate at the edge extends the grid x2),
each one-change ablation at the tuned rate of the contender it changes. GRPO, DAPO-DS and POISE use token-mean
aggregation (`loss_type="dapo"`); TRL's RLOOTrainer always uses a sequence mean, the one difference that cannot be set
away.

Compute, per run: completions generated and trained, tokens generated, prefill tokens (prompt tokens per generated
completion, plus value-guided selection's own prefill), rows through teacher-forced passes, and train seconds.

Statistics (scipy), with the x-axis in completions GENERATED: the AUC, the mean held-out avg@k over the first
`--budget` completions (linear interpolation between evaluations); per headline comparison (each headline row
against each reference and each row it is paired with, as listed below), paired by seed, the wins, the difference of
AUC above the start and the ratio of completions generated until avg@k gains 75% of GRPO-8's median gain (never
reached counts against its contender), with BCa bootstrap CIs and Wilcoxon signed-rank p-values, Holm-corrected
across all headline tests.

Resumable: every (task, contender, rate, seed) run writes OUTPUT_DIR/runs/TASK/CONTENDER/lrRATE_seedN.json and a
re-run skips those already there; `poise-trl bench summarize OUTPUT_DIR` reports from whatever runs exist. Runs are
independent processes (`--jobs`), one thread each on CPU, so the results do not depend on the number of jobs.

Offline tasks (`--task`, `poise_lab.tasks.toy`): `sort` (2-9 digits; difficulty = length) and `hops` (pointer
chasing; one prompt and completion length, difficulty in the content), each warm-started so that over a quarter of
G=8 groups start tied (the task check). With `--model`, `--train-dataset` and `--eval-dataset` the same command
trains a real model on a math dataset, one run at a time on one GPU, with gradient checkpointing on and
`--per-device-batch-size` micro-batches. With `--train-dataset arith` it trains a real model (e.g. `--model
smollm2-135m`, prepared from its package) on the arith task, every seed evaluated on the same `--eval-limit`
held-out arith prompts (default 96).
"""

import argparse
import time
from typing import Any

from poise_lab.models.real import REAL_MODELS

from ..common import (
    ARITH_DATASET,
    DAPO_MAX_ROUNDS,
    DEFAULT_BUDGET,
    DEFAULT_EVAL_EVERY,
    DEFAULT_LR_GRID,
    DEFAULT_SEEDS,
    DEFAULT_TUNING_SEEDS,
    DEMO_LEARNING_RATE,
    MAX_GRID_EXTENSIONS,
    PAPER_LEARNING_RATE,
    TASK_DIGITS,
    TASKS,
    quiet_libraries,
    set_cpu_threads,
)
from ..contenders import CONTENDERS, contenders_help
from ..settings import EfficiencySettings


def task_seeds(spec: str) -> tuple[str, list[int]]:
    """`TASK=A-B` (seeds A..B) or `TASK=a,b,c` -> (task, seeds)."""
    task, _, seeds = spec.partition("=")
    try:
        if "-" in seeds:
            low, high = (int(v) for v in seeds.split("-"))
            values = list(range(low, high + 1))
        else:
            values = [int(v) for v in seeds.split(",")]
    except ValueError:
        values = []
    if task not in TASKS or not values:
        raise argparse.ArgumentTypeError(f"{spec!r}: write TASK=A-B or TASK=a,b,c with TASK one of {', '.join(TASKS)}")
    return task, values


def _run_efficiency(args: argparse.Namespace) -> int:
    """`bench efficiency`: run (or resume) the study, then report from its run files."""
    from ..report import write_report
    from ..study import run_study

    settings = EfficiencySettings.from_args(args)
    quiet_libraries()
    set_cpu_threads(settings.cpu_threads)
    start = time.perf_counter()
    run_study(settings)
    print(f"[bench efficiency] all runs done in {time.perf_counter() - start:.0f} s", flush=True)
    print(write_report(settings.output_dir, settings.allow_mixed_code))
    return 0


MIXED_CODE_HELP = (
    "report runs written by different poise-trl versions or commits together (each run file records its own; by "
    "default the report refuses to mix them)"
)


def _run_summarize(args: argparse.Namespace) -> int:
    from ..report import write_report

    print(write_report(args.results_dir, args.allow_mixed_code))
    return 0


def add_efficiency_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "efficiency",
        help="POISE against GRPO, DAPO's dynamic sampling, RLOO and the peers, per completion generated",
        description=__doc__,
        epilog=contenders_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=list(CONTENDERS),
        default=list(CONTENDERS),
        help="one lacking a config field in this library version is reported, not run",
    )
    parser.add_argument(
        "--task",
        nargs="+",
        choices=TASKS,
        default=["sort"],
        help="offline tasks, one after another in this order (ignored with --model)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="evaluation seeds")
    parser.add_argument(
        "--task-seeds",
        nargs="+",
        type=task_seeds,
        default=[],
        metavar="TASK=A-B",
        help="a task's own evaluation seeds instead of --seeds, e.g. hops=0-9",
    )
    parser.add_argument(
        "--tune-lr",
        action="store_true",
        help="each contender at the rate with the best median AUC on --tuning-seeds (ablations: POISE "
        "(paper)'s rate); else every contender at --learning-rate",
    )
    parser.add_argument(
        "--lr-grid",
        nargs="+",
        type=float,
        default=list(DEFAULT_LR_GRID),
        help="rates tried by --tune-lr; a best rate at an edge extends it by x2 that way",
    )
    parser.add_argument(
        "--tuning-seeds",
        nargs="+",
        type=int,
        default=list(DEFAULT_TUNING_SEEDS),
        help="seeds of the tuning runs, disjoint from the evaluation seeds",
    )
    parser.add_argument(
        "--max-grid-extensions",
        type=int,
        default=MAX_GRID_EXTENSIONS,
        help="per contender, how often --tune-lr may extend the grid",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs in parallel processes, each with --cpu-threads threads; results do not depend on "
        "it (default: the usable cores; 1 with --model)",
    )
    parser.add_argument("--completions-per-step", type=int, default=32, help="B trained per step, every contender")
    parser.add_argument(
        "--per-device-batch-size",
        type=int,
        default=None,
        help="micro-batch; gradient accumulation keeps B per optimizer step (default: B)",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_BUDGET,
        help="completions generated per run: each stops once it has generated this many",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=DEFAULT_EVAL_EVERY,
        help="held-out avg@k each time this many more completions have been generated",
    )
    parser.add_argument("--eval-k", type=int, default=8, help="k of the held-out avg@k")
    parser.add_argument("--eval-seed", type=int, default=0, help="sampling seed of every held-out evaluation")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help=f"every contender's rate without --tune-lr (default: {DEMO_LEARNING_RATE:g} for the "
        f"demo tasks, {PAPER_LEARNING_RATE:g} with --model)",
    )
    parser.add_argument("--epsilon", type=float, default=0.2, help="lower clip range, all contenders")
    parser.add_argument("--epsilon-high", type=float, default=0.28, help="upper clip range, all contenders")
    parser.add_argument(
        "--max-completion-length",
        type=int,
        default=None,
        help="longest completion (default: 12 for the demo task, 2048 with --model)",
    )
    parser.add_argument(
        "--grpo-scale-rewards",
        choices=["group", "batch", "none"],
        default="group",
        help="GRPO and DAPO-DS (GRPO-8 no-scale always uses none)",
    )
    parser.add_argument(
        "--dapo-max-rounds",
        type=int,
        default=DAPO_MAX_ROUNDS,
        help="DAPO-DS: most generation batches per step (hitting it logs dapo/capped)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="all contenders (default: on with --model, off for the tiny demo model)",
    )
    parser.add_argument(
        "--output-dir",
        default="runs/bench/efficiency",
        help="results directory: runs/TASK/CONTENDER/lrRATE_seedN.json (a re-run skips those that "
        "exist), tuning, efficiency.json, PNG",
    )
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads per run on CPU (0: torch's default)")
    parser.add_argument("--allow-mixed-code", action="store_true", help=MIXED_CODE_HELP)
    demo = parser.add_argument_group("offline demo tasks (used when --model is not given)")
    demo.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-start steps (default: per task)")
    demo.add_argument("--min-digits", type=int, default=TASK_DIGITS["sort"][0], help="sort task only")
    demo.add_argument("--max-digits", type=int, default=TASK_DIGITS["sort"][1], help="sort task only")
    demo.add_argument("--num-eval", type=int, default=140, help="held-out prompts")
    demo.add_argument(
        "--cache-dir", default=None, help="warm-started models (default: $XDG_CACHE_HOME/poise-trl/bench)"
    )
    real = parser.add_argument_group("real model and dataset (a GPU in practice)")
    real.add_argument(
        "--model",
        default=None,
        help=f"Hub id, local path or a real model ({', '.join(REAL_MODELS)}); every contender starts from it "
        "(default: the demo task's tiny model)",
    )
    real.add_argument(
        "--train-dataset",
        default=None,
        help=f"{ARITH_DATASET} (the arith task, held-out split included), or a poise_trl.tasks.math_data registry "
        "key, Hub id or local file; required with --model",
    )
    real.add_argument(
        "--train-limit",
        type=int,
        default=None,
        help="first N training rows (default: all); on a demo task RL trains on its first N prompts (the warm start "
        "keeps the whole split), so each is drawn about budget / N times: the regime where a prompt history helps",
    )
    real.add_argument(
        "--eval-dataset", default=None, help="held-out benchmark (registry key, Hub id or file); required with --model"
    )
    real.add_argument("--eval-limit", type=int, default=None, help="first N held-out problems (default: all)")
    real.add_argument("--eval-batch-size", type=int, default=8, help="prompts per generate call in evaluation")
    parser.set_defaults(func=_run_efficiency)
    return parser


def add_summarize_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "summarize",
        help="rebuild the efficiency report (tables, efficiency.json, plots) from the run files written so far",
        description="Read RESULTS_DIR/runs/*/*/*.json (a finished or partial `bench efficiency` study) and write "
        "efficiency.json, report.md and one plot per task there.",
    )
    parser.add_argument("results_dir", help="the --output-dir of a `bench efficiency` study")
    parser.add_argument("--allow-mixed-code", action="store_true", help=MIXED_CODE_HELP)
    parser.set_defaults(func=_run_summarize)
    return parser

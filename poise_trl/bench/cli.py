"""Parsers of `poise-trl bench` and `poise-trl probe-bench`, with what each benchmark measures in its `--help`.

Only argparse and the light `common` defaults load here; each handler imports its benchmark when it runs.
"""

import argparse
import time
from collections.abc import Callable
from typing import Any

from poise_trl.demo.real import REAL_MODELS
from poise_trl.sampling import DEFAULT_FLOOR

from .common import (
    ARITH_DATASET,
    CONTENDERS,
    DAPO_MAX_ROUNDS,
    DEFAULT_BUDGET,
    DEFAULT_EVAL_EVERY,
    DEFAULT_LR_GRID,
    DEFAULT_MATH_DATASET,
    DEFAULT_MLPS,
    DEFAULT_POOLS,
    DEFAULT_SEEDS,
    DEFAULT_TUNING_SEEDS,
    DEMO_LEARNING_RATE,
    DEMO_MODEL,
    GRADIENT_CONTENDERS,
    GRADIENT_PREFIX_ROWS,
    MAX_GRID_EXTENSIONS,
    PAPER_LEARNING_RATE,
    PROBE_FIT_ROWS,
    QWEN3_4B_HIDDEN,
    SORT_DATASET,
    TASK_DIGITS,
    TASKS,
    quiet_libraries,
    set_cpu_threads,
)
from .settings import EfficiencySettings

PROBE_BENCH_DESCRIPTION = """Will POISE work on my model? The paper's value-prediction benchmark in one command.

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

EFFICIENCY_DESCRIPTION = """Sample efficiency of POISE vs GRPO, DAPO dynamic sampling and RLOO, per generated rollout.

Every contender trains on the same B completions per optimizer step (paper §2.3: at a fixed budget, fewer rollouts
per prompt means more distinct prompts and a lower-variance gradient):

    GRPO  G=8        B/8 prompts   trl.GRPOTrainer
    GRPO  G=8 no-scale             the same with scale_rewards="none" (POISE does not scale either)
    DAPO-DS G=8      B/8 prompts   GRPOTrainer + dynamic sampling (DAPO §3.2, in the benchmark): groups whose rewards
                                   all tie are dropped and fresh prompts generated until B/8 groups are informative
                                   (at most --dapo-max-rounds generation batches per step); it generates more than B
    DAPO-DS-carry G=8              the same, but the last round's surplus informative groups are trained on at the
                                   next step: only tied groups are discarded
    RLOO  k=2        B/2 prompts   trl.RLOOTrainer
    GRPO  G=2        B/2 prompts   trl.GRPOTrainer
    POISE (paper)    B/2 prompts   POISETrainer, the paper's algorithm (paper probe preset, RLOO bootstrap)
    POISE (default)  B/2 prompts   POISETrainer with the library's defaults
    POISE +partner / +shrunk / +selection   POISE (paper) plus one beyond-the-paper option each: the partner-aware
                                   probe, the shrunk bootstrap, value-guided prompt selection
    POISE per-prefix B/2 prompts   POISE (default) with probe_granularity="prefix": A_t = r - V(x, y_<t) per token

Shared by all: the model and its warm start (per seed), the data-order seed, clip range (0.2/0.28), max completion
length, temperature 1, no KL, one generation per optimizer step, the completions budget (`--budget`: every run stops
once it has generated that many) and the held-out evaluator (its own sampling seed, so every contender starts from
the same measured accuracy), run each time another `--eval-every` completions have been generated: one grid for
all. The learning rate is `--learning-rate`, or with `--tune-lr` each contender's own: the best median AUC over
`--lr-grid` on `--tuning-seeds` (disjoint from the evaluation seeds; a best rate at the edge extends the grid x2),
the one-change ablations at POISE (paper)'s. GRPO, DAPO-DS and POISE use token-mean aggregation
(`loss_type="dapo"`); TRL's RLOOTrainer always uses a sequence mean, the one difference that cannot be set away.

Compute, per run: completions generated and trained, tokens generated, prefill tokens (prompt tokens per generated
completion, plus value-guided selection's own prefill), rows through teacher-forced passes, and train seconds.

Statistics (scipy), with the x-axis in completions GENERATED: the AUC, the mean held-out avg@k over the first
`--budget` completions (linear interpolation between evaluations); per headline comparison (POISE default and paper
against GRPO-8, GRPO-8 no-scale, DAPO-DS, DAPO-DS-carry, RLOO-2), paired by seed, the wins, the difference of AUC
above the start and the ratio of completions generated until avg@k gains 75% of GRPO-8's median gain (never
reached counts against its contender), with BCa bootstrap CIs and Wilcoxon signed-rank p-values, Holm-corrected
across all headline tests.

Resumable: every (task, contender, rate, seed) run writes OUTPUT_DIR/runs/TASK/CONTENDER/lrRATE_seedN.json and a
re-run skips those already there; `poise-trl bench summarize OUTPUT_DIR` reports from whatever runs exist. Runs are
independent processes (`--jobs`), one thread each on CPU, so the results do not depend on the number of jobs.

Offline tasks (`--task`, `poise_trl.demo.tasks`): `sort` (2-9 digits; difficulty = length) and `hops` (pointer
chasing; one prompt and completion length, difficulty in the content), each warm-started so that over a quarter of
G=8 groups start tied (the task check). With `--model`, `--train-dataset` and `--eval-dataset` the same command
trains a real model on a math dataset, one run at a time on one GPU, with gradient checkpointing on and
`--per-device-batch-size` micro-batches. With `--train-dataset arith` it trains a real model (e.g. `--model
smollm2-135m`, prepared from its package) on the arith task, every seed evaluated on the same `--eval-limit`
held-out arith prompts (default 96).
"""

GRADIENT_DESCRIPTION = """Does POISE need fewer completions? The error of each method's policy-gradient estimate per
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
  - named in --contenders only, POISE with a per-prefix baseline V(x, y_<t) at every token (alone, and half-mixed
    with the partner's value): exact on the family [g; h], h = grad of sum_t V_t log pi(y_t | x, y_<t) from a second
    backward pass, with the check ||E h||^2 / ||g||^2 (zero for an unbiased V);
  - reported: variance, bias^2, the shares of GRPO G=8's and RLOO k=2's completions for the same error (ratios of
    scale-matched variances) and the between/within-prompt decomposition Bv/W, with 95% percentile bootstrap
    intervals over the prompts.
The pool, its features and Gram matrices are cached (--cache-dir/gradient), so a rerun is the analysis alone.
"""

OVERHEAD_DESCRIPTION = """POISE's per-step time and peak memory against plain GRPO, and the probe fit's cost.

Time. POISETrainer and trl.GRPOTrainer, built from the same model with the same G, completions per step, max
length and loss, train in two threads that take turns: A B A B, one generation cycle each, so machine load hits
both alike; the ratio is taken pair by pair. Completions are forced to exactly `--completion-lengths` tokens
(`min_new_tokens`) and scored by a reward that accepts any text, so both do the same work; at 128 tokens or more
generation dominates the step, as it does at real scale. Each length has two rows:
  - "+1 pass": TRL runs no old-log-prob pass (one optimizer step per generation), so POISE runs one no-grad
    teacher-forced pass of its own;
  - "+0 pass": two optimizer steps per generation (`steps_per_generation` twice the accumulation steps), so TRL
    computes old log-probs and POISE captures its features inside that pass.
With `--per-device-batch-size` each optimizer step accumulates micro-batches to the same completions per step.
A cycle is one generation and its optimizer steps. POISE's probe buffer is filled to capacity after the first
cycle, so every timed step pays the steady-state refit on a full buffer, and its probe is trusted after one step,
so every timed step pays for serving it too. The first `--warmup-cycles` cycles are not timed. The trainers are
held at once: with `--model` on one GPU, pick a model for which all fit.
  - `--prefix`: a third trainer, POISE with probe_granularity="prefix" (a value V(x, y_<t) for every generated
    token from the same hooked layer in the same pass), takes its turn in every row; its time and peak memory are
    reported against GRPO and against POISE (default), with the count of timed steps that served token advantages.
  - `--importance`: a trainer more, POISE with prompt_selection="importance" (twice the candidate prompts, one
    no-grad prefill of their prompt tokens, the prompt-only refit, the draw), takes its turn in every row; its time
    against GRPO and against POISE (default), and the seconds its `_select_prompts` took per cycle (the sampler's own
    cost, prefill and refit included) and their share of its cycle.

Memory, measured first (before the timing builds its trainers). Each contender runs every row in a fresh process,
one trainer at a time after one warm-up cycle: the peak is `torch.cuda.max_memory_allocated` on a GPU and the peak
resident set on a CPU (Linux VmHWM, reset once the trainer is built; glibc returns freed blocks of 64 KiB or more to
the OS, so the resident set tracks live tensors), each above the memory held when training starts.

Probe fit. The value probe on 4096 x (2*2560 + 3) features, the Qwen3-4B size, against scikit-learn's
StandardScaler (+ per-block PCA) + Ridge on the same data with the same thread count, for the paper and release
presets, predictions compared; also on the GPU when there is one.
"""


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
    from .report import write_report
    from .study import run_study

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
    from .report import write_report

    print(write_report(args.results_dir, args.allow_mixed_code))
    return 0


def _run_overhead(args: argparse.Namespace) -> int:
    from .overhead import run_overhead

    return run_overhead(args)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` with its `efficiency`, `summarize`, `overhead` and `gradient` subcommands; each stores its
    handler as `func`."""
    parser = subparsers.add_parser(
        "bench",
        help="training-efficiency and overhead benchmarks (POISE vs GRPO vs RLOO)",
        description="Training-efficiency and overhead benchmarks of POISE against TRL's GRPOTrainer and RLOOTrainer.",
    )
    bench_subparsers = parser.add_subparsers(
        dest="bench_command", required=True, metavar="{efficiency,summarize,overhead,gradient}"
    )
    add_efficiency_parser(bench_subparsers)
    summarize = bench_subparsers.add_parser(
        "summarize",
        help="rebuild the efficiency report (tables, efficiency.json, plots) from the run files written so far",
        description="Read RESULTS_DIR/runs/*/*/*.json (a finished or partial `bench efficiency` study) and write "
        "efficiency.json, report.md and one plot per task there.",
    )
    summarize.add_argument("results_dir", help="the --output-dir of a `bench efficiency` study")
    summarize.add_argument("--allow-mixed-code", action="store_true", help=MIXED_CODE_HELP)
    summarize.set_defaults(func=_run_summarize)
    add_overhead_parser(bench_subparsers)
    add_gradient_parser(bench_subparsers)
    return parser


def add_efficiency_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "efficiency",
        help="POISE vs GRPO G=8, DAPO dynamic sampling, RLOO k=2 and GRPO G=2 per completion generated",
        description=EFFICIENCY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS),
                        help="one lacking a config field in this library version is reported, not run")  # fmt: skip
    parser.add_argument("--task", nargs="+", choices=TASKS, default=["sort"],
                        help="offline tasks, one after another in this order (ignored with --model)")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="evaluation seeds")
    parser.add_argument("--task-seeds", nargs="+", type=task_seeds, default=[], metavar="TASK=A-B",
                        help="a task's own evaluation seeds instead of --seeds, e.g. hops=0-9")  # fmt: skip
    parser.add_argument("--tune-lr", action="store_true",
                        help="each contender at the rate with the best median AUC on --tuning-seeds (ablations: POISE "
                        "(paper)'s rate); else every contender at --learning-rate")  # fmt: skip
    parser.add_argument("--lr-grid", nargs="+", type=float, default=list(DEFAULT_LR_GRID),
                        help="rates tried by --tune-lr; a best rate at an edge extends it by x2 that way")  # fmt: skip
    parser.add_argument("--tuning-seeds", nargs="+", type=int, default=list(DEFAULT_TUNING_SEEDS),
                        help="seeds of the tuning runs, disjoint from the evaluation seeds")  # fmt: skip
    parser.add_argument("--max-grid-extensions", type=int, default=MAX_GRID_EXTENSIONS,
                        help="per contender, how often --tune-lr may extend the grid")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs in parallel processes, each with --cpu-threads threads; results do not depend on "
                        "it (default: the usable cores; 1 with --model)")  # fmt: skip
    parser.add_argument("--completions-per-step", type=int, default=32, help="B trained per step, every contender")
    parser.add_argument("--per-device-batch-size", type=int, default=None,
                        help="micro-batch; gradient accumulation keeps B per optimizer step (default: B)")  # fmt: skip
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                        help="completions generated per run: each stops once it has generated this many")  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY,
                        help="held-out avg@k each time this many more completions have been generated")  # fmt: skip
    parser.add_argument("--eval-k", type=int, default=8, help="k of the held-out avg@k")
    parser.add_argument("--eval-seed", type=int, default=0, help="sampling seed of every held-out evaluation")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help=f"every contender's rate without --tune-lr (default: {DEMO_LEARNING_RATE:g} for the "
                        f"demo tasks, {PAPER_LEARNING_RATE:g} with --model)")  # fmt: skip
    parser.add_argument("--epsilon", type=float, default=0.2, help="lower clip range, all contenders")
    parser.add_argument("--epsilon-high", type=float, default=0.28, help="upper clip range, all contenders")
    parser.add_argument(
        "--max-completion-length",
        type=int,
        default=None,
        help="longest completion (default: 12 for the demo task, 2048 with --model)",
    )
    parser.add_argument("--grpo-scale-rewards", choices=["group", "batch", "none"], default="group",
                        help="GRPO and DAPO-DS (GRPO-8 no-scale always uses none)")  # fmt: skip
    parser.add_argument("--dapo-max-rounds", type=int, default=DAPO_MAX_ROUNDS,
                        help="DAPO-DS: most generation batches per step (hitting it logs dapo/capped)")  # fmt: skip
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="all contenders (default: on with --model, off for the tiny demo model)")  # fmt: skip
    parser.add_argument("--output-dir", default="runs/bench/efficiency",
                        help="results directory: runs/TASK/CONTENDER/lrRATE_seedN.json (a re-run skips those that "
                        "exist), tuning, efficiency.json, PNG")  # fmt: skip
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads per run on CPU (0: torch's default)")
    parser.add_argument("--allow-mixed-code", action="store_true", help=MIXED_CODE_HELP)
    demo = parser.add_argument_group("offline demo tasks (used when --model is not given)")
    demo.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-start steps (default: per task)")
    demo.add_argument("--min-digits", type=int, default=TASK_DIGITS["sort"][0], help="sort task only")
    demo.add_argument("--max-digits", type=int, default=TASK_DIGITS["sort"][1], help="sort task only")
    demo.add_argument("--num-eval", type=int, default=140, help="held-out prompts")
    demo.add_argument("--cache-dir", default=None,
                      help="warm-started models (default: $XDG_CACHE_HOME/poise-trl/bench)")  # fmt: skip
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
        help=f"{ARITH_DATASET} (the arith task, held-out split included), or a poise_trl.rlvr.data registry key, "
        "Hub id or local file; required with --model",
    )
    real.add_argument("--train-limit", type=int, default=None, help="first N training rows (default: all)")
    real.add_argument(
        "--eval-dataset", default=None, help="held-out benchmark (registry key, Hub id or file); required with --model"
    )
    real.add_argument("--eval-limit", type=int, default=None, help="first N held-out problems (default: all)")
    real.add_argument("--eval-batch-size", type=int, default=8, help="prompts per generate call in evaluation")
    parser.set_defaults(func=_run_efficiency)
    return parser


def add_overhead_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "overhead",
        help="POISE vs GRPO step time (alternated A B A B) and peak memory; probe fit vs scikit-learn",
        description=OVERHEAD_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--completion-lengths", nargs="+", type=int, default=[16, 128],
                        help="forced completion lengths; each gives a +1-pass and a +0-pass row")  # fmt: skip
    parser.add_argument("--extra-passes", nargs="+", type=int, choices=[1, 0], default=[1, 0],
                        help="rows per length: 1 = POISE runs its own pass, 0 = it reuses TRL's")  # fmt: skip
    parser.add_argument("--group-size", type=int, default=2, help="G, the same for POISE and GRPO")
    parser.add_argument("--completions-per-step", type=int, default=32, help="per optimizer step, both trainers")
    parser.add_argument("--cycles", type=int, default=8, help="timed generation cycles per trainer and row")
    parser.add_argument("--warmup-cycles", type=int, default=2, help="untimed cycles first")
    parser.add_argument("--memory-cycles", type=int, default=3, help="cycles per memory run")
    parser.add_argument("--skip-memory", action="store_true", help="no memory runs")
    parser.add_argument("--skip-probe-fit", action="store_true", help="no probe-fit timing")
    parser.add_argument(
        "--probe-fit-repeats", type=int, default=3, help="timed fits per preset; the median is reported"
    )
    parser.add_argument("--probe-fit-rows", type=int, default=PROBE_FIT_ROWS, help="probe-fit examples (buffer size)")
    parser.add_argument("--probe-fit-hidden", type=int, default=QWEN3_4B_HIDDEN, help="d: features are 2d + 3")
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="both trainers")
    parser.add_argument("--seed", type=int, default=0, help="model init, sampling and data order")
    parser.add_argument("--per-device-batch-size", type=int, default=None,
                        help="micro-batch; accumulation keeps the step's completions (default: all of them; "
                        "--model: e.g. 4)")  # fmt: skip
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="both trainers (default: on with --model, off for the tiny demo model)")  # fmt: skip
    parser.add_argument("--thread-timeout", type=float, default=3600, help="seconds a trainer waits for its turn")
    parser.add_argument("--output-dir", default="runs/bench/overhead", help="overhead.json, run folders, memory logs")
    parser.add_argument("--cache-dir", default=None, help="warm-started demo model (default: OUTPUT_DIR/models)")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU; 0 lets torch choose")
    parser.add_argument("--model", default=None,
                        help=f"Hub id, local path or a real model ({', '.join(REAL_MODELS)}) (default: the demo's "
                        "tiny model)")  # fmt: skip
    parser.add_argument("--train-dataset", default=None,
                        help=f"prompts for --model ({ARITH_DATASET}, registry key, Hub id, file); required with "
                        f"--model (default for a real model: {ARITH_DATASET})")  # fmt: skip
    parser.add_argument("--train-limit", type=int, default=None, help="first N prompts (default: all)")
    parser.add_argument("--prefix", action="store_true",
                        help='also POISE with probe_granularity="prefix" (a value for every token), taking turns with '
                        "POISE and GRPO in every row; its time and peak memory against both")  # fmt: skip
    parser.add_argument("--importance", action="store_true",
                        help='also POISE with prompt_selection="importance", taking turns with the others in every '
                        "row; its time against GRPO and POISE, and the sampler's own seconds per cycle")  # fmt: skip
    parser.set_defaults(func=_run_overhead)
    return parser


def _run_gradient(args: argparse.Namespace) -> int:
    from .gradient import run_gradient

    return run_gradient(args)


def add_gradient_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "gradient",
        help="policy-gradient error per completion at a fixed policy: POISE vs GRPO, RLOO, DAPO",
        description=GRADIENT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_collection_arguments(parser, num_prompts=64, k=16)
    add = parser.add_argument
    add("--contenders", nargs="+", choices=[*GRADIENT_CONTENDERS, *GRADIENT_PREFIX_ROWS],
        default=list(GRADIENT_CONTENDERS), metavar="NAME",
        help=f"any of {', '.join(GRADIENT_CONTENDERS)}; the per-prefix rows {', '.join(GRADIENT_PREFIX_ROWS)} "
        "(a second gradient pass: V(x, y_<t) from a per-prefix probe on the probe pool) only when named")  # fmt: skip
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
    add("--lora-rank", type=int, default=1, help="rank of the LoRA sketch (its B gradients are stored per rollout)")
    add("--output-dir", default="runs/bench/gradient", help="results.json, results.md, gradient.png")
    parser.set_defaults(func=_run_gradient)
    return parser


def _run_probe_bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    from .value.report import run_probe_bench

    return run_probe_bench(args, log)


def add_probe_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `probe-bench` on the CLI's subparsers; its handler is `func` (call `args.func(args)`)."""
    parser = subparsers.add_parser(
        "probe-bench",
        help="will POISE work on my model? probe vs critic value prediction, with the paper's ablations",
        description=PROBE_BENCH_DESCRIPTION,
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
    add("--features", nargs="+", default=None, metavar="BLOCK",
        help="any of prompt, reasoning, entropy, length (default: POISEConfig's)")  # fmt: skip
    add("--preset", choices=("release", "paper"), default=None, help="probe for the sweeps (default: POISEConfig's)")
    add("--test-fraction", type=float, default=0.25, help="share of prompts held out")
    add("--bootstrap", type=int, default=1000, help="bootstrap resamples of held-out prompts for the CIs")
    add("--vr-group-size", type=int, default=2, help="G for the variance-reduction column (POISE uses 2)")
    add("--mlps", default=DEFAULT_MLPS, help="MLP probes, DEPTHxWIDTH comma-separated ('' for none)")
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


def add_collection_arguments(parser: argparse.ArgumentParser, num_prompts: int, k: int) -> None:
    """What `collect_from_args` reads: the model, prompts, reward, sampling and feature capture (probe-bench and
    bench gradient sample their rollouts the same way)."""
    add = parser.add_argument
    add("model", nargs="?", default=DEMO_MODEL,
        help=f"HF model id or path; 'demo': the cached tiny sort model; {', '.join(REAL_MODELS)}: a real model "
        "prepared from its package (dataset: arith)")  # fmt: skip
    add(
        "--dataset",
        default=None,
        help=f"'{SORT_DATASET}' (the demo task), '{ARITH_DATASET}' (arithmetic chat prompts), a poise_trl.rlvr.data "
        f"registry name, Hub id or local .jsonl/.parquet (default: {SORT_DATASET} for the demo, {ARITH_DATASET} for "
        f"a real model, else {DEFAULT_MATH_DATASET})",
    )
    add("--split", default=None, help="dataset split of a Hub id (default: the registry's split, else train)")
    add("--task", choices=TASKS, default=None, help="with the demo model: its offline task (default: sort)")
    add("--reward-fn", default=None, help="MODULE:FUNCTION, a TRL reward (default: the task's or math_answer_reward)")
    add("--num-prompts", type=int, default=num_prompts, help="distinct prompts to sample")
    add("--k", type=int, default=k, help="rollouts per prompt")
    add("--temperature", type=float, default=1.0, help="sampling temperature (POISE training samples at 1.0)")
    add("--top-p", type=float, default=1.0, help="nucleus sampling mass (POISE training samples at 1.0)")
    add(
        "--max-new-tokens",
        type=int,
        default=None,
        help="longest completion (default: the demo task's length, else 8192)",
    )
    add("--backend", choices=("auto", "hf", "vllm"), default="auto", help="auto: vLLM if installed, else HF generate")
    add("--vllm-gpu-memory-utilization", type=float, default=0.5, help="vLLM's share; the HF model needs the rest")
    add("--device", default="auto", help="auto: cuda if available, else cpu")
    add("--batch-size", type=int, default=32, help="prompts per HF generate call (each expanded to K samples)")
    add("--feature-batch-size", type=int, default=64, help="rollouts per teacher-forced pass (use ~4 at 8k tokens)")
    add("--layer", type=int, default=None, help="probe layer (default: POISEConfig's, round(0.53 * num_layers))")
    add("--pool-tokens", type=int, default=None, help="pooling window n (default: POISEConfig's, 10)")
    add("--reasoning-end-marker", default=None, help="'none' for no marker (default: POISEConfig's, </think>)")
    add("--seed", type=int, default=0, help="prompt choice, sampling, split, bootstrap and fits")
    add("--cache-dir", default=None, help="demo model cache (default: $XDG_CACHE_HOME/poise-trl)")

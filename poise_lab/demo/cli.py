"""Parsers of `poise-trl demo` and `poise-trl plot`; each handler imports the demo (TRL, torch) only when it runs."""

import argparse
from typing import Any

from poise_lab.models.real import REAL_MODELS
from poise_lab.tasks.toy import TASKS
from poise_trl.choices import DEFAULT_PRESET, GRANULARITIES, HEADS, PROBE_PRESETS

from .defaults import REAL_DEFAULTS as REAL
from .defaults import TOY_DEFAULTS as TOY
from .settings import DemoSettings

DEFAULT = DemoSettings()  # the parser's defaults are the settings'


def run_demo_command(args: argparse.Namespace) -> int:
    from .run import run_demo

    run_demo(DemoSettings.from_args(args))
    return 0


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="train the tiny model with POISE on digit sorting (CPU, about a minute), or a real model on arith",
        description="Warm-start a tiny Qwen3 on sorting 2-8 digits (or, with --model, prepare a real pretrained "
        "model for the arith task), measure held-out avg@k, train it with POISETrainer while printing the probe's "
        "diagnostics, measure again, and write a training-dynamics plot and summary.json.",
    )
    parser.add_argument("--output-dir", default=DEFAULT.output_dir, help="where the plot, summary and final model go")
    parser.add_argument(
        "--model",
        default=DEFAULT.model,
        help=f"a real model ({', '.join(REAL_MODELS)}) or a model folder, trained on arith "
        "(default: the tiny Qwen3 on --task)",
    )
    parser.add_argument(
        "--task",
        choices=TASKS,
        default=DEFAULT.task,
        help="sort: k digits (difficulty = length); hops: pointer chasing (one length)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT.steps,
        help=f"POISE training steps (default: {TOY.steps}; real model: {REAL.steps})",
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT.seed, help="seed of the task split, model init and training"
    )
    parser.add_argument("--min-digits", type=int, default=DEFAULT.min_digits, help="easiest sort prompts")
    parser.add_argument("--max-digits", type=int, default=DEFAULT.max_digits, help="hardest sort prompts (<= 9)")
    parser.add_argument("--task-size", type=int, default=DEFAULT.num_train, help="training prompts")
    parser.add_argument(
        "--eval-size",
        type=int,
        default=DEFAULT.num_eval,
        help=f"held-out prompts, never seen in training (default: {TOY.num_eval}; real model: {REAL.num_eval})",
    )
    parser.add_argument("--eval-k", type=int, default=DEFAULT.eval_k, help="samples per held-out prompt for avg@k")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT.warmup_steps, help="supervised warm-start steps")
    parser.add_argument("--warmup-lr", type=float, default=DEFAULT.warmup_lr, help="warm-start learning rate")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=DEFAULT.learning_rate,
        help=f"POISE learning rate (default: {TOY.learning_rate:g}; real model: {REAL.learning_rate:g})",
    )
    parser.add_argument("--num-generations", type=int, default=DEFAULT.num_generations, help="rollouts per prompt (G)")
    parser.add_argument(
        "--prompts-per-step",
        type=int,
        default=DEFAULT.prompts_per_step,
        help=f"prompts per optimisation step (default: {TOY.prompts_per_step}; real model: {REAL.prompts_per_step})",
    )
    parser.add_argument(
        "--probe-warmup-steps",
        type=int,
        default=DEFAULT.probe_warmup_steps,
        help=f"bootstrap steps before the probe (default: {TOY.probe_warmup_steps}; real model: "
        f"{REAL.probe_warmup_steps})",
    )
    parser.add_argument(
        "--probe-preset",
        choices=list(PROBE_PRESETS),
        default=DEFAULT.probe_preset,
        help=f"the whole probe setup (POISEConfig.probe_preset; default: {DEFAULT_PRESET} with the demo's "
        "--probe-warmup-steps); a named preset keeps its own bootstrap length unless --probe-warmup-steps is given",
    )
    parser.add_argument(
        "--paper-rules",
        action="store_true",
        help="the paper's probe input g(φ) and RLOO bootstrap instead of the library's partner-aware probe and shrunk "
        "bootstrap",
    )
    parser.add_argument(
        "--probe-granularity",
        choices=list(GRANULARITIES),
        default=DEFAULT.probe_granularity,
        help="one baseline per rollout, or per token from the prefix (docs: the per-prefix baseline)",
    )
    parser.add_argument(
        "--probe-head",
        choices=list(HEADS),
        default=DEFAULT.probe_head,
        help="the probe's value head (POISEConfig.probe_head; default: its default)",
    )
    parser.add_argument(
        "--probe-history",
        action="store_true",
        help="each prompt's earlier rewards as probe inputs (POISEConfig.probe_history); worth it when prompts "
        "repeat: lower --task-size so each is drawn more than once",
    )
    parser.add_argument(
        "--logging-steps",
        type=int,
        default=DEFAULT.logging_steps,
        help=f"steps per table row / plot point (default: {TOY.logging_steps}; real model: {REAL.logging_steps})",
    )
    parser.add_argument(
        "--cache-dir", default=DEFAULT.cache_dir, help="warm-started model cache (default: $XDG_CACHE_HOME/poise-trl)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    parser.set_defaults(func=run_demo_command)
    return parser


def run_plot_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .plots import load_log_history, plot_training_dynamics

    output = args.output or Path(args.run_dir) / "training_dynamics.png"
    print(plot_training_dynamics(load_log_history(args.run_dir), output, title=args.title))
    return 0


def add_plot_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plot",
        help="plot a run's training dynamics (reward, value, entropy, MAE, variance reduction)",
        description="Read RUN_DIR/trainer_state.json (or the newest checkpoint-*/trainer_state.json) and write the "
        "paper's training-dynamics panels as a PNG.",
    )
    parser.add_argument("run_dir", help="a trainer's output_dir (or a folder with its checkpoint-* folders)")
    parser.add_argument("--output", default=None, help="PNG path (default: RUN_DIR/training_dynamics.png)")
    parser.add_argument("--title", default=None, help="figure title (default: none)")
    parser.set_defaults(func=run_plot_command)
    return parser

"""`poise-trl bench`: training efficiency (POISE vs GRPO vs RLOO at an equal completion budget) and overhead.

This module holds the CLI (both parsers and what each benchmark measures, in their `--help`) and what both share:
device settings, seed statistics, the text table and the JSON writer. It imports neither trl nor the trainer: the
handlers import `bench_efficiency` / `bench_overhead` when they run, so building the CLI stays light.
"""

import argparse
import json
import math
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EFFICIENCY_DESCRIPTION = """Sample efficiency of POISE, GRPO and RLOO at an equal completion budget.

Every contender spends the same B completions per optimizer step (paper §2.3: at a fixed budget, fewer rollouts
per prompt means more distinct prompts and a lower-variance gradient):

    POISE  G=2, B/2 prompts   (POISETrainer)
    GRPO   G=8, B/8 prompts   (trl.GRPOTrainer, the reference of every ratio)
    RLOO   k=2, B/2 prompts   (trl.RLOOTrainer)
    GRPO   G=2, B/2 prompts   (trl.GRPOTrainer)

Shared by all: the model and its warm start (per seed), the data-order seed, learning rate, clip range
(0.2/0.28), max completion length, temperature 1, no KL, one optimizer step per generation, and the held-out
evaluator (its own sampling seed, so every contender starts from the same measured accuracy). GRPO and POISE use
token-mean aggregation (`loss_type="dapo"`); TRL's RLOOTrainer has no `loss_type` and always uses a sequence-level
ratio with a per-sequence mean, the one difference that cannot be set away. GRPO keeps TRL's own reward scaling
(`--grpo-scale-rewards`, default "group"); POISE's advantage is the unscaled `r - b` of the paper.

Per contender, median [min, max] over seeds: held-out avg@k every `--eval-every` steps, the completions spent
until it first gains `--target-fraction` of GRPO-8's median gain over the seed's start (linearly interpolated
between evaluations; the JSON repeats it for 0.5, 0.75 and 0.9), the final accuracy (also paired by seed against
GRPO-8), the mean gradient norm before clipping, and the fraction of prompts whose advantages are all zero.

Offline default: the demo sort-digits task (`poise_trl.tasks`) on the tiny model, warm-started longer than the
demo so that about a quarter of held-out prompts start all-correct or all-wrong at 8 samples. With `--model`,
`--train-dataset` and `--eval-dataset` the same command trains a real model on a math dataset, one process on one
GPU (the runs are sequential).
"""

OVERHEAD_DESCRIPTION = """POISE's per-step time and peak memory against plain GRPO, and the probe fit's cost.

Time. POISETrainer and trl.GRPOTrainer, built from the same model with the same G, completions per step, max
length and loss, train in two threads that take turns: A B A B, one generation cycle each, so machine load hits
both alike; the ratio is taken pair by pair. Completions are forced to exactly `--completion-lengths` tokens
(`min_new_tokens`) and scored by a reward that accepts any text, so both do the same work; at 128 tokens or more
generation dominates the step, as it does at real scale. Each length has two rows:
  - "+1 pass": TRL runs no old-log-prob pass (one optimizer step per generation), so POISE runs one no-grad
    teacher-forced pass of its own;
  - "+0 pass": two optimizer steps per generation (`steps_per_generation=2`), so TRL computes old log-probs and
    POISE captures its features inside that pass.
A cycle is one generation and its optimizer steps. POISE's probe buffer is filled to capacity after the first
cycle, so every timed step pays the steady-state refit on a full buffer. The first `--warmup-cycles` cycles are
not timed. Both trainers are held at once: with `--model` on one GPU, pick a model for which two fit.

Memory. Each contender runs every row in a fresh process of its own, one trainer at a time after one warm-up
cycle: the peak is `torch.cuda.max_memory_allocated` on a GPU and the peak resident set on a CPU (Linux VmHWM,
reset once the trainer is built; glibc is told to return freed blocks of 64 KiB or more to the OS, so the resident
set tracks live tensors), each above the memory held when training starts.

Probe fit. The value probe on 4096 x (2*2560 + 3) features, the Qwen3-4B size, against scikit-learn's
StandardScaler (+ per-block PCA) + Ridge on the same data with the same thread count, for the paper and release
presets, predictions compared; also on the GPU when there is one.
"""

# The demo warm start (100 steps) leaves almost no all-correct groups at G=8; 150 steps give ~13% all-correct and
# ~14% all-wrong held-out prompts at avg@8 ~ 0.5, with room left to learn (measured on seed 0).
BENCH_WARMUP_STEPS = 150
# On the warm-started sort model 3e-4 (DESIGN §4's rate for max(a, b)) collapses every contender within 10 steps and
# 1e-4 destabilises GRPO G=8; 5e-5 learns steadily for 100+ steps (seeds 0-1).
DEMO_LEARNING_RATE = 5e-5
PAPER_LEARNING_RATE = 1e-6  # paper Table 4, for real models
QWEN3_4B_HIDDEN = 2560
PROBE_FIT_ROWS = 4096


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    algorithm: str  # "poise" | "grpo" | "rloo"
    group_size: int


CONTENDERS = {
    c.name: c
    for c in (
        Contender("poise", "POISE G=2", "poise", 2),
        Contender("grpo8", "GRPO G=8", "grpo", 8),
        Contender("rloo2", "RLOO k=2", "rloo", 2),
        Contender("grpo2", "GRPO G=2", "grpo", 2),
    )
}
REFERENCE = "grpo8"  # every ratio is against it


def device_kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def trainer_device_args(gradient_checkpointing: bool = False) -> dict[str, Any]:
    """TRL settings every benchmark run shares. On CPU, GRPOConfig's default `bf16=True` would fail (DESIGN §4)."""
    args: dict[str, Any] = dict(
        gradient_checkpointing=gradient_checkpointing,
        report_to="none",
        save_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        logging_steps=1,
    )
    if device_kind() == "cpu":
        args.update(use_cpu=True, bf16=False)
    return args


def set_cpu_threads(threads: int) -> None:
    """Pin torch's intra-op threads on CPU.

    The tiny model's ops are too small to gain from threads, and on a shared 2-core machine two OpenMP threads per
    process fighting other jobs made a held-out evaluation 3-8x slower and far noisier than one thread.
    """
    if device_kind() == "cpu" and threads > 0:
        torch.set_num_threads(threads)


def quiet_libraries() -> None:
    """Weight-loading and dataset progress bars and library chatter would drown the benchmark's own output."""
    import datasets
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    datasets.disable_progress_bars()


def environment() -> dict[str, Any]:
    """What the numbers were measured on, written into every JSON."""
    import transformers
    import trl

    info: dict[str, Any] = {
        "device": device_kind(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def spread(values: Iterable[float | None]) -> dict[str, Any]:
    """Median, min and max over seeds. None (e.g. a target never reached) counts as +inf and is reported as None."""
    finite = [math.inf if v is None else float(v) for v in values]
    if not finite:
        return {"median": None, "min": None, "max": None, "n": 0}
    ordered = sorted(finite)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {
        "median": None if not math.isfinite(median) else median,
        "min": None if not math.isfinite(ordered[0]) else ordered[0],
        "max": None if not math.isfinite(ordered[-1]) else ordered[-1],
        "n": len(ordered),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_spread(stats: dict[str, Any], digits: int = 3) -> str:
    """`median [min, max]`; a never-reached median prints as `never`."""
    if stats["n"] == 0:
        return "–"
    median = fmt(stats["median"], digits) if stats["median"] is not None else "never"
    low, high = (fmt(stats[k], digits) if stats[k] is not None else "never" for k in ("min", "max"))
    return median if stats["n"] == 1 else f"{median} [{low}, {high}]"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table (pastes into the README as is)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def _run_efficiency(args: argparse.Namespace) -> int:
    from .bench_efficiency import run_efficiency

    return run_efficiency(args)


def _run_overhead(args: argparse.Namespace) -> int:
    from .bench_overhead import run_overhead

    return run_overhead(args)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` with its `efficiency` and `overhead` subcommands; each stores its handler as `func`."""
    parser = subparsers.add_parser(
        "bench",
        help="training-efficiency and overhead benchmarks (POISE vs GRPO vs RLOO)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_subparsers = parser.add_subparsers(dest="bench_command", required=True, metavar="{efficiency,overhead}")
    add_efficiency_parser(bench_subparsers)
    add_overhead_parser(bench_subparsers)
    return parser


def add_efficiency_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "efficiency",
        help="POISE vs GRPO G=8 vs RLOO k=2 vs GRPO G=2 at an equal number of completions per step",
        description=EFFICIENCY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="one run per seed and contender")
    parser.add_argument("--completions-per-step", type=int, default=32, help="B, the same for every contender")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out avg@k every N steps")
    parser.add_argument("--eval-k", type=int, default=8, help="k of the held-out avg@k")
    parser.add_argument("--eval-seed", type=int, default=0, help="sampling seed of every held-out evaluation")
    parser.add_argument("--learning-rate", type=float, default=None, help=f"default {DEMO_LEARNING_RATE} (demo), "
                        f"{PAPER_LEARNING_RATE} (--model)")  # fmt: skip
    parser.add_argument("--epsilon", type=float, default=0.2, help="lower clip range, all contenders")
    parser.add_argument("--epsilon-high", type=float, default=0.28, help="upper clip range, all contenders")
    parser.add_argument("--max-completion-length", type=int, default=None, help="default: demo 12, --model 2048")
    parser.add_argument("--target-fraction", type=float, default=0.75,
                        help="'completions to target' counts until avg@k >= the seed's start + this fraction of "
                        "GRPO-8's median gain (past POISE's 16-step bootstrap at the defaults)")  # fmt: skip
    parser.add_argument("--target-gain", type=float, default=None, help="an absolute gain instead of the fraction")
    parser.add_argument("--grpo-scale-rewards", choices=["group", "batch", "none"], default="group")
    parser.add_argument("--probe-preset", choices=["release", "paper"], default="release", help="POISE's probe")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="all contenders (real models)")
    parser.add_argument("--output-dir", default="runs/bench/efficiency", help="JSON, PNG and run folders")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    demo = parser.add_argument_group("offline demo task (used when --model is not given)")
    demo.add_argument("--warmup-steps", type=int, default=BENCH_WARMUP_STEPS, help="supervised warm-start steps")
    demo.add_argument("--min-digits", type=int, default=2)
    demo.add_argument("--max-digits", type=int, default=8)
    demo.add_argument("--num-eval", type=int, default=140, help="held-out prompts")
    demo.add_argument("--cache-dir", default=None, help="warm-started models; default OUTPUT_DIR/models")
    real = parser.add_argument_group("real model and dataset (a GPU in practice)")
    real.add_argument("--model", default=None, help="Hub id or local path; every contender starts from it")
    real.add_argument("--train-dataset", default=None, help="poise_trl.data registry key, Hub id or local file")
    real.add_argument("--train-limit", type=int, default=None, help="first N training rows")
    real.add_argument("--eval-dataset", default=None, help="held-out benchmark (registry key, Hub id or file)")
    real.add_argument("--eval-limit", type=int, default=None, help="first N held-out problems")
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
    parser.add_argument("--probe-fit-repeats", type=int, default=3)
    parser.add_argument("--probe-fit-rows", type=int, default=PROBE_FIT_ROWS, help="probe-fit examples (buffer size)")
    parser.add_argument("--probe-fit-hidden", type=int, default=QWEN3_4B_HIDDEN, help="d: features are 2d + 3")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient-checkpointing", action="store_true", help="both trainers (real models)")
    parser.add_argument("--thread-timeout", type=float, default=3600, help="seconds a trainer waits for its turn")
    parser.add_argument("--output-dir", default="runs/bench/overhead")
    parser.add_argument("--cache-dir", default=None, help="warm-started demo model; default OUTPUT_DIR/models")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--model", default=None, help="Hub id or local path (default: the demo's tiny model)")
    parser.add_argument("--train-dataset", default=None, help="prompts for --model (registry key, Hub id, file)")
    parser.add_argument("--train-limit", type=int, default=None)
    parser.set_defaults(func=_run_overhead)
    return parser

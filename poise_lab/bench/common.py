"""What the benchmarks share: defaults, device settings, seed statistics, the table and JSON writers (the efficiency
study's contenders are `bench.contenders`).

It imports no torch at module level (only inside the device helpers), so `poise_lab.bench.cli` can read its
defaults and `poise-trl --help` stays light.
"""

import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from poise_lab.tasks.arith import ARITH_DATASET  # noqa: F401 (re-exported with TASKS: the CLI reads them here)
from poise_lab.tasks.toy import TASKS  # noqa: F401 (re-exported: the CLI reads the task names here, light)

# The efficiency task must leave many G=8 groups tied at the start, or DAPO's dynamic sampling has nothing to do and
# POISE's answer to degenerate groups is not tested (issue #13 asks for >= 25%), and must not saturate. Sorting 2-8
# digits after 150 warm-up steps left 20-30% of training prompts tied at 8 samples (24% of GRPO-8's groups in a
# 3-seed run); 2-9 digits after 200 steps leaves 36-40% tied at avg@8 0.53-0.67 (seeds 0-1, 200 training prompts).
BENCH_WARMUP_STEPS = 200
BENCH_MAX_DIGITS = 9
# On the warm-started sort model 3e-4 (DESIGN §4's rate for max(a, b)) collapses every contender within 10 steps and
# 1e-4 destabilises GRPO G=8; 5e-5 learns steadily for 100+ steps (seeds 0-1).
DEMO_LEARNING_RATE = 5e-5
PAPER_LEARNING_RATE = 1e-6  # paper Table 4, for real models
QWEN3_4B_HIDDEN = 2560
# `bench overhead` rows: one optimizer step per generation (TRL's default: no log-prob pass), or two (TRL's pass)
OVERHEAD_LAYOUTS = ("default", "trl-pass")
PROBE_FIT_ROWS = 4096
# probe-bench: the model and dataset names that mean "the offline demo", and its sweep defaults.
DEMO_MODEL = "demo"
SORT_DATASET = "sort"
ARITH_EVAL_PROMPTS = 96  # held-out arith prompts of `bench efficiency` (24 per default family)
DEFAULT_MATH_DATASET = "DAPO-Math-17k-en"
DEFAULT_POOLS = (5, 10, 15)
# Depth x width, a CPU-sized slice of paper Table 10's grid (3x512 alone costs ~40 s on 2 cores for 2k rows); on a
# GPU machine pass the paper's "1x512,3x512,5x512,7x512,9x512,3x1024,5x1024".
DEFAULT_MLPS = "1x128,3x128,1x512,3x512"
DEFAULT_SEEDS = tuple(range(20))
DEFAULT_TUNING_SEEDS = (1000, 1001, 1002)  # disjoint from any evaluation seed the defaults use
DEFAULT_LR_GRID = (2.5e-5, 5e-5, 1e-4)
MAX_GRID_EXTENSIONS = 3
ALPHA = 0.05  # a verdict is "wins" or "loses" only where the Holm-corrected p-value is below it
DEFAULT_BUDGET = 3200  # completions generated per run: 100 steps of 32 for the methods that generate B per step
DEFAULT_EVAL_EVERY = 320  # completions generated between held-out evaluations, the same grid for every contender
# Supervised warm-up steps per offline task: each leaves >= 25% of G=8 groups tied at start avg@8 within 0.3-0.7.
TASK_WARMUP_STEPS = {"sort": 200, "hops": 200}
TASK_DIGITS = {"sort": (2, 9)}  # the sort task's digit range in the bench (hops has one length)
DAPO_MAX_ROUNDS = 8  # DAPO's recipe caps dynamic sampling at a few generation batches per step (max_num_gen_batches)


def smallest_p_holm(seeds: int, tests: int) -> float:
    """The smallest Holm-corrected p-value any comparison over `seeds` paired seeds can reach among `tests` tests:
    Wilcoxon's exact two-sided p is at least 2 / 2^seeds (every seed on one side), and Holm multiplies the smallest
    p by the number of tests. At or above ALPHA, no verdict can be decided, whatever the runs show."""
    return min(1.0, tests * 2.0 ** (1 - seeds))


def device_kind() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(name: str) -> str:
    """`--device auto`: cuda if available, else cpu; any other name as given."""
    return name if name != "auto" else device_kind()


def config_default(name: str) -> Any:
    """A `POISEConfig` field's default, so a benchmark measures what the trainer would run: for a field the preset
    sets (default None), the default preset's value."""
    from poise_trl.choices import DEFAULT_PRESET, PROBE_PRESETS
    from poise_trl.grpo.config import POISEConfig
    from poise_trl.presets import preset_value

    field = POISEConfig.__dataclass_fields__[name]
    default = field.default_factory() if callable(field.default_factory) else field.default
    if default is None and name in PROBE_PRESETS[DEFAULT_PRESET].settings:
        return preset_value(name)
    return default


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
    import torch

    if device_kind() == "cpu" and threads > 0:
        torch.set_num_threads(threads)


def quiet_libraries() -> None:
    """Weight-loading and dataset progress bars and library chatter would drown the benchmark's own output."""
    import datasets
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    datasets.disable_progress_bars()


def code_version() -> dict[str, str | None]:
    """The poise-trl version and, from a git checkout, its commit (suffixed "+dirty" when the files of the library or
    of the lab differ from it), so a report can tell runs of different code apart."""
    import subprocess

    import poise_lab
    import poise_trl

    packages = [str(Path(package.__file__).resolve().parent) for package in (poise_trl, poise_lab)]
    try:
        git = ["git", "-C", packages[0]]
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        status = [*git, "status", "--porcelain", "--", *packages]
        dirty = subprocess.run(status, capture_output=True, text=True, check=True)
        commit += "+dirty" if dirty.stdout.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"version": poise_trl.__version__, "commit": commit}


def environment() -> dict[str, Any]:
    """What the numbers were measured on, and by which code, written into every JSON."""
    import torch
    import transformers
    import trl

    info: dict[str, Any] = {
        "code": code_version(),
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


def summarize(values: Iterable[float | None]) -> dict[str, Any]:
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


def fmt_summary(stats: dict[str, Any], digits: int = 3) -> str:
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


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def default_jobs() -> int:
    """Processes for independent runs: the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# What every run counts (cumulative), the compute columns of the table.
COUNTERS = (
    "completions_generated",
    "completions_trained",
    "tokens_generated",
    "prefill_tokens",
    "forward_rows",
)


def mean_or_none(values: Iterable[float | None]) -> float | None:
    """The mean of the values that exist (a metric a step did not log is None); None if none does."""
    finite = [v for v in values if v is not None]
    return sum(finite) / len(finite) if finite else None


def other_heads(names: Sequence[str] | None) -> list[str]:
    """`--probe-heads` of `bench gradient` and `probe-bench`: the value heads measured beside POISE (default)'s,
    validated (None: every other head of `heads.HEADS`)."""
    from poise_trl.heads.heads import HEADS

    default = config_default("probe_head")  # the preset row's head
    names = [head for head in HEADS if head != default] if names is None else list(names)
    if unknown := sorted(set(names) - set(HEADS)):
        raise SystemExit(f"--probe-heads {' '.join(unknown)}: not a value head; choose among {', '.join(HEADS)}")
    return [head for head in names if head != default]

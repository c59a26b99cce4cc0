"""POISE's per-step time and peak memory against plain GRPO, and the probe fit's cost.

Time. POISETrainer and trl.GRPOTrainer, built from the same model with the same G, completions per step, max
length and loss, train in threads that take turns, one generation cycle each, in rounds whose order reverses each
time (A B, B A, A B, ...), so machine load and its drift hit them alike; the ratio is taken pair by pair, and
also split by which of POISE and GRPO went first in the round (`time_ratio_by_order`; apart, the two halves show a
drift between turns that the alternation cancels).
Completions are forced to exactly `--completion-lengths` tokens (`min_new_tokens`) and scored by a reward that
accepts any text, so both do the same work; at 128 tokens or more generation dominates the step, as it does at real
scale. Each length has two rows (`--layouts`):
  - "TRL default": one optimizer step per generation, TRL's default configuration: TRL runs no old-log-prob pass,
    and POISE reads its features from the loss's own forward (each micro-batch holds whole groups), adding none;
  - "TRL pass": two optimizer steps per generation (`steps_per_generation` twice the accumulation steps), so TRL
    computes old log-probs and POISE captures its features inside that pass.
  - `--capture-route`: a trainer more, POISE with probe_capture="pass" (a no-grad teacher-forced pass of its own
    where TRL runs none: the route before the loss's forward served), takes its turn in every row; its time against
    GRPO, POISE (default)'s against it, and its passes per cycle.
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
presets, predictions compared; also on the GPU when there is one. Each other value head (`probe_head`: logistic,
mlp, ensemble; `--probe-fit-heads`) is timed beside ridge with each preset's alpha and PCA, as a ratio to ridge's fit.
"""

import argparse
from typing import Any

from poise_lab.models.real import REAL_MODELS

from ..common import ARITH_DATASET, OVERHEAD_LAYOUTS, PROBE_FIT_ROWS, QWEN3_4B_HIDDEN


def _run_overhead(args: argparse.Namespace) -> int:
    from ..overhead import run_overhead

    return run_overhead(args)


def add_overhead_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "overhead",
        help="POISE vs GRPO step time (alternated A B, B A, ...) and peak memory; probe fit vs scikit-learn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--completion-lengths",
        nargs="+",
        type=int,
        default=[16, 128],
        help="forced completion lengths; each gives a +1-pass and a +0-pass row",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=list(OVERHEAD_LAYOUTS),
        default=list(OVERHEAD_LAYOUTS),
        help="rows per length: default = one optimizer step per generation (TRL runs no log-prob pass), trl-pass = "
        "two (TRL runs its old-log-prob pass)",
    )
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
    parser.add_argument(
        "--probe-fit-heads",
        nargs="*",
        default=None,
        help="value heads (probe_head) timed against ridge's fit with each preset (default: all; none: no rows)",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="both trainers")
    parser.add_argument("--seed", type=int, default=0, help="model init, sampling and data order")
    parser.add_argument(
        "--per-device-batch-size",
        type=int,
        default=None,
        help="micro-batch; accumulation keeps the step's completions (default: all of them; --model: e.g. 4)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="both trainers (default: on with --model, off for the tiny demo model)",
    )
    parser.add_argument("--thread-timeout", type=float, default=3600, help="seconds a trainer waits for its turn")
    parser.add_argument("--output-dir", default="runs/bench/overhead", help="overhead.json, run folders, memory logs")
    parser.add_argument("--cache-dir", default=None, help="warm-started demo model (default: OUTPUT_DIR/models)")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU; 0 lets torch choose")
    parser.add_argument(
        "--model",
        default=None,
        help=f"Hub id, local path or a real model ({', '.join(REAL_MODELS)}) (default: the demo's tiny model)",
    )
    parser.add_argument(
        "--train-dataset",
        default=None,
        help=f"prompts for --model ({ARITH_DATASET}, registry key, Hub id, file); required with "
        f"--model (default for a real model: {ARITH_DATASET})",
    )
    parser.add_argument("--train-limit", type=int, default=None, help="first N prompts (default: all)")
    parser.add_argument(
        "--prefix",
        action="store_true",
        help='also POISE with probe_granularity="prefix" (a value for every token), taking turns with '
        "POISE and GRPO in every row; its time and peak memory against both",
    )
    parser.add_argument(
        "--capture-route",
        action="store_true",
        help='also POISE with probe_capture="pass" (a no-grad pass of its own), taking turns with the others in '
        "every row; its time against GRPO and POISE (default)'s against it",
    )
    parser.add_argument(
        "--importance",
        action="store_true",
        help='also POISE with prompt_selection="importance", taking turns with the others in every row; its time '
        "against GRPO and POISE, and the sampler's own seconds per cycle",
    )
    parser.set_defaults(func=_run_overhead)
    return parser

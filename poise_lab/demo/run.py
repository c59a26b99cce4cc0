"""`poise-trl demo`: POISE end to end on CPU, with the tiny model on a toy task (minutes) or a real model on `arith`.

Model (the tiny one warm-started and cached, or a real one prepared from its package) → held-out avg@k →
POISETrainer with a per-step table of the probe's diagnostics → held-out avg@k again → `training_dynamics.png`,
`summary.json`, `trainer_state.json` and the final model in the output dir.
"""

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from poise_lab.models.real import is_real_model, prepare_real_model
from poise_lab.models.toy import default_cache_dir, evaluate_avg_at_k, load_demo_model, prepare_demo_model
from poise_lab.tasks.arith import ARITH_MAX_COMPLETION_LENGTH, DEFAULT_FAMILIES, arith_reward, make_arith_splits
from poise_lab.tasks.toy import HOPS_MAX, MAX_COMPLETION_LENGTH, make_splits, task_reward
from poise_trl.grpo.config import POISEConfig
from poise_trl.grpo.resume import ESTIMATOR_FILE
from poise_trl.grpo.trainer import POISETrainer

from .plots import plot_training_dynamics
from .settings import DemoSettings

# (log key, column header, format): the per-step table, one row per logging window.
TABLE_COLUMNS = (
    ("reward", "reward", "{:.3f}"),
    ("poise/value_mean", "value", "{:.3f}"),
    ("poise/mae", "MAE", "{:.3f}"),
    ("poise/variance_reduction", "var.red", "{:+.3f}"),
    ("poise/variance_reduction_bound", "bound", "{:+.3f}"),
    ("poise/pearson_r", "r", "{:+.3f}"),
    ("entropy", "entropy", "{:.3f}"),
)
COLUMN_WIDTH = 8
SUMMARY_FILE = "summary.json"
TRAIN_DIR = "train"  # the training split (`Dataset.save_to_disk`): `bench gradient --dataset` reads its prompts
PLOT_FILE = "training_dynamics.png"


def _cell(value: Any, fmt: str) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value):
        return "–".rjust(COLUMN_WIDTH)
    return fmt.format(value).rjust(COLUMN_WIDTH)


class DemoTableCallback(TrainerCallback):
    """A progress bar plus one compact row per logging window, instead of TRL's full log dicts.

    The bootstrap column reads "RLOO" while the baseline is still the leave-one-out reward mean (probe not trusted
    yet), "probe" once the probe's predictions are used, and "mixed" for a window that straddles the switch.
    """

    def __init__(self, write: Callable[[str], None] = tqdm.write, show_progress: bool = True):
        self.write = write
        self.show_progress = show_progress
        self.bar: tqdm | None = None
        self.last_time: float | None = None
        self.last_step = 0

    def header(self) -> str:
        cells = ["step".rjust(6)] + [title.rjust(COLUMN_WIDTH) for _, title, _ in TABLE_COLUMNS]
        return " ".join(cells + ["baseline".rjust(9), "s/step".rjust(7)])

    def on_train_begin(self, args, state, control, **kwargs):
        if self.show_progress:
            self.bar = tqdm(total=state.max_steps, desc="POISE", unit="step", dynamic_ncols=True, leave=False)
        self.write(self.header())
        self.last_time, self.last_step = time.perf_counter(), state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" not in logs:  # the end-of-training summary log (train_runtime, ...) is not a step row
            return
        now = time.perf_counter()
        seconds = (now - self.last_time) / max(1, state.global_step - self.last_step)
        self.last_time, self.last_step = now, state.global_step
        boot = logs.get("poise/bootstrap")
        baseline = "–" if boot is None else "RLOO" if boot >= 1 else "probe" if boot <= 0 else "mixed"
        cells = [str(state.global_step).rjust(6)] + [_cell(logs.get(key), fmt) for key, _, fmt in TABLE_COLUMNS]
        self.write(" ".join(cells + [baseline.rjust(9), f"{seconds:7.2f}"]))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclass
class DemoTask:
    """The model folder and the data a demo run trains and evaluates on."""

    model_dir: Path
    train: Any
    held_out: Any
    reward: Callable[..., list[float]]
    max_completion_length: int
    name: str
    model_label: str


def _toy_task(task: str, seed: int, num_train: int, num_eval: int, cache_dir: Path, warm_start: dict[str, Any]):
    model_dir = prepare_demo_model(
        cache_dir, seed=seed, num_train=num_train, num_eval=num_eval, task=task, **warm_start
    )
    train, held_out = make_splits(task, num_train, num_eval, seed, warm_start["min_digits"], warm_start["max_digits"])
    name = (
        f"sort {warm_start['min_digits']}-{warm_start['max_digits']} digits"
        if task == "sort"
        else f"{task} (0-{HOPS_MAX} hops)"
    )
    return DemoTask(model_dir, train, held_out, task_reward, MAX_COMPLETION_LENGTH, name, "tiny Qwen3")


def _real_task(model: str, seed: int, num_train: int, num_eval: int, cache_dir: Path | None, write) -> DemoTask:
    """A real model's name is prepared from its package (cached under `cache_dir/real`); a folder is used as is."""
    if is_real_model(model):
        model_dir = prepare_real_model(model, None if cache_dir is None else Path(cache_dir) / "real", log=write)
    else:
        model_dir = Path(model)
    train, held_out = make_arith_splits(num_train, num_eval, seed)
    name = f"arith ({', '.join(DEFAULT_FAMILIES)})"
    return DemoTask(model_dir, train, held_out, arith_reward, ARITH_MAX_COMPLETION_LENGTH, name, model)


# The per-prefix probe's held-out share of the reward variance, overall and by quarter of the completion.
PREFIX_KEYS = ("poise/prefix/variance_explained", *(f"poise/prefix/variance_explained/q{q}" for q in range(1, 5)))


def _window_mean(log_history: list[dict[str, Any]], key: str, last: int) -> float | None:
    """Mean of a metric over the last `last` logging windows that have it (the end-of-run level, less noisy)."""
    values = [e[key] for e in log_history if isinstance(e.get(key), int | float) and math.isfinite(e[key])]
    return sum(values[-last:]) / len(values[-last:]) if values else None


def run_demo(settings: DemoSettings, write: Callable[[str], None] = tqdm.write) -> dict[str, Any]:
    """Run the demo and return the summary that is also written to `settings.output_dir/summary.json`; `write`
    prints each line of the run's report.

    Without `settings.model`, the tiny Qwen3 is warm-started on `settings.task` ("sort" or "hops"). With a model (a
    real model's name such as "smollm2-135m", or a model folder), that model trains on `arith` and the task is
    ignored. Settings left at None take `TOY_DEFAULTS` or `REAL_DEFAULTS`.
    """
    start = time.perf_counter()
    settings = settings.resolved()
    output_dir = Path(settings.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    seed, eval_k = settings.seed, settings.eval_k
    torch.manual_seed(seed)

    if settings.model is None:
        cache = Path(settings.cache_dir or default_cache_dir())
        write(f"[1/4] warm-start model (cache: {cache})")
        warm_start = dict(
            warmup_steps=settings.warmup_steps,
            warmup_lr=settings.warmup_lr,
            min_digits=settings.min_digits,
            max_digits=settings.max_digits,
        )
        demo = _toy_task(settings.task, seed, settings.num_train, settings.num_eval, cache, warm_start)
    else:
        write(f"[1/4] real model {settings.model}")
        demo = _real_task(settings.model, seed, settings.num_train, settings.num_eval, settings.cache_dir, write)
    policy, tokenizer = load_demo_model(demo.model_dir)
    demo.train.save_to_disk(str(output_dir / TRAIN_DIR))

    def evaluate(trained: Any) -> dict[str, Any]:
        return evaluate_avg_at_k(
            trained,
            tokenizer,
            demo.held_out,
            k=eval_k,
            seed=seed,
            reward=demo.reward,
            max_new_tokens=demo.max_completion_length,
        )

    write(f"[2/4] held-out avg@{eval_k} before RL ({len(demo.held_out)} prompts, {demo.name})")
    before = evaluate(policy)
    write(f"      avg@{eval_k} = {before['avg_at_k']:.3f}  by difficulty: {_by_difficulty(before)}")

    config = POISEConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,  # transformers 5 name of gradient_checkpointing (TRL defaults it on)
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        seed=seed,
        max_steps=settings.steps,
        learning_rate=settings.learning_rate,
        num_generations=settings.num_generations,
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        max_completion_length=demo.max_completion_length,
        logging_steps=settings.logging_steps,
        # None (a named preset's, unless the caller set it): the preset's bootstrap length
        **({"probe_warmup_steps": settings.probe_warmup_steps} if settings.probe_warmup_steps is not None else {}),
        **({"probe_preset": settings.probe_preset} if settings.probe_preset else {}),  # None: POISEConfig's default
        **(dict(probe_partner_reward=False, probe_bootstrap="rloo") if settings.paper_rules else {}),
        probe_granularity=settings.probe_granularity,
        **({"probe_head": settings.probe_head} if settings.probe_head else {}),  # None: POISEConfig's default head
        probe_history=settings.probe_history,
    )
    table = DemoTableCallback(write=write, show_progress=settings.show_progress)
    trainer = POISETrainer(
        model=policy, reward_funcs=demo.reward, args=config, train_dataset=demo.train, processing_class=tokenizer
    )
    trainer.remove_callback(PrinterCallback)  # both would print TRL's full log dicts; the table replaces them
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(table)
    write(
        f"[3/4] POISE: {settings.steps} steps, {settings.prompts_per_step} prompts x {settings.num_generations} "
        f"rollouts, lr {settings.learning_rate:g}"
    )
    train_start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_start
    trainer.save_state()
    trainer.save_model(str(output_dir / "final"))
    trainer.save_probe(
        output_dir / "final" / ESTIMATOR_FILE
    )  # the probe beside the policy it learned (bench gradient)

    write(f"[4/4] held-out avg@{eval_k} after RL")
    after = evaluate(trainer.model)
    history = trainer.state.log_history
    title = f"POISE on {demo.name} ({demo.model_label})"
    plot_path = plot_training_dynamics(history, output_dir / PLOT_FILE, title=title)
    last = max(1, len([e for e in history if "reward" in e]) // 4)  # final quarter of the logged windows
    summary = {
        "task": demo.name,
        "model": demo.model_label,
        # names and paths relative to output_dir, not this machine's: summaries get committed
        "model_dir": demo.model_dir.name,
        "final_model_dir": "final",
        "steps": settings.steps,
        "seed": seed,
        "eval_k": eval_k,
        "held_out_prompts": len(demo.held_out),
        "learning_rate": settings.learning_rate,
        "prompts_per_step": settings.prompts_per_step,
        "num_generations": settings.num_generations,
        "max_completion_length": demo.max_completion_length,
        "probe_preset": config.probe_preset,
        "probe_preset_changes": {key: ours for key, (_, ours) in config.preset_changes().items()},
        "probe_warmup_steps": config.probe_warmup_steps,
        "probe_granularity": settings.probe_granularity,
        "probe_head": config.probe_head,
        "probe_history": settings.probe_history,
        "train_prompts": TRAIN_DIR,
        "avg_at_k_before": before["avg_at_k"],
        "avg_at_k_after": after["avg_at_k"],
        "by_difficulty_before": before["by_difficulty"],
        "by_difficulty_after": after["by_difficulty"],
        "final_window": {
            key: _window_mean(history, key, last)
            for key in (
                "reward",
                "poise/value_mean",
                "poise/mae",
                "poise/variance_reduction",
                "poise/variance_reduction_bound",
                "poise/pearson_r",
                *(PREFIX_KEYS if settings.probe_granularity == "prefix" else ()),
            )
        },
        "probe_feature_passes": trainer.feature_passes,
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - start,
        "plot": plot_path.name,
    }
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    write(_closing_summary(summary, before, after))
    return summary


def _by_difficulty(result: dict[str, Any]) -> str:
    return " ".join(f"{k}:{v:.2f}" for k, v in result["by_difficulty"].items())


def _closing_summary(summary: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> str:
    k = summary["eval_k"]
    final = summary["final_window"]

    def fmt(value: float | None, spec: str = ".3f") -> str:
        return "–" if value is None else format(value, spec)

    return "\n".join(
        [
            "",
            f"held-out avg@{k}: {before['avg_at_k']:.3f} -> {after['avg_at_k']:.3f} "
            f"({after['avg_at_k'] - before['avg_at_k']:+.3f}) on {summary['held_out_prompts']} unseen prompts",
            f"  by difficulty before: {_by_difficulty(before)}",
            f"  by difficulty after:  {_by_difficulty(after)}",
            f"probe, last quarter of training: value {fmt(final['poise/value_mean'])}, reward {fmt(final['reward'])}, "
            f"MAE {fmt(final['poise/mae'])}, variance reduction {fmt(final['poise/variance_reduction'], '+.3f')} "
            f"(a perfect value baseline: {fmt(final['poise/variance_reduction_bound'], '+.3f')}), "
            f"Pearson r {fmt(final['poise/pearson_r'], '+.3f')}",
            f"training {summary['train_seconds']:.0f} s, total {summary['total_seconds']:.0f} s",
            f"wrote {summary['plot']} and {Path(summary['plot']).with_name(SUMMARY_FILE)}",
        ]
    )

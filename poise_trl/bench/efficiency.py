"""`poise-trl bench efficiency`, the implementation; the method is `bench.EFFICIENCY_DESCRIPTION` (`--help`)."""

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from poise_trl.config import POISEConfig
from poise_trl.demo.model import evaluate_avg_at_k, prepare_demo_model
from poise_trl.demo.tasks import MAX_COMPLETION_LENGTH, make_sort_splits, task_reward
from poise_trl.rlvr.data import load_math_dataset
from poise_trl.rlvr.evaluation import score_benchmark
from poise_trl.rlvr.rewards import math_answer_reward
from poise_trl.trainer import POISETrainer

from .common import (
    CONTENDERS,
    DEMO_LEARNING_RATE,
    PAPER_LEARNING_RATE,
    REFERENCE,
    Contender,
    environment,
    fmt,
    fmt_spread,
    format_table,
    quiet_libraries,
    ratio,
    set_cpu_threads,
    spread,
    trainer_device_args,
    write_json,
)

TARGET_FRACTIONS = (0.5, 0.75, 0.9)  # of the reference's median gain, reported side by side in the JSON
# Logged every step. The `poise/` keys (value-probe quality, paper App. C) exist for POISE only.
PER_STEP_KEYS = (
    "grad_norm",
    "reward",
    "frac_reward_zero_std",
    "frac_zero_advantage_prompts",
    "poise/bootstrap",
    "poise/variance_reduction",
    "poise/pearson_r",
    "poise/mae",
)


class _ZeroAdvantageLogging:
    """Logs `frac_zero_advantage_prompts`: prompts whose completions all got advantage 0 and so teach nothing.

    For GRPO and RLOO this equals TRL's `frac_reward_zero_std` (degenerate groups); for POISE, degenerate groups
    still get `r - b != 0` once the probe is trusted, which is the point of the method.
    """

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        advantages = self.accelerator.gather(output["advantages"])  # rank-major: groups are consecutive
        zero = (advantages.view(-1, group).abs() < 1e-8).all(1)
        self._metrics[mode]["frac_zero_advantage_prompts"].append(zero.float().mean().item())
        return output


class _BenchPOISETrainer(_ZeroAdvantageLogging, POISETrainer):
    pass


class _BenchGRPOTrainer(_ZeroAdvantageLogging, GRPOTrainer):
    pass


class _BenchRLOOTrainer(_ZeroAdvantageLogging, RLOOTrainer):
    pass


TRAINERS: dict[str, tuple[type, type]] = {
    "poise": (_BenchPOISETrainer, POISEConfig),
    "grpo": (_BenchGRPOTrainer, GRPOConfig),
    "rloo": (_BenchRLOOTrainer, RLOOConfig),
}

Evaluator = Callable[[Any, Any], float]  # (model, tokenizer) -> held-out avg@k


@dataclass
class SeedTask:
    """What one seed trains on: the model to start from, the data, the reward and the held-out evaluator."""

    model: str
    train: Dataset
    reward: Callable[..., list]
    evaluate: Evaluator
    max_completion_length: int


class HeldOutCurve(TrainerCallback):
    """Held-out avg@k before training and every `every` optimizer steps; its time is kept out of the train time."""

    def __init__(self, evaluate: Evaluator, every: int, initial: float | None = None):
        self.evaluate, self.every, self.initial = evaluate, every, initial
        self.steps: list[int] = []
        self.avg_at_k: list[float] = []
        self.seconds = 0.0

    def _record(self, step: int, model: Any, tokenizer: Any, value: float | None = None) -> None:
        start = time.perf_counter()
        self.avg_at_k.append(self.evaluate(model, tokenizer) if value is None else value)
        self.steps.append(step)
        self.seconds += time.perf_counter() - start

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._record(0, model, processing_class, self.initial)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._record(state.global_step, model, processing_class)


def _sampling_evaluator(dataset: Dataset, k: int, max_new_tokens: int, batch_size: int, seed: int) -> Evaluator:
    """avg@k of a real model on a math dataset (chat prompts, temperature 1, top-p 1, the training reward)."""

    def evaluate(model: Any, tokenizer: Any) -> float:
        was_training = model.training
        model.eval()

        def sample(prompts: list[list[dict[str, str]]]) -> list[list[str]]:
            outputs: list[list[str]] = []
            for start in range(0, len(prompts), batch_size):
                texts = [
                    tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                    for p in prompts[start : start + batch_size]
                ]
                inputs = tokenizer(
                    texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
                ).to(model.device)
                with torch.no_grad():
                    sequences = model.generate(
                        **inputs,
                        do_sample=True,
                        temperature=1.0,
                        top_p=1.0,
                        top_k=0,
                        max_new_tokens=max_new_tokens,
                        num_return_sequences=k,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                decoded = tokenizer.batch_decode(
                    sequences[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
                )
                outputs.extend(decoded[i : i + k] for i in range(0, len(decoded), k))
            return outputs

        devices = [model.device] if model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the training RNG stream stays as it was
            torch.manual_seed(seed)
            result = score_benchmark(sample, dataset, k, math_answer_reward)["avg_at_k"]
        model.train(was_training)
        return result

    return evaluate


def _task_factory(args: argparse.Namespace) -> Callable[[int], SeedTask]:
    """Seed -> SeedTask for the demo task (own warm start and splits per seed) or for a real model and dataset."""
    if args.model is None:
        cache_dir = Path(args.cache_dir or Path(args.output_dir) / "models")
        max_length = args.max_completion_length or MAX_COMPLETION_LENGTH

        def demo(seed: int) -> SeedTask:
            # The warm start trains on make_sort_splits(seed=seed)'s train split, so its held-out split stays unseen.
            splits = dict(min_digits=args.min_digits, max_digits=args.max_digits, seed=seed)
            train, held_out = make_sort_splits(num_eval=args.num_eval, **splits)
            path = prepare_demo_model(cache_dir, warmup_steps=args.warmup_steps, **splits)

            def evaluate(model: Any, tokenizer: Any) -> float:
                result = evaluate_avg_at_k(
                    model, tokenizer, held_out, k=args.eval_k, max_new_tokens=max_length, seed=args.eval_seed
                )
                return result["avg_at_k"]

            return SeedTask(str(path), train, task_reward, evaluate, max_length)

        return demo

    if args.train_dataset is None or args.eval_dataset is None:
        raise SystemExit("--model needs --train-dataset and --eval-dataset")
    train = load_math_dataset(args.train_dataset, limit=args.train_limit)
    held_out = load_math_dataset(args.eval_dataset, limit=args.eval_limit)
    max_length = args.max_completion_length or 2048
    evaluate = _sampling_evaluator(held_out, args.eval_k, max_length, args.eval_batch_size, args.eval_seed)
    return lambda seed: SeedTask(args.model, train, math_answer_reward, evaluate, max_length)


def _config(contender: Contender, task: SeedTask, args: argparse.Namespace, seed: int, output_dir: Path):
    """The contender's TRL config: everything but the algorithm's own knobs is shared."""
    common = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=args.completions_per_step,
        gradient_accumulation_steps=1,
        num_generations=contender.group_size,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        beta=0.0,
        temperature=1.0,
        top_p=1.0,
        max_completion_length=task.max_completion_length,
        seed=seed,
        **trainer_device_args(args.gradient_checkpointing),
    )
    config_class = TRAINERS[contender.algorithm][1]
    if contender.algorithm == "poise":
        return config_class(loss_type="dapo", probe_preset=args.probe_preset, **common)
    if contender.algorithm == "grpo":
        return config_class(loss_type="dapo", scale_rewards=args.grpo_scale_rewards, **common)
    return config_class(**common)


def _after_bootstrap(per_step: dict[str, list], key: str) -> list[float | None]:
    """A POISE diagnostic on the steps whose baselines all came from the probe (not the RLOO bootstrap)."""
    return [v for v, b in zip(per_step[key], per_step["poise/bootstrap"], strict=True) if b == 0]


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return sum(finite) / len(finite) if finite else None


def run_one(
    contender: Contender, seed: int, task: SeedTask, args: argparse.Namespace, initial: float | None
) -> dict[str, Any]:
    """Train one contender on one seed; return its held-out curve and per-step training metrics."""
    output_dir = Path(args.output_dir) / "runs" / f"{contender.name}_seed{seed}"
    trainer_class = TRAINERS[contender.algorithm][0]
    curve = HeldOutCurve(task.evaluate, args.eval_every, initial)
    trainer = trainer_class(
        model=task.model,
        reward_funcs=task.reward,
        args=_config(contender, task, args, seed, output_dir),
        train_dataset=task.train,
        callbacks=[curve],
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for a per-step print
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    history = [h for h in trainer.state.log_history if "grad_norm" in h]
    per_step = {key: [h.get(key) for h in history] for key in PER_STEP_KEYS}
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "contender": contender.name,
        "seed": seed,
        "completions_per_step": args.completions_per_step,
        "eval_steps": curve.steps,
        "eval_completions": [s * args.completions_per_step for s in curve.steps],
        "avg_at_k": curve.avg_at_k,
        "train_seconds": wall - curve.seconds,
        "eval_seconds": curve.seconds,
        "mean_grad_norm": _mean(per_step["grad_norm"]),
        "mean_frac_zero_advantage_prompts": _mean(per_step["frac_zero_advantage_prompts"]),
        "mean_frac_reward_zero_std": _mean(per_step["frac_reward_zero_std"]),
        "probe_variance_reduction": _mean(_after_bootstrap(per_step, "poise/variance_reduction")),
        "probe_pearson_r": _mean(_after_bootstrap(per_step, "poise/pearson_r")),
        "per_step": per_step,
    }


def completions_to_gain(run: dict[str, Any], gain: float) -> float | None:
    """Completions spent when held-out avg@k first reaches the seed's starting accuracy + `gain`, linearly
    interpolated between evaluations (finer than the evaluation interval); None if it never does. Per seed, because
    warm starts differ in starting accuracy more than contenders do."""
    target = run["avg_at_k"][0] + gain
    points = list(zip(run["eval_completions"], run["avg_at_k"], strict=True))
    if points[0][1] >= target:
        return float(points[0][0])
    for (c0, a0), (c1, a1) in pairwise(points):
        if a1 >= target:  # a0 < target: the curve crosses within this interval
            return c0 + (target - a0) / (a1 - a0) * (c1 - c0)
    return None


def reference_gain(runs: list[dict[str, Any]], reference: str) -> float | None:
    """The reference contender's median gain over training (final - start, per seed); None if it did not improve,
    since a target tied to no progress means nothing."""
    gain = spread(r["avg_at_k"][-1] - r["avg_at_k"][0] for r in runs if r["contender"] == reference)["median"]
    return None if gain is None or gain <= 0 else gain


def target_sensitivity(runs: list[dict[str, Any]], contenders: list[Contender], full_gain: float | None) -> dict:
    """Median completions to reach each fraction of the reference's gain, and the ratio to the reference's.

    The headline uses one fraction; these show how much the ratio depends on that choice (an early target falls
    inside POISE's RLOO bootstrap, which measures the bootstrap rather than the probe).
    """
    table: dict[str, Any] = {}
    if full_gain is None:
        return table
    for fraction in TARGET_FRACTIONS:
        medians = {}
        for contender in contenders:
            reached = [completions_to_gain(r, fraction * full_gain) for r in runs if r["contender"] == contender.name]
            medians[contender.name] = spread(reached)["median"]
        table[str(fraction)] = {
            "gain": fraction * full_gain,
            "median_completions": medians,
            "vs_" + REFERENCE: {name: ratio(m, medians.get(REFERENCE)) for name, m in medians.items()},
        }
    return table


def summarize(runs: list[dict[str, Any]], contenders: list[Contender], gain: float | None) -> dict[str, Any]:
    """Per contender: median [min, max] over seeds of every metric, and ratios of medians against the reference."""
    summary: dict[str, Any] = {}
    for contender in contenders:
        mine = [r for r in runs if r["contender"] == contender.name]
        summary[contender.name] = {
            "label": contender.label,
            "group_size": contender.group_size,
            "start_avg_at_k": spread(r["avg_at_k"][0] for r in mine),
            "final_avg_at_k": spread(r["avg_at_k"][-1] for r in mine),
            "gain": spread(r["avg_at_k"][-1] - r["avg_at_k"][0] for r in mine),
            "completions_to_target": spread(completions_to_gain(r, gain) if gain is not None else None for r in mine),
            "reached_target": sum(gain is not None and completions_to_gain(r, gain) is not None for r in mine),
            "mean_grad_norm": spread(r["mean_grad_norm"] for r in mine),
            "frac_zero_advantage_prompts": spread(r["mean_frac_zero_advantage_prompts"] for r in mine),
            "frac_reward_zero_std": spread(r["mean_frac_reward_zero_std"] for r in mine),
            "train_seconds": spread(r["train_seconds"] for r in mine),
        }
        if contender.algorithm == "poise":
            summary[contender.name]["probe_variance_reduction"] = spread(r["probe_variance_reduction"] for r in mine)
            summary[contender.name]["probe_pearson_r"] = spread(r["probe_pearson_r"] for r in mine)
    if REFERENCE in summary:
        reference = summary[REFERENCE]
        reference_final = {r["seed"]: r["avg_at_k"][-1] for r in runs if r["contender"] == REFERENCE}
        for name, stats in summary.items():
            stats["vs_" + REFERENCE] = {
                key: ratio(stats[key]["median"], reference[key]["median"])
                for key in ("completions_to_target", "final_avg_at_k", "gain", "mean_grad_norm", "train_seconds")
            }
            # Paired by seed (same warm start, data order and evaluator): the difference that seed noise cancels in.
            differences = [
                r["avg_at_k"][-1] - reference_final[r["seed"]]
                for r in runs
                if r["contender"] == name and r["seed"] in reference_final
            ]
            stats["vs_" + REFERENCE]["final_avg_at_k_paired_difference"] = spread(differences)
            stats["vs_" + REFERENCE]["seeds_ahead"] = sum(d > 0 for d in differences)
    return summary


def format_report(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """The table, then one line with the headline ratios against GRPO G=8."""
    k, budget, gain = settings["eval_k"], settings["completions_per_step"], settings["target_gain"]
    headers = [
        "contender",
        "prompts/step",
        f"start avg@{k}",
        f"final avg@{k}",
        "gain",
        f"completions to start+{fmt(gain, 2)} (seeds)",
        "grad norm",
        "zero-adv prompts",
        "train s",
    ]
    rows = [
        [
            s["label"],
            str(budget // s["group_size"]),
            fmt_spread(s["start_avg_at_k"]),
            fmt_spread(s["final_avg_at_k"]),
            fmt_spread(s["gain"], 2),
            fmt_spread(s["completions_to_target"]) + f" ({s['reached_target']}/{s['final_avg_at_k']['n']})",
            fmt_spread(s["mean_grad_norm"]),
            fmt_spread(s["frac_zero_advantage_prompts"], 2),
            fmt_spread(s["train_seconds"]),
        ]
        for s in summary.values()
    ]
    table = format_table(headers, rows)
    return table + "\n" + headline(summary, settings)


def headline(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    k, seeds = settings["eval_k"], len(settings["seeds"])
    if REFERENCE not in summary:
        return f"Summary: no {CONTENDERS[REFERENCE].label} run, so no ratios ({seeds} seeds)."
    parts = []
    for name, stats in summary.items():
        if name == REFERENCE:
            continue
        r = stats["vs_" + REFERENCE]
        difference = r["final_avg_at_k_paired_difference"]
        parts.append(
            f"{stats['label']}: completions-to-target ×{fmt(r['completions_to_target'], 2)}, "
            f"avg@{k} gain ×{fmt(r['gain'], 2)} (final {difference['median']:+.3f} paired, ahead on "
            f"{r['seeds_ahead']}/{difference['n']} seeds), grad norm ×{fmt(r['mean_grad_norm'], 2)}"
        )
    probe = next((s for s in summary.values() if "probe_variance_reduction" in s), None)
    if probe is not None:
        parts.append(
            f"POISE probe after bootstrap: variance reduction {fmt(probe['probe_variance_reduction']['median'], 2)}, "
            f"r {fmt(probe['probe_pearson_r']['median'], 2)}"
        )
    return (
        f"Summary vs {CONTENDERS[REFERENCE].label} at {settings['completions_per_step']} completions/step, "
        f"median of {seeds} seeds: " + "; ".join(parts) + "."
    )


def plot_curves(runs: list[dict[str, Any]], contenders: list[Contender], path: Path, eval_k: int) -> Path:
    """Held-out avg@k gain, gradient norm and zero-advantage prompts against completions spent: median and min-max
    over seeds. The gain is over each seed's own start, since warm starts differ more than the contenders do."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [
        (
            f"held-out avg@{eval_k} gain over the seed's start",
            lambda r: (r["eval_completions"], [a - r["avg_at_k"][0] for a in r["avg_at_k"]]),
        ),
        ("gradient norm before clipping (10-step mean, log scale)", lambda r: _smoothed(r, "grad_norm")),
        ("prompts with zero advantage (10-step mean)", lambda r: _smoothed(r, "frac_zero_advantage_prompts")),
    ]
    for ax, (title, series) in zip(axes, panels, strict=True):
        for contender in contenders:
            curves = [series(r) for r in runs if r["contender"] == contender.name]
            if not curves or not curves[0][0]:
                continue
            x = curves[0][0]
            columns = list(zip(*(c[1] for c in curves), strict=True))
            stats = [spread(column) for column in columns]
            median = [s["median"] for s in stats]
            line = ax.plot(x, median, label=contender.label)[0]
            if len(curves) > 1:
                ax.fill_between(
                    x, [s["min"] for s in stats], [s["max"] for s in stats], color=line.get_color(), alpha=0.15
                )
        ax.set_title(title)
        ax.set_xlabel("completions spent")
        if "log scale" in title:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _smoothed(run: dict[str, Any], key: str, window: int = 10) -> tuple[list[int], list[float]]:
    """A per-step metric as a trailing `window`-step mean against completions spent (a missing value counts 0)."""
    values = [0.0 if v is None else v for v in run["per_step"][key]]
    means = [sum(values[max(0, i - window + 1) : i + 1]) / min(window, i + 1) for i in range(len(values))]
    return [(i + 1) * run["completions_per_step"] for i in range(len(values))], means


def run_efficiency(args: argparse.Namespace) -> int:
    """Handler of `poise-trl bench efficiency`: train every contender on every seed, print and write the results."""
    quiet_libraries()
    set_cpu_threads(args.cpu_threads)
    contenders = [CONTENDERS[name] for name in args.contenders]
    for contender in contenders:
        if args.completions_per_step % contender.group_size:
            raise SystemExit(
                f"--completions-per-step {args.completions_per_step} is not a multiple of {contender.label}'s group"
            )
    if args.learning_rate is None:
        args.learning_rate = DEMO_LEARNING_RATE if args.model is None else PAPER_LEARNING_RATE
    make_task = _task_factory(args)
    runs: list[dict[str, Any]] = []
    start = time.perf_counter()
    max_completion_length = None
    for seed in args.seeds:
        task = make_task(seed)
        max_completion_length = task.max_completion_length
        initial = None  # every contender starts from the same model and evaluator: evaluate step 0 once per seed
        for contender in contenders:
            run = run_one(contender, seed, task, args, initial)
            initial = run["avg_at_k"][0]
            runs.append(run)
            print(
                f"[bench efficiency] seed {seed} {contender.label}: avg@{args.eval_k} "
                f"{fmt(run['avg_at_k'][0])} -> {fmt(run['avg_at_k'][-1])} in {run['train_seconds']:.0f} s "
                f"(+{run['eval_seconds']:.0f} s eval)",
                flush=True,
            )
    full_gain = reference_gain(runs, REFERENCE)
    gain = args.target_gain
    if gain is None and full_gain is not None:
        gain = args.target_fraction * full_gain
    settings = {
        key: getattr(args, key)
        for key in (
            "contenders", "seeds", "completions_per_step", "steps", "eval_every", "eval_k", "eval_seed",
            "target_fraction", "learning_rate", "epsilon", "epsilon_high", "grpo_scale_rewards", "probe_preset",
            "model", "train_dataset", "eval_dataset", "warmup_steps", "min_digits", "max_digits", "num_eval",
        )
    }  # fmt: skip
    settings.update(
        target_gain=gain,
        target_rule="given"
        if args.target_gain is not None
        else f"{args.target_fraction} * median over seeds of GRPO-8's (final - start)",
        max_completion_length=max_completion_length,
        loss_aggregation={"poise": "dapo (token mean)", "grpo": "dapo (token mean)", "rloo": "sequence mean (fixed)"},
    )
    summary = summarize(runs, contenders, gain)
    sensitivity = target_sensitivity(runs, contenders, full_gain)
    report = format_report(summary, settings)
    output_dir = Path(args.output_dir)
    json_path = write_json(
        output_dir / "efficiency.json",
        {
            "command": "poise-trl bench efficiency",
            "settings": settings,
            "environment": environment(),
            "wall_seconds": time.perf_counter() - start,
            "summary": summary,
            "target_sensitivity": sensitivity,
            "headline": report.splitlines()[-1],
            "runs": runs,
        },
    )
    png_path = plot_curves(runs, contenders, output_dir / "efficiency.png", args.eval_k)
    print(f"wrote {json_path} and {png_path}\n")
    print(report)  # its last line is the one-line summary
    return 0

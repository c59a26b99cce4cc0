"""`poise-trl bench efficiency`, the implementation; the method is `bench.EFFICIENCY_DESCRIPTION` (`--help`)."""

import argparse
import dataclasses
import gc
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from poise_trl.demo.model import evaluate_avg_at_k, prepare_demo_model
from poise_trl.demo.tasks import MAX_COMPLETION_LENGTH, make_sort_splits, task_reward
from poise_trl.rlvr.data import load_math_dataset
from poise_trl.rlvr.evaluation import score_benchmark
from poise_trl.rlvr.rewards import math_answer_reward

from .common import (
    CONTENDERS,
    COUNTERS,
    DEMO_LEARNING_RATE,
    PAPER_LEARNING_RATE,
    Contender,
    default_jobs,
    environment,
    fmt,
    quiet_libraries,
    set_cpu_threads,
    trainer_device_args,
    write_json,
)
from .summary import (
    TARGET_FRACTIONS,
    _mean,
    common_budget,
    format_report,
    plot_curves,
    reference_gain,
    summarize,
    task_check,
)
from .trainers import TRAINERS, unavailable_reason

# Logged every step. The `poise/` keys (value-probe quality, paper App. C) exist for POISE only, `dapo/` for DAPO-DS.
PER_STEP_KEYS = (
    "grad_norm",
    "reward",
    "frac_reward_zero_std",
    "frac_zero_advantage_prompts",
    "poise/bootstrap",
    "poise/variance_reduction",
    "poise/pearson_r",
    "poise/mae",
    "poise/selection/prefill_tokens",
    "dapo/rounds",
    "dapo/capped",
)
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
    """Held-out avg@k before training and every `every` optimizer steps, with the compute counted so far; its time is
    kept out of the train time."""

    def __init__(self, evaluate: Evaluator, every: int):
        self.evaluate, self.every = evaluate, every
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # the trainer's bench_counts, set once it exists
        self.steps: list[int] = []
        self.avg_at_k: list[float] = []
        self.completions_generated: list[int] = []
        self.seconds = 0.0

    def _record(self, step: int, model: Any, tokenizer: Any) -> None:
        start = time.perf_counter()
        self.avg_at_k.append(self.evaluate(model, tokenizer))
        self.steps.append(step)
        self.completions_generated.append(self.counts["completions_generated"])
        self.seconds += time.perf_counter() - start

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._record(0, model, processing_class)

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


def micro_batching(completions_per_step: int, per_device: int | None) -> dict[str, int]:
    """TRL batch settings for B completions per optimizer step in micro-batches of `per_device`.

    Gradient accumulation keeps B per optimizer step, and `steps_per_generation` = the accumulation steps keeps one
    generation of B per optimizer step, so TRL runs no old-log-prob pass, as with one micro-batch.
    """
    per_device = per_device or completions_per_step
    if completions_per_step % per_device:
        raise SystemExit(f"--completions-per-step {completions_per_step} is not a multiple of --per-device-batch-size "
                         f"{per_device}")  # fmt: skip
    accumulation = completions_per_step // per_device
    return dict(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
    )


def _config(contender: Contender, task: SeedTask, args: argparse.Namespace, seed: int, output_dir: Path):
    """The contender's TRL config: everything but the algorithm's own knobs and its overrides is shared."""
    config_class = TRAINERS[contender.trainer][1]
    fields = {f.name for f in dataclasses.fields(config_class)}
    settings: dict[str, Any] = dict(
        output_dir=str(output_dir),
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
        **micro_batching(args.completions_per_step, args.per_device_batch_size),
        **trainer_device_args(args.gradient_checkpointing),
    )
    if contender.trainer in ("poise", "grpo", "dapo_ds"):  # RLOOTrainer has no loss_type (sequence mean, fixed)
        settings["loss_type"] = "dapo"
    if contender.trainer in ("grpo", "dapo_ds"):
        settings["scale_rewards"] = args.grpo_scale_rewards
    settings.update({key: value for key, value in contender.pins.items() if key in fields})
    settings.update(contender.overrides)
    return config_class(**settings)


def _after_bootstrap(per_step: dict[str, list], key: str) -> list[float | None]:
    """A POISE diagnostic on the steps whose baselines all came from the probe (not the RLOO bootstrap)."""
    return [v for v, b in zip(per_step[key], per_step["poise/bootstrap"], strict=True) if b == 0]


def run_one(contender: Contender, seed: int, task: SeedTask, args: argparse.Namespace) -> dict[str, Any]:
    """Train one contender on one seed; return its held-out curve, compute counts and per-step training metrics."""
    output_dir = Path(args.output_dir) / "runs" / f"{contender.name}_seed{seed}"
    trainer_class = TRAINERS[contender.trainer][0]
    curve = HeldOutCurve(task.evaluate, args.eval_every)
    trainer = trainer_class(
        model=task.model,
        reward_funcs=task.reward,
        args=_config(contender, task, args, seed, output_dir),
        train_dataset=task.train,
        callbacks=[curve],
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for a per-step print
    trainer.dapo_max_rounds = args.dapo_max_rounds
    curve.counts = trainer.bench_counts
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    history = [h for h in trainer.state.log_history if "grad_norm" in h]
    per_step = {key: [h.get(key) for h in history] for key in PER_STEP_KEYS}
    counts = dict(trainer.bench_counts)
    counts["prefill_tokens"] += int(sum(v or 0 for v in per_step["poise/selection/prefill_tokens"]))
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "contender": contender.name,
        "seed": seed,
        "completions_per_step": args.completions_per_step,
        "eval_steps": curve.steps,
        "eval_completions": curve.completions_generated,
        "avg_at_k": curve.avg_at_k,
        **counts,
        "train_seconds": wall - curve.seconds,
        "eval_seconds": curve.seconds,
        "mean_grad_norm": _mean(per_step["grad_norm"]),
        "mean_frac_zero_advantage_prompts": _mean(per_step["frac_zero_advantage_prompts"]),
        "mean_frac_reward_zero_std": _mean(per_step["frac_reward_zero_std"]),
        "probe_variance_reduction": _mean(_after_bootstrap(per_step, "poise/variance_reduction")),
        "probe_pearson_r": _mean(_after_bootstrap(per_step, "poise/pearson_r")),
        "per_step": per_step,
    }


def _worker_setup(cpu_threads: int) -> None:
    """Each worker process: its thread count and quiet libraries, once."""
    set_cpu_threads(cpu_threads)
    quiet_libraries()


def _run_in_worker(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One (contender, seed) run in a worker process; the seed's task is rebuilt there from its cached files."""
    run = run_one(CONTENDERS[name], seed, _task_factory(args)(seed), args)
    print(
        f"[bench efficiency] seed {seed} {CONTENDERS[name].label}: avg@{args.eval_k} {fmt(run['avg_at_k'][0])} -> "
        f"{fmt(run['avg_at_k'][-1])}, {run['completions_generated']} completions generated, "
        f"{run['train_seconds']:.0f} s (+{run['eval_seconds']:.0f} s eval)",
        flush=True,
    )
    return run


def run_all(args: argparse.Namespace, contenders: list[Contender]) -> list[dict[str, Any]]:
    """Every (contender, seed) run, `args.jobs` at a time, each in a fresh-started worker process.

    Runs are independent and each seeds itself, so the results do not depend on `--jobs`. The seeds' warm-started
    models are prepared here first, one at a time, so parallel workers only read the cache and never race on it.
    Workers are spawned (not forked) so none inherits this process's thread pools.
    """
    make_task = _task_factory(args)
    for seed in args.seeds:
        make_task(seed)
    order = [(c.name, seed) for seed in args.seeds for c in contenders]
    context = multiprocessing.get_context("spawn")
    jobs = max(1, min(args.jobs, len(order)))
    setup = dict(mp_context=context, initializer=_worker_setup, initargs=(args.cpu_threads,))
    with ProcessPoolExecutor(jobs, **setup) as pool:
        futures = [pool.submit(_run_in_worker, name, seed, args) for name, seed in order]
        return [future.result() for future in futures]


def _available(names: list[str]) -> tuple[list[Contender], dict[str, str]]:
    """The contenders this library version can run, and why each other one cannot."""
    available, unavailable = [], {}
    for name in names:
        reason = unavailable_reason(CONTENDERS[name])
        if reason is None:
            available.append(CONTENDERS[name])
        else:
            unavailable[name] = reason
            print(f"[bench efficiency] {CONTENDERS[name].label} unavailable, not run: {reason}", flush=True)
    return available, unavailable


def run_efficiency(args: argparse.Namespace) -> int:
    """Handler of `poise-trl bench efficiency`: train every contender on every seed, print and write the results."""
    quiet_libraries()
    set_cpu_threads(args.cpu_threads)
    contenders, unavailable = _available(args.contenders)
    if not contenders:
        raise SystemExit("no contender can run with this library version")
    for contender in contenders:
        if args.completions_per_step % contender.group_size:
            raise SystemExit(
                f"--completions-per-step {args.completions_per_step} is not a multiple of {contender.label}'s group"
            )
    if args.learning_rate is None:
        args.learning_rate = DEMO_LEARNING_RATE if args.model is None else PAPER_LEARNING_RATE
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = args.model is not None  # a real model's activations need it (OOM otherwise)
    if args.jobs is None:
        args.jobs = 1 if args.model is not None else default_jobs()  # one GPU: one run at a time
    start = time.perf_counter()
    runs = run_all(args, contenders)
    budget = common_budget(runs)
    full_gain = reference_gain(runs, "grpo8")
    check = task_check(runs)
    settings = {
        key: getattr(args, key)
        for key in (
            "contenders", "seeds", "completions_per_step", "per_device_batch_size", "steps", "eval_every", "eval_k",
            "eval_seed", "learning_rate", "epsilon", "epsilon_high", "grpo_scale_rewards", "dapo_max_rounds",
            "gradient_checkpointing", "jobs", "model", "train_dataset", "eval_dataset", "warmup_steps", "min_digits",
            "max_digits", "num_eval",
        )
    }  # fmt: skip
    settings.update(
        common_budget=budget,
        reference_gain=full_gain,
        target_rule="fraction x median over seeds of GRPO-8's (final - start), for fractions "
        + ", ".join(map(str, TARGET_FRACTIONS)),
        loss_aggregation={"poise/grpo/dapo_ds": "dapo (token mean)", "rloo": "sequence mean (fixed)"},
        unavailable=unavailable,
    )
    summary = summarize(runs, contenders, full_gain, budget)
    report = format_report(summary, settings)
    output_dir = Path(args.output_dir)
    json_path = write_json(
        output_dir / "efficiency.json",
        {
            "command": "poise-trl bench efficiency",
            "settings": settings,
            "environment": environment(),
            "wall_seconds": time.perf_counter() - start,
            "task_check": check,
            "summary": summary,
            "headline": report.splitlines()[-1],
            "runs": runs,
        },
    )
    png_path = plot_curves(runs, contenders, output_dir / "efficiency.png", budget, args.eval_k)
    print(f"wrote {json_path} and {png_path}\n")
    degenerate = check["degenerate_g8_groups_at_start"]
    print(
        f"Task check: {fmt(degenerate, 2)} of G=8 groups tie at the start (GRPO-8/DAPO-DS, first 5 steps, median "
        f"over seeds; want >= 0.25); best final avg@{args.eval_k} {fmt(check['best_final_avg_at_k'])} (want < 0.95)."
    )
    print(report)  # its last line is the headline
    return 0

"""One `poise-trl bench efficiency` run: a contender trained on one seed's task with a held-out curve on a grid of
completions generated. The study around it (tuning, resuming, the report) is `bench.study`; the method is
`bench.cli.efficiency`, whose docstring is its `--help`."""

import dataclasses
import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from poise_lab.models.real import resolve_model
from poise_lab.models.toy import default_cache_dir, evaluate_avg_at_k, prepare_demo_model
from poise_lab.tasks.arith import ARITH_MAX_COMPLETION_LENGTH, arith_reward, first_number, make_arith_splits
from poise_lab.tasks.toy import MAX_COMPLETION_LENGTH, extract_answer, make_splits, task_reward
from poise_trl.rlvr.avg_at_k import score_benchmark
from poise_trl.tasks.math_data import load_math_dataset
from poise_trl.tasks.math_reward import extract_final_answer, math_answer_reward

from .common import (
    ARITH_DATASET,
    ARITH_EVAL_PROMPTS,
    COUNTERS,
    mean_or_none,
    trainer_device_args,
)
from .contenders import Contender
from .settings import EfficiencySettings
from .trainers import TRAINERS, trainer_inputs

# Logged every step. The `poise/` keys (value-probe quality, paper App. C) exist for POISE only, `dapo/` for DAPO-DS.
PER_STEP_KEYS = (
    "grad_norm",
    "reward",
    "frac_reward_zero_std",
    "frac_zero_advantage_prompts",
    "poise/bootstrap",
    "poise/variance_reduction",
    "poise/variance_reduction_bound",
    "poise/pearson_r",
    "poise/mae",
    "poise/selection/prefill_tokens",
    "dapo/rounds",
    "dapo/capped",
    "dapo/carried",
    "cgrpo/mean_k",
    "cgrpo/calibration_rollouts",
)
Evaluator = Callable[[Any, Any], float]  # (model, tokenizer) -> held-out avg@k


@dataclass
class SeedTask:
    """What one seed trains on: the model to start from, the data, the reward, the held-out evaluator and the
    reward's own answer parsing (C-GRPO compares answers)."""

    model: str
    train: Dataset
    reward: Callable[..., list]
    evaluate: Evaluator
    max_completion_length: int
    extract_answer: Callable[[str], str | None]


class HeldOutCurve(TrainerCallback):
    """Held-out avg@k before training and each time another `every` completions have been generated (the same grid
    for every contender, whatever it generates per step), with the compute counted so far; training stops once
    `budget` completions are generated. Its time is kept out of the train time.

    Evaluations happen at optimizer-step ends, so a contender that generates more than `every` in one step (DAPO-DS
    refilling) is evaluated at the first step end past each grid point, at the count it reached. Completions spent
    before the first step (A*-PO's value samples) are charged: the curve starts at 0 completions and stays at the
    starting model's score until they are spent, since no weight changed meanwhile.
    """

    def __init__(self, evaluate: Evaluator, every: int, budget: int):
        self.evaluate, self.every, self.budget = evaluate, every, budget
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
        if self.completions_generated[0] > 0:  # spent before training: the same model stood at 0
            self.steps.insert(0, 0)
            self.avg_at_k.insert(0, self.avg_at_k[0])
            self.completions_generated.insert(0, 0)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        generated = self.counts["completions_generated"]
        done = generated >= self.budget or state.global_step == state.max_steps
        if done or generated // self.every > self.completions_generated[-1] // self.every:
            self._record(state.global_step, model, processing_class)
        if generated >= self.budget:
            control.should_training_stop = True


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


def task_factory(settings: EfficiencySettings, task: str = "sort") -> Callable[[int], SeedTask]:
    """Seed -> SeedTask for an offline demo task (own warm start and splits per seed) or a real model and dataset."""
    if settings.model is None:
        cache_dir = Path(settings.cache_dir or default_cache_dir() / "bench")
        max_length = settings.max_completion_length or MAX_COMPLETION_LENGTH

        def demo(seed: int) -> SeedTask:
            # The warm start trains on the same splits' train part, so its held-out split stays unseen.
            splits = dict(
                num_eval=settings.num_eval, min_digits=settings.min_digits, max_digits=settings.max_digits, seed=seed
            )
            train, held_out = make_splits(task, **splits)
            if settings.train_limit is not None:  # RL on the first prompts only: prompts repeat, as over epochs
                train = train.select(range(min(settings.train_limit, len(train))))
            path = prepare_demo_model(cache_dir, warmup_steps=settings.warmup_steps_of(task), task=task, **splits)

            def evaluate(model: Any, tokenizer: Any) -> float:
                result = evaluate_avg_at_k(
                    model, tokenizer, held_out, k=settings.eval_k, max_new_tokens=max_length, seed=settings.eval_seed
                )
                return result["avg_at_k"]

            return SeedTask(str(path), train, task_reward, evaluate, max_length, extract_answer)

        return demo

    model = resolve_model(settings.model)
    if settings.train_dataset == ARITH_DATASET:
        return _arith_factory(settings, model)
    if settings.train_dataset is None or settings.eval_dataset is None:
        raise SystemExit(f"--model needs --train-dataset and --eval-dataset (or --train-dataset {ARITH_DATASET})")
    train = load_math_dataset(settings.train_dataset, limit=settings.train_limit)
    held_out = load_math_dataset(settings.eval_dataset, limit=settings.eval_limit)
    max_length = settings.max_completion_length or 2048
    evaluate = _sampling_evaluator(held_out, settings.eval_k, max_length, settings.eval_batch_size, settings.eval_seed)
    return lambda seed: SeedTask(model, train, math_answer_reward, evaluate, max_length, extract_final_answer)


def _arith_factory(settings: EfficiencySettings, model: str) -> Callable[[int], SeedTask]:
    """A real model on `arith`: one split for every seed (seed 0), so every run is evaluated on the same held-out
    prompts; the seed changes the data order and the sampling."""
    train, held_out = make_arith_splits(
        settings.train_limit or 2000, settings.eval_limit or ARITH_EVAL_PROMPTS, seed=0
    )
    max_length = settings.max_completion_length or ARITH_MAX_COMPLETION_LENGTH

    def evaluate(policy: Any, tokenizer: Any) -> float:
        result = evaluate_avg_at_k(
            policy,
            tokenizer,
            held_out,
            k=settings.eval_k,
            max_new_tokens=max_length,
            batch_size=settings.eval_batch_size,
            seed=settings.eval_seed,
            reward=arith_reward,
        )
        return result["avg_at_k"]

    return lambda seed: SeedTask(model, train, arith_reward, evaluate, max_length, first_number)


def micro_batching(completions_per_step: int, per_device: int | None) -> dict[str, int]:
    """TRL batch settings for B completions per optimizer step in micro-batches of `per_device`.

    Gradient accumulation keeps B per optimizer step, and `steps_per_generation` = the accumulation steps keeps one
    generation of B per optimizer step, so TRL runs no old-log-prob pass, as with one micro-batch.
    """
    per_device = per_device or completions_per_step
    if completions_per_step % per_device:
        raise SystemExit(
            f"--completions-per-step {completions_per_step} is not a multiple of --per-device-batch-size {per_device}"
        )
    accumulation = completions_per_step // per_device
    return dict(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
    )


def _config(
    contender: Contender,
    task: SeedTask,
    settings: EfficiencySettings,
    seed: int,
    output_dir: Path,
    learning_rate: float,
):
    """The contender's TRL config: everything but the algorithm's own knobs, its overrides and its (tuned) learning
    rate is shared; a setting its config lacks (A*-PO has no group, clipping or loss type) is left out.
    `max_steps` is what B per step needs to reach the budget; a contender that generates more per step (DAPO-DS)
    stops earlier, at the budget (HeldOutCurve); C-GRPO, which may stop every prompt at its smallest budget, gets
    the steps that would take; A*-PO, whose epochs end in a short batch over its filtered prompts, one step per
    completion (it stops at the budget)."""
    config_class = TRAINERS[contender.trainer][1]
    fields = {f.name for f in dataclasses.fields(config_class)}
    shared: dict[str, Any] = dict(
        output_dir=str(output_dir),
        num_generations=contender.group_size,
        max_steps=-(-settings.budget // settings.completions_per_step),
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        beta=0.0,
        temperature=1.0,
        top_p=1.0,
        max_completion_length=task.max_completion_length,
        seed=seed,
        **micro_batching(settings.completions_per_step, settings.per_device_batch_size),
        **trainer_device_args(settings.gradient_checkpointing),
    )
    config = {key: value for key, value in shared.items() if key in fields}
    if "loss_type" in fields:  # RLOOConfig has none (its loss is a sequence mean, fixed), nor has A2POConfig
        config["loss_type"] = "dapo"
    if "scale_rewards" in fields and contender.trainer != "poise":  # the GRPO family; POISE keeps its own, none
        config["scale_rewards"] = settings.grpo_scale_rewards
    if contender.trainer == "a2po":
        config["max_steps"] = settings.budget
    if contender.trainer == "cgrpo":
        prompts_per_step = settings.completions_per_step // contender.group_size
        config["max_steps"] = -(-settings.budget // (prompts_per_step * min(contender.overrides["budget_grid"])))
    config.update(contender.overrides)
    return config_class(**config)


def _after_bootstrap(per_step: dict[str, list], key: str) -> list[float | None]:
    """A POISE diagnostic on the steps whose baselines all came from the probe (not the bootstrap)."""
    return [v for v, b in zip(per_step[key], per_step["poise/bootstrap"], strict=True) if b == 0]


def run_one(
    contender: Contender, seed: int, task: SeedTask, settings: EfficiencySettings, learning_rate: float
) -> dict[str, Any]:
    """Train one contender on one seed; return its held-out curve, compute counts and per-step training metrics."""
    trainer_class = TRAINERS[contender.trainer][0]
    scratch = tempfile.TemporaryDirectory(prefix="poise-bench-")  # the trainer saves nothing (save_strategy="no")
    output_dir = Path(scratch.name)
    curve = HeldOutCurve(task.evaluate, settings.eval_every, settings.budget)
    config = _config(contender, task, settings, seed, output_dir, learning_rate)
    trainer = trainer_class(
        model=task.model,
        reward_funcs=task.reward,
        args=config,
        callbacks=[curve],
        **trainer_inputs(contender.trainer, config, settings.budget, task.train, task.extract_answer),
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for a per-step print
    trainer.dapo_max_rounds = settings.dapo_max_rounds
    curve.counts = trainer.bench_counts
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    history = [h for h in trainer.state.log_history if "grad_norm" in h]
    per_step = {key: [h.get(key) for h in history] for key in PER_STEP_KEYS}
    counts = dict(trainer.bench_counts)
    counts["prefill_tokens"] += int(sum(v or 0 for v in per_step["poise/selection/prefill_tokens"]))
    del trainer
    scratch.cleanup()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "contender": contender.name,
        "seed": seed,
        "learning_rate": learning_rate,
        "completions_per_step": settings.completions_per_step,
        "eval_steps": curve.steps,
        "eval_completions": curve.completions_generated,
        "avg_at_k": curve.avg_at_k,
        **counts,
        "train_seconds": wall - curve.seconds,
        "eval_seconds": curve.seconds,
        "mean_grad_norm": mean_or_none(per_step["grad_norm"]),
        "mean_frac_zero_advantage_prompts": mean_or_none(per_step["frac_zero_advantage_prompts"]),
        "mean_frac_reward_zero_std": mean_or_none(per_step["frac_reward_zero_std"]),
        "probe_variance_reduction": mean_or_none(_after_bootstrap(per_step, "poise/variance_reduction")),
        "probe_variance_reduction_bound": mean_or_none(_after_bootstrap(per_step, "poise/variance_reduction_bound")),
        "probe_pearson_r": mean_or_none(_after_bootstrap(per_step, "poise/pearson_r")),
        "per_step": {key: [None if v is None else round(v, 5) for v in values] for key, values in per_step.items()},
    }

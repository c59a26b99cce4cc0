"""`poise-trl bench efficiency`, the implementation; the method is `bench.EFFICIENCY_DESCRIPTION` (`--help`)."""

import argparse
import dataclasses
import gc
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
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
    REFERENCES,
    Contender,
    bootstrap_median,
    default_jobs,
    environment,
    fmt,
    fmt_ci,
    fmt_spread,
    format_table,
    quiet_libraries,
    ratio,
    set_cpu_threads,
    spread,
    trainer_device_args,
    write_json,
)

TARGET_FRACTIONS = (0.5, 0.75, 0.9)  # of GRPO-8's median gain, reported side by side in the JSON
HEADLINE_FRACTION = "0.75"
MIN_SEEDS_FOR_CI = 8  # below it the percentile bootstrap of a median over seeds has too few distinct resamples
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
# What every run counts (cumulative), the compute columns of the table.
COUNTERS = (
    "completions_generated",
    "completions_trained",
    "tokens_generated",
    "prefill_tokens",
    "forward_rows",
)


class _Accounting:
    """Counts compute as it is spent: completions and tokens per generation call, rows per teacher-forced pass.

    `forward_rows` is the number of sequences sent through the policy in teacher-forced passes (the training pass,
    TRL's old-log-prob pass, POISE's own feature pass); generation is counted as completions and tokens. It sits
    innermost, so each of DAPO-DS's extra generation rounds is counted too. Prefill tokens are the prompt tokens each
    generated completion is conditioned on (HF generate prefills every repeated prompt), plus what value-guided
    selection spends (`poise/selection/prefill_tokens`, added from the log afterwards).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.bench_counts = dict.fromkeys(COUNTERS, 0)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            counts = self.bench_counts
            counts["completions_generated"] += int(self.accelerator.gather(output["completion_mask"]).size(0))
            counts["tokens_generated"] += int(self.accelerator.gather(output["completion_mask"].sum()).sum())
            counts["prefill_tokens"] += int(self.accelerator.gather(output["prompt_mask"].sum()).sum())
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        if self.model.training:
            self.bench_counts["forward_rows"] += int(input_ids.size(0))
        return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)


class _TrainedAccounting:
    """Outermost: what is actually trained on, and `frac_zero_advantage_prompts`, the prompts whose completions all
    got advantage 0 and so teach nothing.

    For GRPO and RLOO that equals TRL's `frac_reward_zero_std` (degenerate groups); for POISE, degenerate groups
    still get `r - b != 0` once the probe is trusted, which is the point of the method; DAPO-DS trains on none.
    """

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        advantages = self.accelerator.gather(output["advantages"])  # rank-major: groups are consecutive
        zero = (advantages.view(-1, group).abs() < 1e-8).all(1)
        self._metrics[mode]["frac_zero_advantage_prompts"].append(zero.float().mean().item())
        if mode == "train":
            self.bench_counts["completions_trained"] += int(advantages.numel())
        return output


# Row tensors of `_generate_and_score_completions`' output and how DynamicSampling pads them to a common width.
_LEFT_PADDED = {"prompt_ids": "pad", "prompt_mask": 0}
_RIGHT_PADDED = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "importance_sampling_ratio": 1.0,
    "tool_mask": 1,
}


class DynamicSampling:
    """DAPO's dynamic sampling (Yu et al., 2025, §3.2) on top of GRPOTrainer, for the benchmark only.

    A group whose rewards all tie has zero advantage and teaches nothing. DAPO keeps generating until the step holds
    B/G informative groups: the sampler's prompts first, then fresh batches of B/G prompts drawn from the training set
    (seeded, its own order), keeping each batch's informative groups in order; at most `dapo_max_rounds` generation
    batches per step (a step that hits the cap trains on what it has, topped up with tied groups, and logs
    `dapo/capped`). Every completion generated is counted (`_Accounting`), the surplus of the last round included.

    It overrides only `_generate_and_score_completions`, calling GRPOTrainer's once per round and concatenating the
    kept rows (prompts left-padded, completions right-padded to the widest round), so TRL's shuffling, buffering and
    loss run unchanged. A tie is read off the advantages: GRPO's `r - mean` is exactly 0 for every member of a tied
    group and for no group with two different rewards. Single process (every benchmark run is one).
    """

    dapo_max_rounds: int = 8

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        if self.accelerator.num_processes != 1:
            raise RuntimeError("the benchmark's DynamicSampling runs in a single process")
        group = self.num_generations
        wanted = len(inputs) // group
        kept: list[tuple[dict[str, Any], torch.Tensor]] = []  # (round output, its kept group indices)
        tied: list[tuple[dict[str, Any], torch.Tensor]] = []
        found, rounds, batch = 0, 0, inputs
        while found < wanted and rounds < self.dapo_max_rounds:
            output = super()._generate_and_score_completions(batch)
            rounds += 1
            informative = (output["advantages"].view(-1, group) != 0).any(1)
            take = informative.nonzero().flatten()[: wanted - found]
            kept.append((output, take))
            tied.append((output, (~informative).nonzero().flatten()))
            found += take.numel()
            if found < wanted:
                batch = [row for row in self._fresh_prompts(wanted) for _ in range(group)]
        capped = found < wanted
        for output, groups in tied:  # only when capped: fill the step with tied groups (advantage 0, no signal)
            if found == wanted:
                break
            groups = groups[: wanted - found]
            kept.append((output, groups))
            found += groups.numel()
        self._metrics["train"]["dapo/rounds"].append(float(rounds))
        self._metrics["train"]["dapo/capped"].append(float(capped))
        return self._concatenate(kept, group)

    def _fresh_prompts(self, count: int) -> list[dict[str, Any]]:
        """The next `count` training rows of the trainer's own seeded shuffle of the training set (cycled)."""
        if not hasattr(self, "_fresh_order"):
            self._fresh_generator = torch.Generator().manual_seed(self.args.seed + 1)
            self._fresh_order: list[int] = []
        rows = []
        for _ in range(count):
            if not self._fresh_order:
                n = len(self.train_dataset)
                self._fresh_order = torch.randperm(n, generator=self._fresh_generator).tolist()
            rows.append(self.train_dataset[self._fresh_order.pop()])
        return rows

    def _concatenate(self, parts: list[tuple[dict[str, Any], torch.Tensor]], group: int) -> dict[str, Any]:
        """The kept groups' rows of every round as one output dict, padded to common widths."""
        pad_id = self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id") else 0
        pieces: dict[str, list[torch.Tensor]] = {}
        for output, groups in parts:
            rows = (groups.unsqueeze(1) * group + torch.arange(group, device=groups.device)).flatten()
            for key, value in output.items():
                if key == "num_items_in_batch" or value is None:
                    continue
                if key not in _LEFT_PADDED and key not in _RIGHT_PADDED and key != "advantages":
                    raise NotImplementedError(f"DynamicSampling cannot concatenate {key!r} (multimodal/tools)")
                pieces.setdefault(key, []).append(value[rows.to(value.device)])
        merged: dict[str, Any] = {}
        for key, values in pieces.items():
            if key == "advantages":
                merged[key] = torch.cat(values)
                continue
            side, fill = ("left", _LEFT_PADDED[key]) if key in _LEFT_PADDED else ("right", _RIGHT_PADDED[key])
            fill = pad_id if fill == "pad" else fill
            width = max(v.size(1) for v in values)
            padded = []
            for v in values:
                extra = v.new_full((v.size(0), width - v.size(1)), fill)
                padded.append(torch.cat([extra, v] if side == "left" else [v, extra], dim=1))
            merged[key] = torch.cat(padded)
        merged["num_items_in_batch"] = (merged["completion_mask"] * merged.get("tool_mask", 1)).sum()
        return merged


class _BenchPOISETrainer(_TrainedAccounting, _Accounting, POISETrainer):
    pass


class _BenchGRPOTrainer(_TrainedAccounting, _Accounting, GRPOTrainer):
    pass


class _BenchRLOOTrainer(_TrainedAccounting, _Accounting, RLOOTrainer):
    pass


class _BenchDAPOTrainer(_TrainedAccounting, DynamicSampling, _Accounting, GRPOTrainer):
    pass


TRAINERS: dict[str, tuple[type, type]] = {
    "poise": (_BenchPOISETrainer, POISEConfig),
    "grpo": (_BenchGRPOTrainer, GRPOConfig),
    "rloo": (_BenchRLOOTrainer, RLOOConfig),
    "dapo_ds": (_BenchDAPOTrainer, GRPOConfig),
}


def unavailable_reason(contender: Contender) -> str | None:
    """Why a contender cannot run with this library version (a config field it needs is missing), else None."""
    fields = {f.name for f in dataclasses.fields(TRAINERS[contender.trainer][1])}
    missing = sorted(set(contender.overrides) - fields)
    if missing:
        return f"{TRAINERS[contender.trainer][1].__name__} has no field {', '.join(missing)} (added by issue 12)"
    return None


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


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return sum(finite) / len(finite) if finite else None


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


def completions_to_gain(run: dict[str, Any], gain: float) -> float | None:
    """Completions generated when held-out avg@k first reaches the seed's starting accuracy + `gain`, linearly
    interpolated between evaluations; None if it never does. Per seed, because warm starts differ in starting accuracy
    more than contenders do."""
    target = run["avg_at_k"][0] + gain
    points = list(zip(run["eval_completions"], run["avg_at_k"], strict=True))
    if points[0][1] >= target:
        return float(points[0][0])
    for (c0, a0), (c1, a1) in pairwise(points):
        if a1 >= target:  # a0 < target: the curve crosses within this interval
            return c0 + (target - a0) / (a1 - a0) * (c1 - c0)
    return None


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """The piecewise-linear curve through (xs, ys) at x (xs increasing, x within them)."""
    for (x0, y0), (x1, y1) in pairwise(zip(xs, ys, strict=True)):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return ys[-1]


def normalized_auc(run: dict[str, Any], budget: float) -> float:
    """Mean held-out avg@k over the first `budget` completions generated: the area under the linearly interpolated
    curve divided by the budget. One number per run that uses every evaluation, not one threshold crossing."""
    xs, ys = run["eval_completions"], run["avg_at_k"]
    if budget <= 0 or xs[-1] < budget:
        raise ValueError(f"the run covers {xs[-1]} completions, not the budget {budget}")
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if x < budget] + [(budget, interpolate(xs, ys, budget))]
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in pairwise(points))
    return area / budget


def common_budget(runs: list[dict[str, Any]]) -> float:
    """The smallest final completions-generated count over all runs: every curve covers it."""
    return float(min(r["eval_completions"][-1] for r in runs))


def reference_gain(runs: list[dict[str, Any]], reference: str) -> float | None:
    """The reference contender's median gain over training (final - start, per seed); None if it did not improve,
    since a target tied to no progress means nothing."""
    gain = spread(r["avg_at_k"][-1] - r["avg_at_k"][0] for r in runs if r["contender"] == reference)["median"]
    return None if gain is None or gain <= 0 else gain


def _paired(
    mine: dict[int, float | None],
    theirs: dict[int, float | None],
    kind: str,
    their_budget: dict[int, float] | None = None,
) -> list[float | None]:
    """Per-seed `kind` ("ratio" or "difference") of two contenders' values on the seeds both ran.

    For completions to a target, None means never reached, and the ratio stays conservative for `mine`: mine never
    reached, an infinite ratio (None); the reference never reached, its final count (`their_budget`, less than what it
    would need) stands in, an upper bound on the ratio; neither reached, the seed says nothing and is left out.
    """
    values = []
    for seed in sorted(set(mine) & set(theirs)):
        a, b = mine[seed], theirs[seed]
        if kind == "difference":
            values.append(None if a is None or b is None else a - b)
        elif a is None:
            if b is not None:
                values.append(None)
        elif b is None:
            if their_budget is None:
                raise ValueError("a reference that never reached the target needs its budget")
            values.append(a / their_budget[seed])
        else:
            values.append(ratio(a, b))
    return values


def summarize(
    runs: list[dict[str, Any]], contenders: list[Contender], full_gain: float | None, budget: float
) -> dict[str, Any]:
    """Per contender: medians of the compute counts, AUC over the common budget with a bootstrap CI over seeds, the
    completions to each target, and per-seed paired statistics against each reference, each [median, low, high]."""
    targets = {str(f): f * full_gain for f in TARGET_FRACTIONS} if full_gain is not None else {}
    per_seed: dict[str, dict[str, dict[int, float | None]]] = {}
    for contender in contenders:
        mine = [r for r in runs if r["contender"] == contender.name]
        per_seed[contender.name] = {
            "auc": {r["seed"]: normalized_auc(r, budget) for r in mine},
            "auc_gain": {r["seed"]: normalized_auc(r, budget) - r["avg_at_k"][0] for r in mine},
            **{f"to_{f}": {r["seed"]: completions_to_gain(r, g) for r in mine} for f, g in targets.items()},
        }
    summary: dict[str, Any] = {}
    for contender in contenders:
        mine = [r for r in runs if r["contender"] == contender.name]
        seeds = per_seed[contender.name]
        stats: dict[str, Any] = {
            "name": contender.name,
            "label": contender.label,
            "trainer": contender.trainer,
            "group_size": contender.group_size,
            "overrides": contender.overrides,
            **{key: spread(r[key] for r in mine)["median"] for key in COUNTERS},
            "auc": bootstrap_median(seeds["auc"].values())[0],
            "auc_ci": bootstrap_median(seeds["auc"].values())[1:],
            "auc_gain": bootstrap_median(seeds["auc_gain"].values()),
            "start_avg_at_k": spread(r["avg_at_k"][0] for r in mine),
            "final_avg_at_k": spread(r["avg_at_k"][-1] for r in mine),
            "completions_to_target": {f: bootstrap_median(seeds[f"to_{f}"].values()) for f in targets},
            "reached_target": {f: sum(v is not None for v in seeds[f"to_{f}"].values()) for f in targets},
            "mean_grad_norm": spread(r["mean_grad_norm"] for r in mine),
            "frac_zero_advantage_prompts": spread(r["mean_frac_zero_advantage_prompts"] for r in mine),
            "frac_reward_zero_std": spread(r["mean_frac_reward_zero_std"] for r in mine),
            "train_seconds": spread(r["train_seconds"] for r in mine),
            "paired": {},
            "paired_auc_difference": {},
            "paired_auc_gain_ratio": {},
            "paired_completions_to_target": {},
        }
        if contender.trainer == "poise":
            stats["probe_variance_reduction"] = spread(r["probe_variance_reduction"] for r in mine)
            stats["probe_pearson_r"] = spread(r["probe_pearson_r"] for r in mine)
        for reference in REFERENCES:
            if reference not in per_seed:
                continue
            theirs = per_seed[reference]
            # Paired by seed (same warm start, data and evaluator): the seed-to-seed spread of warm starts cancels.
            stats["paired"][reference] = bootstrap_median(_paired(seeds["auc"], theirs["auc"], "ratio"))
            stats["paired_auc_difference"][reference] = bootstrap_median(
                _paired(seeds["auc"], theirs["auc"], "difference")
            )
            stats["paired_auc_gain_ratio"][reference] = bootstrap_median(
                _paired(seeds["auc_gain"], theirs["auc_gain"], "ratio")
            )
            their_budget = {r["seed"]: r["completions_generated"] for r in runs if r["contender"] == reference}
            stats["paired_completions_to_target"][reference] = {
                f: bootstrap_median(_paired(seeds[f"to_{f}"], theirs[f"to_{f}"], "ratio", their_budget))
                for f in targets
            }
        summary[contender.name] = stats
    return summary


def task_check(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Can this task separate the contenders? The G=8 groups that tie at the start (median over seeds of GRPO-8's
    first steps; the issue asks for >= 25%) and the best final accuracy (no contender may saturate)."""
    first = [_mean(r["per_step"]["frac_reward_zero_std"][:5]) for r in runs if r["contender"] in ("grpo8", "dapo_ds")]
    return {
        "degenerate_g8_groups_at_start": spread(v for v in first if v is not None)["median"],
        "best_final_avg_at_k": max(r["avg_at_k"][-1] for r in runs),
    }


def format_report(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """The table, then the headline."""
    k = settings["eval_k"]
    target = HEADLINE_FRACTION
    headers = [
        "contender",
        "generated / trained",
        "tokens gen.",
        "prefill tok.",
        "fwd rows",
        f"AUC avg@{k} [95% CI]",
        "AUC ratio vs GRPO-8",
        "AUC ratio vs DAPO-DS",
        f"to {target} target vs DAPO-DS",
        f"to {target} target vs RLOO-2",
        f"final avg@{k}",
        "zero-adv prompts",
        "train s",
    ]
    rows = []
    for s in summary.values():
        to_dapo = s["paired_completions_to_target"].get("dapo_ds", {}).get(target)
        to_rloo = s["paired_completions_to_target"].get("rloo2", {}).get(target)
        rows.append(
            [
                s["label"],
                f"{fmt(s['completions_generated'])} / {fmt(s['completions_trained'])}",
                fmt(s["tokens_generated"]),
                fmt(s["prefill_tokens"]),
                fmt(s["forward_rows"]),
                fmt_ci([s["auc"], *s["auc_ci"]]),
                fmt_ci(s["paired"]["grpo8"]) if "grpo8" in s["paired"] else "–",
                fmt_ci(s["paired"]["dapo_ds"]) if "dapo_ds" in s["paired"] else "–",
                fmt_ci(to_dapo, 2) if to_dapo else "–",
                fmt_ci(to_rloo, 2) if to_rloo else "–",
                fmt_spread(s["final_avg_at_k"]),
                fmt_spread(s["frac_zero_advantage_prompts"], 2),
                fmt_spread(s["train_seconds"]),
            ]
        )
    return format_table(headers, rows) + "\n" + headline(summary, settings)


def _verdict(interval: list[float | None], better_below: bool) -> str:
    """Whether a ratio's CI excludes 1, in words."""
    low, high = interval[1], interval[2]
    if low is not None and high is not None and (high < 1 if better_below else low > 1):
        return "wins"
    if low is not None and (low > 1 if better_below else high is not None and high < 1):
        return "loses"
    return "undecided"


def headline(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """One line: each POISE contender against each reference, AUC ratio and completions to the target, with CIs."""
    seeds, budget, target = len(settings["seeds"]), settings["common_budget"], HEADLINE_FRACTION
    parts = []
    for s in summary.values():
        if s["trainer"] != "poise":
            continue
        for reference in REFERENCES:
            if reference not in s["paired"]:
                continue
            auc, gain = s["paired"][reference], s["paired_auc_gain_ratio"][reference]
            to = s["paired_completions_to_target"][reference].get(target, [None] * 3)
            parts.append(
                f"{s['label']} vs {summary[reference]['label']}: AUC ×{fmt_ci(auc)} ({_verdict(auc, False)}; "
                f"above the start ×{fmt_ci(gain, 2)}), completions to the {target} target ×{fmt_ci(to, 2)} "
                f"({_verdict(to, True)})"
            )
    if not parts:
        return f"Summary: no POISE contender or no reference run, so no paired ratios ({seeds} seeds)."
    caution = f" (only {seeds} seeds: a bootstrap CI needs about {MIN_SEEDS_FOR_CI} to mean much)" * (
        seeds < MIN_SEEDS_FOR_CI
    )
    return (
        f"Summary, paired by seed, median [95% bootstrap CI] over {seeds} seeds{caution}, AUC over the first "
        f"{fmt(budget)} "
        "completions generated (ratio > 1: POISE better), completions ratio < 1: POISE needs fewer: "
        + "; ".join(parts)
        + "."
    )


def plot_curves(runs: list[dict[str, Any]], contenders: list[Contender], path: Path, budget: float, k: int) -> Path:
    """Held-out avg@k gain over each seed's start against completions generated (median and min-max over seeds,
    interpolated onto a common grid up to the common budget), and the zero-advantage prompts per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    grid = [budget * i / 50 for i in range(51)]
    for contender in contenders:
        mine = [r for r in runs if r["contender"] == contender.name]
        if not mine:
            continue
        gains = [[interpolate(r["eval_completions"], r["avg_at_k"], x) - r["avg_at_k"][0] for x in grid] for r in mine]
        columns = [spread(column) for column in zip(*gains, strict=True)]
        line = axes[0].plot(grid, [c["median"] for c in columns], label=contender.label)[0]
        if len(mine) > 1:
            axes[0].fill_between(
                grid, [c["min"] for c in columns], [c["max"] for c in columns], color=line.get_color(), alpha=0.1
            )
        zero = [_trailing_mean(r["per_step"]["frac_zero_advantage_prompts"]) for r in mine]
        steps = list(range(1, len(zero[0]) + 1))
        axes[1].plot(steps, [spread(c)["median"] for c in zip(*zero, strict=True)], label=contender.label)
    axes[0].set_title(f"held-out avg@{k} gain over the seed's start (median, min-max over seeds)")
    axes[0].set_xlabel("completions generated")
    axes[1].set_title("prompts with zero advantage (10-step mean, median over seeds)")
    axes[1].set_xlabel("optimizer step")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _trailing_mean(values: list[float | None], window: int = 10) -> list[float]:
    """A per-step metric as a trailing `window`-step mean (a missing value counts 0)."""
    clean = [0.0 if v is None else v for v in values]
    return [sum(clean[max(0, i - window + 1) : i + 1]) / min(window, i + 1) for i in range(len(clean))]


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

"""A collection's inputs from the command line, for `poise-trl probe-bench` and `poise-trl bench gradient`: the
model (a Hub id, the demo's cached warm start, a real model prepared from its package), the prompts and the reward,
read from the arguments `bench.cli.collection.add_collection_arguments` declares; then `collect` samples and
featurizes."""

import argparse
import importlib
import json
from pathlib import Path

import torch

from poise_lab.bench.common import (
    ARITH_DATASET,
    DEFAULT_MATH_DATASET,
    DEMO_MODEL,
    SORT_DATASET,
    TASKS,
    config_default,
    resolve_device,
)
from poise_lab.models.real import is_real_model, prepare_real_model

from .collect import Collection, Log, Prompt, RewardFn, collect, encode_prompt, vllm_generate


def load_reward_fn(spec: str) -> RewardFn:
    """'package.module:function' -> the function (any TRL-style reward)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(
            f"--reward-fn {spec!r}: write MODULE:FUNCTION, e.g. poise_trl.tasks.math_reward:math_answer_reward."
        )
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--reward-fn {spec!r}: {error}") from error


def load_prompts(dataset: str, num_prompts: int, seed: int, split: str | None) -> tuple[list[Prompt], dict[str, list]]:
    """Distinct prompts (duplicates would leak across the split) and the other dataset columns, for the reward."""
    if dataset in TASKS:  # the held-out split the demo model's warm start (same seed and num_eval) never saw
        from poise_lab.tasks.toy import make_splits

        _, rows = make_splits(dataset, num_eval=num_prompts, seed=seed)
    elif dataset == ARITH_DATASET:  # distinct prompts balanced over the default families; no training split needed
        from poise_lab.tasks.arith import make_arith_splits

        _, rows = make_arith_splits(num_train=0, num_eval=num_prompts, seed=seed)
    elif Path(dataset).is_dir():  # a `save_to_disk` folder (a demo's `train`): its prompts as the run trained on them
        from datasets import load_from_disk

        rows = load_from_disk(dataset).shuffle(seed=seed)
    else:
        from poise_trl.tasks.math_data import load_math_dataset

        rows = load_math_dataset(dataset, split=split).shuffle(seed=seed)
    seen, keep = set(), []
    for i, prompt in enumerate(rows["prompt"]):
        key = json.dumps(prompt, sort_keys=True)
        if key not in seen:
            seen.add(key)
            keep.append(i)
        if len(keep) == num_prompts:
            break
    rows = rows.select(keep)
    return list(rows["prompt"]), {c: list(rows[c]) for c in rows.column_names if c != "prompt"}


def _parse_layers(spec: str | None, num_layers: int) -> list[int] | None:
    """'auto' (None: the default sweep), 'all', or comma-separated indices."""
    if spec == "all":
        return list(range(num_layers))
    return _parse_ints(spec)


def _parse_ints(spec: str | None) -> list[int] | None:
    return None if spec in (None, "auto") else [int(v) for v in spec.split(",") if v.strip()]


def collect_from_args(
    args: argparse.Namespace, log: Log, sweep_layers: str | None = "", sweep_pools: str | None = ""
) -> Collection:
    """Resolve the model (the demo's cached warm start for 'demo'), dataset and reward from the collection arguments
    (`add_collection_arguments`), then sample and featurize. `sweep_layers` and `sweep_pools` are the extra captures
    (probe-bench's `--layers`, `--pools`; the default, "", captures the probe's layer and pool only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path, dataset = args.model, args.dataset
    if is_real_model(model_path):
        log(f"[1/4] real model {model_path}: converted once from its package's GGUF, then cached")
        model_path = str(prepare_real_model(model_path, log=log))
        dataset = dataset or ARITH_DATASET
    elif model_path == DEMO_MODEL:
        from poise_lab.models.toy import default_cache_dir, prepare_demo_model

        dataset = args.task or dataset or SORT_DATASET
        if dataset not in TASKS:
            raise SystemExit(f"the demo model is trained on one of {', '.join(TASKS)}, not --dataset {dataset!r}")
        log(f"[1/4] demo model: the tiny Qwen3 warm-started on {dataset} (built on first use, then cached)")
        cache = args.cache_dir or default_cache_dir()
        model_path = str(prepare_demo_model(cache, seed=args.seed, num_eval=args.num_prompts, task=dataset))
    dataset = dataset or DEFAULT_MATH_DATASET
    if args.reward_fn:
        reward_fn = load_reward_fn(args.reward_fn)
    elif dataset in TASKS:
        from poise_lab.tasks.toy import task_reward as reward_fn
    elif dataset == ARITH_DATASET:
        from poise_lab.tasks.arith import arith_reward as reward_fn
    else:
        from poise_trl.tasks.math_reward import math_answer_reward as reward_fn
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        from poise_lab.tasks.arith import ARITH_MAX_COMPLETION_LENGTH
        from poise_lab.tasks.toy import MAX_COMPLETION_LENGTH

        lengths = {**dict.fromkeys(TASKS, MAX_COMPLETION_LENGTH), ARITH_DATASET: ARITH_MAX_COMPLETION_LENGTH}
        max_new_tokens = lengths.get(dataset, 8192)
    device = resolve_device(args.device)
    prompts, columns = load_prompts(dataset, args.num_prompts, args.seed, args.split)
    log(f"[2/4] sampling K={args.k} rollouts for {len(prompts)} prompts of {dataset} with {model_path}")

    from poise_trl.rlvr.avg_at_k import resolve_backend

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    completions = None
    if resolve_backend(args.backend) == "vllm":
        prompt_rows = [encode_prompt(tokenizer, p) for p in prompts]
        completions = vllm_generate(
            model_path,
            prompt_rows,
            args.k,
            args.temperature,
            args.top_p,
            max_new_tokens,
            args.seed,
            args.vllm_gpu_memory_utilization,
        )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    marker = args.reasoning_end_marker or config_default("reasoning_end_marker")
    return collect(
        model,
        tokenizer,
        prompts,
        reward_fn,
        columns,
        k=args.k,
        layers=_parse_layers(sweep_layers, model.config.get_text_config().num_hidden_layers),
        pools=_parse_ints(sweep_pools) or [],
        layer=args.layer,
        pool_tokens=args.pool_tokens or config_default("probe_pool_tokens"),
        reasoning_end_marker=None if marker.lower() == "none" else marker,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=max_new_tokens,
        batch_size=args.batch_size,
        feature_batch_size=args.feature_batch_size,
        seed=args.seed,
        completions=completions,
        meta={"model_name": args.model, "model_path": str(model_path), "dataset": dataset, "device": device},
        log=log,
    )

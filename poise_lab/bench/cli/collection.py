"""The arguments of the benchmarks that sample and featurize rollouts (`probe-bench`, `bench gradient`): what
`bench.value.resolve.collect_from_args` reads."""

import argparse

from poise_lab.models.real import REAL_MODELS

from ..common import ARITH_DATASET, DEFAULT_MATH_DATASET, DEMO_MODEL, SORT_DATASET, TASKS


def add_collection_arguments(parser: argparse.ArgumentParser, num_prompts: int, k: int) -> None:
    """What `collect_from_args` reads: the model, prompts, reward, sampling and feature capture (probe-bench and
    bench gradient sample their rollouts the same way)."""
    add = parser.add_argument
    add(
        "model",
        nargs="?",
        default=DEMO_MODEL,
        help=f"HF model id or path; 'demo': the cached tiny sort model; {', '.join(REAL_MODELS)}: a real model "
        "prepared from its package (dataset: arith)",
    )
    add(
        "--dataset",
        default=None,
        help=f"'{SORT_DATASET}' (the demo task), '{ARITH_DATASET}' (arithmetic chat prompts), a "
        f"poise_trl.tasks.math_data registry name, Hub id or local .jsonl/.parquet (default: {SORT_DATASET} for "
        f"the demo, {ARITH_DATASET} for a real model, else {DEFAULT_MATH_DATASET})",
    )
    add("--split", default=None, help="dataset split of a Hub id (default: the registry's split, else train)")
    add("--task", choices=TASKS, default=None, help="with the demo model: its offline task (default: sort)")
    add("--reward-fn", default=None, help="MODULE:FUNCTION, a TRL reward (default: the task's or math_answer_reward)")
    add("--num-prompts", type=int, default=num_prompts, help="distinct prompts to sample")
    add("--k", type=int, default=k, help="rollouts per prompt")
    add("--temperature", type=float, default=1.0, help="sampling temperature (POISE training samples at 1.0)")
    add("--top-p", type=float, default=1.0, help="nucleus sampling mass (POISE training samples at 1.0)")
    add(
        "--max-new-tokens",
        type=int,
        default=None,
        help="longest completion (default: the demo task's length, else 8192)",
    )
    add("--backend", choices=("auto", "hf", "vllm"), default="auto", help="auto: vLLM if installed, else HF generate")
    add("--vllm-gpu-memory-utilization", type=float, default=0.5, help="vLLM's share; the HF model needs the rest")
    add("--device", default="auto", help="auto: cuda if available, else cpu")
    add("--batch-size", type=int, default=32, help="prompts per HF generate call (each expanded to K samples)")
    add("--feature-batch-size", type=int, default=64, help="rollouts per teacher-forced pass (use ~4 at 8k tokens)")
    add("--layer", type=int, default=None, help="probe layer (default: POISEConfig's, round(0.53 * num_layers))")
    add("--pool-tokens", type=int, default=None, help="pooling window n (default: POISEConfig's, 10)")
    add("--reasoning-end-marker", default=None, help="'none' for no marker (default: POISEConfig's, </think>)")
    add("--seed", type=int, default=0, help="prompt choice, sampling, split, bootstrap and fits")
    add("--cache-dir", default=None, help="demo model cache (default: $XDG_CACHE_HOME/poise-trl)")

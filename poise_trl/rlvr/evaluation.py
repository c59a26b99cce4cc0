"""`poise-trl eval`: the paper's avg@k protocol (Table 1, App. C.3) on its olympiad math benchmarks.

For each problem, k completions are sampled (paper: k = 32, temperature 0.6, top-p 0.95, at most 8192 new tokens)
and scored with the training reward; avg@k is the mean over problems of the per-problem mean reward. vLLM is used
when installed, as in the paper; otherwise HF `generate` runs on whatever device is there.
"""

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from poise_trl.rlvr.avg_at_k import hf_sampler, resolve_backend, score_benchmark, vllm_sampler
from poise_trl.tasks.math_data import DEFAULT_BENCHMARKS, load_math_dataset, resolve_benchmark
from poise_trl.tasks.math_reward import math_answer_reward


def require_model_source(name_or_path: str) -> None:
    """Fail before any loading when a model given as a path does not exist: transformers would instead report a
    malformed Hub repo id. A Hub id is `name` or `namespace/name`; anything else is read as a path."""
    looks_like_path = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1
    if looks_like_path and not Path(name_or_path).expanduser().is_dir():
        raise FileNotFoundError(f"no model directory at {name_or_path}: pass a saved model's folder or a Hub model id")


def evaluate(
    model_name_or_path: str,
    benchmarks: Sequence[str] = DEFAULT_BENCHMARKS,
    k: int = 32,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 8192,
    reward_fn: Callable[..., list[float | None]] = math_answer_reward,
    backend: str = "auto",
    device: str | None = None,
    batch_size: int = 1,
    seed: int = 0,
    limit: int | None = None,
) -> dict[str, Any]:
    """avg@k of a model on each benchmark (registry name, Hub id, local file, or `NAME=PATH`) and their mean.

    The defaults are the paper's protocol. `limit` keeps the first problems of each benchmark (smoke runs);
    `batch_size` (prompts per `generate` call, each expanded to k sequences: 32 x 8k-token caches for one prompt
    already fill tens of GB on a 4B model) and `device` apply to the HF backend only.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    require_model_source(model_name_or_path)
    backend = resolve_backend(backend)
    sources = [resolve_benchmark(b) for b in benchmarks]
    names = [name for name, _ in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark names must be unique, got {names}; name a file with NAME=PATH")
    datasets = {name: load_math_dataset(source, limit=limit) for name, source in sources}
    torch.manual_seed(seed)
    if backend == "vllm":
        sampler = vllm_sampler(model_name_or_path, k, temperature, top_p, max_new_tokens, seed)
    else:
        sampler = hf_sampler(model_name_or_path, k, temperature, top_p, max_new_tokens, device, batch_size)
    results = {
        name: {"source": source, **score_benchmark(sampler, datasets[name], k, reward_fn)} for name, source in sources
    }
    return {
        "model": model_name_or_path,
        "backend": backend,
        "k": k,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "limit": limit,
        "benchmarks": results,
        "mean": sum(r["avg_at_k"] for r in results.values()) / len(results),
    }


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """Paper Table 1 as markdown: one row per result, a column per benchmark (first-seen order), then Avg."""
    columns = list(dict.fromkeys(name for result in results for name in result["benchmarks"]))
    k = results[0]["k"]
    lines = [
        "| Model | " + " | ".join(columns) + " | Avg |",
        "|---|" + "---:|" * (len(columns) + 1),
    ]
    for result in results:
        cells = [f"{result['benchmarks'][c]['avg_at_k']:.3f}" if c in result["benchmarks"] else "–" for c in columns]
        lines.append(f"| {result['model']} | " + " | ".join(cells) + f" | {result['mean']:.3f} |")
    return f"Avg@{k}\n\n" + "\n".join(lines)


def run_eval(args: argparse.Namespace) -> int:
    """Handler of `poise-trl eval`: evaluate, print the table, write the JSON."""
    results = evaluate(
        args.model,
        benchmarks=args.benchmarks,
        k=args.k,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        backend=args.backend,
        device=args.device,
        batch_size=args.batch_size,
        seed=args.seed,
        limit=args.limit,
    )
    print(format_table([results]))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {output}")
    return 0

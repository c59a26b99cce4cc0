"""`poise-trl eval`: the paper's avg@k protocol (Table 1, App. C.3) on its olympiad math benchmarks.

For each problem, k completions are sampled (paper: k = 32, temperature 0.6, top-p 0.95, at most 8192 new tokens)
and scored with the training reward; avg@k is the mean over problems of the per-problem mean reward. vLLM is used
when installed, as in the paper; otherwise HF `generate` runs on whatever device is there.
"""

import argparse
import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from .data import DEFAULT_BENCHMARKS, load_math_dataset, resolve_benchmark
from .rewards import math_answer_reward

Messages = list[dict[str, str]]
# prompts -> k completions per prompt
Sampler = Callable[[list[Messages]], list[list[str]]]
BACKENDS = ("auto", "hf", "vllm")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(backend: str) -> str:
    """`auto` means vLLM when it is installed (the paper's engine), else HF `generate`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "vllm" if vllm_available() else "hf"
    if backend == "vllm" and not vllm_available():
        raise ImportError("backend='vllm' needs vLLM (a CUDA machine): `pip install poise-trl[vllm]`, or use 'hf'")
    return backend


def _decode_completion(tokenizer: Any, ids: list[int], stop_ids: set[int]) -> str:
    """Decode up to the first stop token, keeping special tokens such as `</think>` that the reward relies on."""
    end = next((i for i, token in enumerate(ids) if token in stop_ids), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=False)


def hf_sampler(
    model_name_or_path: str,
    k: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    device: str | None = None,
    batch_size: int = 1,
) -> Sampler:
    """Sample with transformers: `batch_size` prompts per `generate` call, each expanded to k sequences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, padding_side="left")
    if tokenizer.pad_token is None:  # Llama-style tokenizers have none; batching needs one
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        model_name_or_path, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32
    ).to(device)
    model.eval()
    eos = model.generation_config.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.pad_token_id}

    def sample(prompts: list[Messages]) -> list[list[str]]:
        outputs: list[list[str]] = []
        for start in range(0, len(prompts), batch_size):
            texts = [
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                for messages in prompts[start : start + batch_size]
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                sequences = model.generate(
                    **inputs,
                    do_sample=True,
                    temperature=temperature,
                    top_p=top_p,
                    max_new_tokens=max_new_tokens,
                    num_return_sequences=k,
                    pad_token_id=tokenizer.pad_token_id,
                )
            completions = sequences[:, inputs["input_ids"].shape[1] :].tolist()
            texts_out = [_decode_completion(tokenizer, ids, stop_ids) for ids in completions]
            outputs.extend(texts_out[i : i + k] for i in range(0, len(texts_out), k))
        return outputs

    return sample


def vllm_sampler(
    model_name_or_path: str, k: int, temperature: float, top_p: float, max_new_tokens: int, seed: int
) -> Sampler:
    """Sample with vLLM, the paper's engine: one request per prompt with `n=k`."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_name_or_path, seed=seed)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(n=k, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens)

    def sample(prompts: list[Messages]) -> list[list[str]]:
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
        return [[output.text for output in request.outputs] for request in llm.generate(texts, params)]

    return sample


def score_benchmark(
    sampler: Sampler, dataset: Dataset, k: int, reward_fn: Callable[..., list[float | None]]
) -> dict[str, Any]:
    """Sample k completions per problem, score them with `reward_fn` (TRL's calling convention), and average."""
    prompts = list(dataset["prompt"])
    completions = sampler(prompts)
    if [len(c) for c in completions] != [k] * len(prompts):
        raise RuntimeError(f"the sampler must return {k} completions for each of the {len(prompts)} prompts")
    rewards = reward_fn(
        prompts=[p for p in prompts for _ in range(k)],
        completions=[[{"role": "assistant", "content": c}] for group in completions for c in group],
        answer=[a for a in dataset["answer"] for _ in range(k)],
        problem=[p for p in dataset["problem"] for _ in range(k)],
    )
    # A None reward (unparseable ground truth) counts as a wrong sample and is reported.
    per_sample = [[float(r or 0.0) for r in rewards[i * k : (i + 1) * k]] for i in range(len(prompts))]
    per_problem = [sum(group) / k for group in per_sample]
    return {
        "avg_at_k": sum(per_problem) / len(per_problem),
        "pass_at_k": sum(any(group) for group in per_sample) / len(per_sample),
        "num_problems": len(prompts),
        "num_samples": len(prompts) * k,
        "unscored_samples": sum(r is None for r in rewards),
        "per_problem": per_problem,
        "rewards": per_sample,
    }


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

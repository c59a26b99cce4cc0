"""avg@k on any model: k completions per prompt from HF `generate` or vLLM, scored with a TRL-style reward.

vLLM is used when installed, as in the paper; otherwise HF `generate` runs on whatever device is there. `poise-trl
eval` (the paper's protocol on its math benchmarks) and the benchmarks' real-data runs both score through here.
"""

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset

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

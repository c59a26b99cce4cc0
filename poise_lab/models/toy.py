"""The demo's model: the tiny Qwen3 warm-started on the sort task, cached on disk, and its held-out avg@k."""

import json
import os
import random
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from poise_lab.tasks.toy import (
    DEFAULT_DIFFICULTIES,
    DEMO_WARMUP_LR,
    DEMO_WARMUP_STEPS,
    HOPS_DIGITS,
    HOPS_MAX,
    MAX_COMPLETION_LENGTH,
    TASKS,
    make_splits,
    target_completion,
    task_reward,
)
from poise_trl.tiny import build_tiny_model, build_tiny_tokenizer

CACHE_FORMAT = 2  # bump when the task or the warm start changes, so stale caches are rebuilt
WARM_START_FILE = "warm_start.json"  # a cached warm start's settings, written last


def default_cache_dir() -> Path:
    """Where warm-started models are kept between runs: `$XDG_CACHE_HOME/poise-trl` (else `~/.cache/poise-trl`)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "poise-trl"


def _supervised_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], completions: list[str]
) -> dict[str, torch.Tensor]:
    """Left-padded prompt+completion+EOS with the loss on completion tokens only."""
    rows, labels = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + completion_ids)
        labels.append([-100] * len(prompt_ids) + completion_ids)
    width = max(map(len, rows))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    label_ids = torch.tensor([[-100] * (width - len(r)) + r for r in labels])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": label_ids}


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Dataset,
    steps: int = DEMO_WARMUP_STEPS,
    lr: float = DEMO_WARMUP_LR,
    seed: int = 0,
    batch_size: int = 64,
) -> list[float]:
    """Short supervised fine-tuning on target completions, so RL starts from a policy that is right sometimes.

    RL from a random init would see almost no reward; a full SFT would leave nothing for RL to do. The default 100
    steps land sampled accuracy near 0.33, easy prompts mostly right and hard ones mostly wrong. Returns the losses.
    """
    rng = random.Random(seed)
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    reasoning = list(dataset["reasoning"]) if "reasoning" in dataset.column_names else [None] * len(prompts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        rows = [rng.randrange(len(prompts)) for _ in range(batch_size)]
        batch = _supervised_batch(
            tokenizer, [prompts[i] for i in rows], [target_completion(answers[i], reasoning[i]) for i in rows]
        )
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def evaluate_avg_at_k(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Dataset,
    k: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = MAX_COMPLETION_LENGTH,
    batch_size: int = 64,
    seed: int = 0,
    reward: Callable[..., list[float]] = task_reward,
) -> dict[str, Any]:
    """avg@k: sample k completions per prompt (full distribution, no top-k/top-p) and average the rewards.

    Chat prompts (lists of messages) go through the tokenizer's chat template, as TRL renders them. Returns `avg_at_k`
    (mean over prompts of the per-prompt success rate), `per_prompt` rates in dataset order, and `by_difficulty` (mean
    rate per value of the `family` column, else of `k`) to show that difficulty is real. The global RNG is untouched.
    """
    was_training = model.training
    model.eval()
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    texts = [
        p if isinstance(p, str) else tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    rates: list[float] = []
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for start in range(0, len(texts), batch_size):
            inputs = tokenizer(
                texts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,
            )
            sequences = model.generate(
                **inputs.to(model.device),
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=k,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            completions = tokenizer.batch_decode(
                sequences[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            )
            rewards = reward(completions, [a for a in answers[start : start + batch_size] for _ in range(k)])
            rates.extend(sum(rewards[i : i + k]) / k for i in range(0, len(rewards), k))
    model.train(was_training)
    by_difficulty: dict[Any, list[float]] = defaultdict(list)
    groups = dataset["family"] if "family" in dataset.column_names else dataset["k"]
    for group, rate in zip(groups, rates, strict=True):
        by_difficulty[group].append(rate)
    return {
        "avg_at_k": sum(rates) / len(rates),
        "k": k,
        "per_prompt": rates,
        "by_difficulty": {d: sum(v) / len(v) for d, v in by_difficulty.items()},
    }


def prepare_demo_model(
    cache_dir: str | Path,
    seed: int = 0,
    warmup_steps: int = DEMO_WARMUP_STEPS,
    warmup_lr: float = DEMO_WARMUP_LR,
    min_digits: int = DEFAULT_DIFFICULTIES[0],
    max_digits: int = DEFAULT_DIFFICULTIES[1],
    num_train: int = 2000,
    num_eval: int = 140,
    task: str = "sort",
) -> Path:
    """Build the tiny model, warm-start it on `task`'s train split and `save_pretrained` it; reuse a matching cache.

    The splits are built with the caller's `num_eval`, so the warm start never sees a prompt the caller holds out
    (the held-out prompts are drawn first, so their number changes the train split). The cache directory name
    encodes every setting that changes the weights, and `warm_start.json` repeats them, so a different setting never
    silently reuses a stale model. Returns the model directory (tokenizer saved alongside).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if task == "sort":
        shape = {"min_digits": min_digits, "max_digits": max_digits}
    else:
        shape = {"hops": HOPS_MAX, "digits": HOPS_DIGITS}
    settings = {
        "format": CACHE_FORMAT,
        "task": task,
        "seed": seed,
        "warmup_steps": warmup_steps,
        "warmup_lr": warmup_lr,
        **shape,
        "num_train": num_train,
        "num_eval": num_eval,
    }
    name = f"sort{min_digits}-{max_digits}" if task == "sort" else task
    path = Path(cache_dir) / (
        f"{name}_n{num_train}_e{num_eval}_ws{warmup_steps}_lr{warmup_lr:g}_seed{seed}_v{CACHE_FORMAT}"
    )
    if _cached(path, settings):
        return path
    train, _ = make_splits(task, num_train, num_eval, seed, min_digits, max_digits)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    start = time.perf_counter()
    losses = warm_start(model, tokenizer, train, steps=warmup_steps, lr=warmup_lr, seed=seed)
    seconds = time.perf_counter() - start
    # Written to a temporary sibling and renamed into place, as models.real does: concurrent callers (test workers,
    # study processes) never read half a model.
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        final_loss = losses[-1] if losses else None
        info = {"settings": settings, "final_loss": final_loss, "seconds": seconds}
        (scratch / WARM_START_FILE).write_text(json.dumps(info, indent=2))
        if path.exists() and not _cached(path, settings):
            shutil.rmtree(path)  # a stale cache of another format
        try:
            os.replace(scratch, path)
        except OSError:  # another process finished first: its folder is as good as ours
            if not _cached(path, settings):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def _cached(path: Path, settings: dict[str, Any]) -> bool:
    """Whether `path` holds a finished warm start of exactly these settings."""
    info_file = path / WARM_START_FILE
    return info_file.exists() and json.loads(info_file.read_text()).get("settings") == settings


def load_demo_model(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model directory written by `prepare_demo_model` (left padding, as generation needs)."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return AutoModelForCausalLM.from_pretrained(path), tokenizer

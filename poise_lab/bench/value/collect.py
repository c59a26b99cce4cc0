"""Collect rollouts for `poise-trl probe-bench`: sample K per prompt, score them, extract POISE features.

Features come from one teacher-forced pass with the trainer's own feature code, hooking several layers and pooling
windows at once, and everything is saved (`collection.safetensors`) so that scoring can be redone without generation.
The same pass keeps each completion token's entropy and log-probability (`CompletionTokens`, saved beside the
collection), so any rollout scalar can be computed later without the model.
"""

import json
import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, safe_open, save_file

from poise_lab.bench.common import (
    DEFAULT_POOLS,
)
from poise_trl.estimator.buffer import prompt_group_ids
from poise_trl.features.features import (
    FEATURE_BLOCKS,
    FeatureLayout,
    capture_layer,
    feature_spans,
    find_decoder_layers,
    resolve_layer_index,
)

Prompt = str | list[dict[str, str]]
POOL_LAYOUT = FeatureLayout(FEATURE_BLOCKS)  # a collection's stored columns: every block, the paper's three scalars
RewardFn = Callable[..., list[float | None]]
Log = Callable[[str], None]
TOKENS_SUFFIX = ".tokens.safetensors"


def tokens_path(path: str | Path) -> Path:
    """Where a collection file's `CompletionTokens` lie: `pool.safetensors` -> `pool.tokens.safetensors`."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".safetensors") + TOKENS_SUFFIX)


@dataclass
class CompletionTokens:
    """What a rollout scalar reads beyond the feature row, per completion token, from the teacher-forced pass.

    The official release's rollout scalars (holi-lab/POISE: mean, last, max and min token entropy over the output,
    reasoning and answer spans; length and repetition of the decoded text) are functions of these, the collection's
    ids and masks and the library's spans (`features.feature_spans` with `marker_ids`). A file of its own beside the
    collection's, so a pool sampled before it existed gets it from a later pass (`bench pool-tokens`) and its own file
    stays as it was.
    """

    entropies: torch.Tensor  # (N, Lc) float32: TRL's entropy_from_logits of logits / temperature; 0 on padding
    logprobs: torch.Tensor  # (N, Lc) float32: log pi(y_t | x, y_<t) at that temperature; 0 on padding
    texts: list[str]  # each completion decoded with skip_special_tokens=True, as the reward function read it
    marker_ids: list[int] | None  # the reasoning-end marker's token ids (None: no marker)
    source: dict[str, Any]  # the pass they come from and, for a later pass, its check against the stored features

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        meta = {"texts": self.texts, "marker_ids": self.marker_ids, "source": self.source}
        tensors = {"entropies": self.entropies.contiguous(), "logprobs": self.logprobs.contiguous()}
        save_file(tensors, str(path), metadata={"meta": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CompletionTokens":
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["meta"])
        return cls(**load_file(str(path)), **meta)


@dataclass
class Collection:
    """Rollouts of P prompts x K samples, in prompt-major order (a prompt's K rows are consecutive, TRL's layout).

    `features[:, c]` is `POOL_LAYOUT.assemble(...)` for capture c = (layer, pool tokens), i.e.
    [prompt mean | reasoning mean | 3 entropy stats | length]; any block subset is a column selection of it.
    """

    features: torch.Tensor  # (N, C, 2d+4) float32
    rewards: torch.Tensor  # (N,) float32, NaN where the reward function returned None
    prompt_index: torch.Tensor  # (N,) long
    prompt_ids: torch.Tensor  # (P, Lp) left-padded prompt tokens, for the critic
    prompt_mask: torch.Tensor  # (P, Lp)
    completion_ids: torch.Tensor  # (N, Lc) int32 right-padded sampled tokens (EOS included), to inspect or re-score
    completion_mask: torch.Tensor  # (N, Lc)
    meta: dict[str, Any]
    tokens: CompletionTokens | None = None  # None: a collection saved before they were kept (`bench pool-tokens`)

    @property
    def k(self) -> int:
        return int(self.meta["k"])

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.size(0)

    @property
    def captures(self) -> list[tuple[int, int]]:
        return [tuple(c) for c in self.meta["captures"]]

    def columns(self, blocks: Sequence[str], layer: int, pool: int) -> torch.Tensor:
        """(N, D) features of `blocks` at (layer, pool), columns in the order `FeatureLayout(blocks)` lays out."""
        key = (layer, pool)
        if key not in self.captures:
            raise KeyError(f"(layer {layer}, pool {pool}) was not captured; captured: {self.captures}")
        slices = POOL_LAYOUT.slices(self.meta["hidden_size"])
        full = self.features[:, self.captures.index(key)]
        return torch.cat([full[:, slice(*slices[b])] for b in FEATURE_BLOCKS if b in blocks], dim=1)

    def rows(self) -> tuple[list[list[int]], list[list[int]]]:
        """Each rollout's prompt and completion token ids without padding, as they were fed to the pass."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(self.prompt_ids, self.prompt_mask, strict=True)]
        completions = [
            ids[mask.bool()].tolist() for ids, mask in zip(self.completion_ids, self.completion_mask, strict=True)
        ]
        return [prompts[p] for p in self.prompt_index.tolist()], completions

    def save(self, path: str | Path) -> Path:
        """One safetensors file; the metadata (settings, prompt texts) travels as JSON in its header; the
        `CompletionTokens`, when held, in their own file beside it (`tokens_path`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "features": self.features,
            "rewards": self.rewards,
            "prompt_index": self.prompt_index,
            "prompt_ids": self.prompt_ids,
            "prompt_mask": self.prompt_mask,
            "completion_ids": self.completion_ids,
            "completion_mask": self.completion_mask,
        }
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"meta": json.dumps(self.meta)})
        if self.tokens is not None:
            self.tokens.save(tokens_path(path))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Collection":
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["meta"])
        tokens = tokens_path(path)
        tokens = CompletionTokens.load(tokens) if tokens.exists() else None
        return cls(**load_file(str(path)), meta=meta, tokens=tokens)


def default_sweep_layers(num_layers: int, default_layer: int) -> list[int]:
    """All layers of small models; beyond 16 layers the odd ones, as paper Tables 6-7 sweep, plus the default."""
    layers = range(num_layers) if num_layers <= 16 else range(1, num_layers, 2)
    return sorted({*layers, default_layer})


def plan_captures(layers: Sequence[int], pools: Sequence[int], layer: int, pool: int) -> list[tuple[int, int]]:
    """Layer sweep at the default pool, pooling sweep at the default layer: (L + #pools) captures, not L x #pools."""
    captures = [(lay, pool) for lay in sorted({*layers, layer})]
    return captures + [(layer, p) for p in sorted(set(pools)) if p != pool]


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids as TRL builds them: the chat template for conversational prompts, the raw text otherwise."""
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def _trim_completion(ids: list[int], eos_ids: set[int], pad_id: int) -> list[int]:
    """Up to and including the first EOS, as TRL masks completions; an unfinished one loses only its padding."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    while ids and ids[-1] == pad_id:
        ids = ids[:-1]
    return ids


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def _right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(map(len, rows)))
    ids = torch.tensor([list(r) + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids, mask


@torch.no_grad()
def hf_generate(
    model: Any,
    prompt_rows: Sequence[Sequence[int]],
    k: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    pad_id: int,
    eos_ids: set[int],
    batch_size: int,
) -> list[list[int]]:
    """K sampled completions per prompt (full distribution: no top-k), prompt-major, each cut after its EOS."""
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for start in range(0, len(prompt_rows), batch_size):
        ids, mask = _left_pad(prompt_rows[start : start + batch_size], pad_id)
        sequences = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=k,
            pad_token_id=pad_id,
            eos_token_id=sorted(eos_ids),
        )
        out += [_trim_completion(row, eos_ids, pad_id) for row in sequences[:, ids.size(1) :].tolist()]
    return out


def vllm_generate(
    model_name_or_path: str,
    prompt_rows: Sequence[Sequence[int]],
    k: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    gpu_memory_utilization: float,
) -> list[list[int]]:
    """The same sampling with vLLM (token ids in, token ids out); the engine is released before features run."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_name_or_path), seed=seed, gpu_memory_utilization=gpu_memory_utilization)
    params = SamplingParams(n=k, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed)
    requests = llm.generate([{"prompt_token_ids": list(r)} for r in prompt_rows], params)
    out = [list(o.token_ids) for request in requests for o in request.outputs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


@torch.no_grad()
def extract_features(
    model: Any,
    prompt_rows: Sequence[Sequence[int]],
    completion_rows: Sequence[Sequence[int]],
    captures: Sequence[tuple[int, int]],
    marker_ids: Sequence[int] | None,
    pad_id: int,
    temperature: float = 1.0,
    batch_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, C, 2d+4) POISE features of every (layer, pool) capture from ONE teacher-forced pass per batch, and the
    (N, Lc) entropy and log-probability of every completion token in that pass (0 on padding; Lc the longest row).

    Padding matches TRL (prompts left, completions right, completions ending with their EOS); spans, hooks, pooling and
    assembly are `poise_trl.features.features`, exactly what `POISETrainer` runs. Several `capture_layer` hooks, one
    per capture, share the pass; entropies are TRL's `entropy_from_logits` of logits / temperature, as in the log-prob
    pass whose entropies the trainer uses, and log-probabilities TRL's `selective_log_softmax` of the same logits.
    """
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    layers = find_decoder_layers(model)
    device = next(model.parameters()).device
    pools = sorted({pool for _, pool in captures})
    width = max(1, max(map(len, completion_rows)))
    out, entropy_rows, logprob_rows = [], [], []
    for start in range(0, len(prompt_rows), batch_size):
        prompt_ids, prompt_mask = _left_pad(prompt_rows[start : start + batch_size], pad_id)
        completion_ids, completion_mask = _right_pad(completion_rows[start : start + batch_size], pad_id)
        spans = {p: feature_spans(prompt_mask, completion_ids, completion_mask, p, marker_ids) for p in pools}
        with ExitStack() as stack:
            grabs = [stack.enter_context(capture_layer(layers[lay], spans[p])) for lay, p in captures]
            logits = model(
                input_ids=torch.cat([prompt_ids, completion_ids], 1).to(device),
                attention_mask=torch.cat([prompt_mask, completion_mask], 1).to(device),
                logits_to_keep=completion_ids.size(1) + 1,
            ).logits[:, :-1]
        entropies = entropy_from_logits(logits.div_(temperature)).float().cpu()
        logprobs = selective_log_softmax(logits, completion_ids.to(device)).float().cpu()
        rows = [
            POOL_LAYOUT.assemble(grab.pooled().cpu(), entropies, spans[p])
            for grab, (_, p) in zip(grabs, captures, strict=True)
        ]
        out.append(torch.stack(rows, dim=1))
        pad, valid = (0, width - completion_ids.size(1)), completion_mask.bool()
        entropy_rows.append(torch.nn.functional.pad(torch.where(valid, entropies, 0.0), pad))
        logprob_rows.append(torch.nn.functional.pad(torch.where(valid, logprobs, 0.0), pad))
    return torch.cat(out), torch.cat(entropy_rows), torch.cat(logprob_rows)


def marker_token_ids(tokenizer: Any, reasoning_end_marker: str | None) -> list[int] | None:
    """The marker's token ids as the trainer finds it in completions (None without a marker)."""
    if reasoning_end_marker is None:
        return None
    marker_ids = tokenizer(reasoning_end_marker, add_special_tokens=False)["input_ids"]
    if not marker_ids:
        raise ValueError(f"reasoning_end_marker={reasoning_end_marker!r} tokenizes to no tokens.")
    return marker_ids


def _prompt_text(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def collect(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    reward_fn: RewardFn,
    columns: dict[str, Sequence[Any]] | None = None,
    k: int = 8,
    layers: Sequence[int] | None = None,
    pools: Sequence[int] = DEFAULT_POOLS,
    layer: int | None = None,
    pool_tokens: int = 10,
    reasoning_end_marker: str | None = "</think>",
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    feature_batch_size: int = 64,
    seed: int = 0,
    completions: Sequence[Sequence[int]] | None = None,
    meta: dict[str, Any] | None = None,
    log: Log = print,
) -> Collection:
    """Sample K rollouts per prompt (or take `completions`, e.g. from vLLM), score them, extract features.

    `reward_fn` follows TRL's convention (`prompts`, `completions`, `completion_ids` and the dataset `columns`, one
    entry per rollout); a None reward becomes NaN and its row is left out of targets and scores.
    """
    if k < 2:
        raise ValueError(f"k={k}: leave-one-out targets need at least 2 rollouts per prompt.")
    num_layers = len(find_decoder_layers(model))
    layer = resolve_layer_index(layer, num_layers)
    sweep = (
        default_sweep_layers(num_layers, layer)
        if layers is None
        else [resolve_layer_index(x, num_layers) for x in layers]
    )
    captures = plan_captures(sweep, pools, layer, pool_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else []
    eos_ids = (set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}) - {None}
    marker_ids = marker_token_ids(tokenizer, reasoning_end_marker)

    prompt_rows = [encode_prompt(tokenizer, p) for p in prompts]
    model.eval()
    start = time.perf_counter()
    if completions is None:
        torch.manual_seed(seed)
        completions = hf_generate(
            model, prompt_rows, k, temperature, top_p, max_new_tokens, pad_id, eos_ids, batch_size
        )
    completions = [_trim_completion(list(c), eos_ids, pad_id) for c in completions]
    if len(completions) != k * len(prompts):
        raise ValueError(f"got {len(completions)} completions for {len(prompts)} prompts x k={k}")
    generation_s = time.perf_counter() - start
    log(f"      sampled {len(completions)} rollouts in {generation_s:.1f}s")

    start = time.perf_counter()
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    conversational = not isinstance(prompts[0], str)
    repeated = {name: [v for v in values for _ in range(k)] for name, values in (columns or {}).items()}
    raw = reward_fn(
        prompts=[p for p in prompts for _ in range(k)],
        completions=[[{"role": "assistant", "content": t}] for t in texts] if conversational else texts,
        completion_ids=completions,
        **repeated,
    )
    rewards = torch.tensor([math.nan if r is None else float(r) for r in raw], dtype=torch.float32)
    reward_s = time.perf_counter() - start

    start = time.perf_counter()
    features, entropies, logprobs = extract_features(
        model,
        [r for r in prompt_rows for _ in range(k)],
        completions,
        captures,
        marker_ids,
        pad_id,
        temperature,
        feature_batch_size,
    )
    feature_s = time.perf_counter() - start
    log(f"      features of {len(captures)} (layer, pool) captures in one pass per batch: {feature_s:.1f}s")
    prompt_ids, prompt_mask = _left_pad(prompt_rows, pad_id)
    completion_ids, completion_mask = _right_pad(completions, pad_id)
    config = model.config.get_text_config()
    return Collection(
        features=features,
        rewards=rewards,
        prompt_index=torch.arange(len(prompts)).repeat_interleave(k),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids.int(),
        completion_mask=completion_mask.bool(),
        meta={
            "model_name": getattr(model.config, "_name_or_path", ""),
            **(meta or {}),
            "k": k,
            "hidden_size": config.hidden_size,
            "num_layers": num_layers,
            "default_layer": layer,
            "default_pool": pool_tokens,
            "captures": [list(c) for c in captures],
            "feature_blocks": list(FEATURE_BLOCKS),
            "reasoning_end_marker": reasoning_end_marker,
            "temperature": temperature,
            "top_p": top_p,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
            "mean_completion_tokens": sum(map(len, completions)) / len(completions),
            "seconds": {"generation": generation_s, "reward": reward_s, "features": feature_s},
            "prompts": [_prompt_text(p) for p in prompts],
            "prompt_keys": prompt_group_ids(list(prompts)).tolist(),  # the trainer's ids: a run's history reads them
        },
        tokens=CompletionTokens(entropies, logprobs, texts, marker_ids, {"pass": "the features' own"}),
    )

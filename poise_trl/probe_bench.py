"""`poise-trl probe-bench`: will POISE work on my model? The paper's value-prediction benchmark in one command.

1. Collect: sample K rollouts per prompt, score them with the reward, and extract POISE features in one
   teacher-forced pass with the trainer's own feature code, hooking several layers and pooling windows at once.
   Everything is saved (`collection.safetensors`), so fitting can be redone without generation.
2. Split by prompt into train and held-out prompts; a held-out prompt's target is its empirical avg@K.
3. Fit every estimator on the train rows with the trainer's leave-one-out target and score the mean of its
   predictions over each held-out prompt's rollouts: MAE and Pearson r with bootstrap CIs over prompts, and the
   variance reduction it would give as a cross-rollout baseline. Estimators: the POISE probe (release and paper
   presets), feature ablations (paper Table 3), a layer sweep (Tables 6-7), pooling windows (Tables 8-9), MLP probes
   (Table 10), an SPPO-style critic (App. D.1) and trivial references.
4. Report markdown tables in the paper's layout, `results.json`, and `figure1.png` (probe vs critic, paper Fig. 1).
"""

import argparse
import importlib
import json
import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, safe_open, save_file

from .baselines import baseline_diagnostics, cross_rollout_baselines, leave_one_out_targets
from .features import (
    FEATURE_BLOCKS,
    assemble_features,
    block_slices,
    capture_layer,
    feature_spans,
    find_decoder_layers,
    layer_candidates,
    pca_blocks,
    resolve_layer_index,
)
from .probe import ValueProbe, choose_layer, grouped_kfold_errors

DEMO_MODEL = "demo"
SORT_DATASET = "sort"
DEFAULT_MATH_DATASET = "DAPO-Math-17k-en"
COLLECTION_FILE = "collection.safetensors"
RESULTS_FILE = "results.json"
REPORT_FILE = "results.md"
FIGURE_FILE = "figure1.png"
DEFAULT_POOLS = (5, 10, 15)
# Depth x width, a CPU-sized slice of paper Table 10's grid (3x512 alone costs ~40 s on 2 cores for 2k rows); on a
# GPU machine pass the paper's "1x512,3x512,5x512,7x512,9x512,3x1024,5x1024".
DEFAULT_MLPS = "1x128,3x128,1x512,3x512"
ABLATIONS = (  # paper Table 3; `run_benchmark` adds the full set, with and without response length
    ("prompt hidden states only", ("prompt",)),
    ("reasoning hidden states only", ("reasoning",)),
    ("entropy statistics only", ("entropy",)),
    ("response length only", ("length",)),
)
Prompt = str | list[dict[str, str]]
RewardFn = Callable[..., list[float | None]]
Log = Callable[[str], None]


# ----------------------------------------------------------------------------------------------------- collection
@dataclass
class Collection:
    """Rollouts of P prompts x K samples, in prompt-major order (a prompt's K rows are consecutive, TRL's layout).

    `features[:, c]` is `assemble_features(FEATURE_BLOCKS, ...)` for capture c = (layer, pool tokens), i.e.
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
        """(N, D) features of `blocks` at (layer, pool), columns in the order `assemble_features(blocks)` uses."""
        key = (layer, pool)
        if key not in self.captures:
            raise KeyError(f"(layer {layer}, pool {pool}) was not captured; captured: {self.captures}")
        slices = block_slices(FEATURE_BLOCKS, self.meta["hidden_size"])
        full = self.features[:, self.captures.index(key)]
        return torch.cat([full[:, slice(*slices[b])] for b in FEATURE_BLOCKS if b in blocks], dim=1)

    def save(self, path: str | Path) -> Path:
        """One safetensors file; the metadata (settings, prompt texts) travels as JSON in its header."""
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
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Collection":
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["meta"])
        return cls(**load_file(str(path)), meta=meta)


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
) -> torch.Tensor:
    """(N, C, 2d+4) POISE features of every (layer, pool) capture from ONE teacher-forced pass per batch.

    Padding matches TRL (prompts left, completions right, completions ending with their EOS); spans, hooks, pooling
    and assembly are `poise_trl.features`, exactly what `POISETrainer` runs. Several `capture_layer` hooks, one per
    capture, share the pass; entropies are TRL's `entropy_from_logits` of logits / temperature, as in the log-prob
    pass whose entropies the trainer uses.
    """
    from trl.trainer.utils import entropy_from_logits

    layers = find_decoder_layers(model)
    device = next(model.parameters()).device
    pools = sorted({pool for _, pool in captures})
    out = []
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
        rows = [
            assemble_features(FEATURE_BLOCKS, grab.pooled().cpu(), entropies, spans[p])
            for grab, (_, p) in zip(grabs, captures, strict=True)
        ]
        out.append(torch.stack(rows, dim=1))
    return torch.cat(out)


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
    marker_ids = None
    if reasoning_end_marker is not None:
        marker_ids = tokenizer(reasoning_end_marker, add_special_tokens=False)["input_ids"]
        if not marker_ids:
            raise ValueError(f"reasoning_end_marker={reasoning_end_marker!r} tokenizes to no tokens.")

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
    features = extract_features(
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
            **(meta or {}),
            "model_name": getattr(model.config, "_name_or_path", ""),
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
        },
    )


# ------------------------------------------------------------------------------------------------ split and score
def split_by_prompt(num_prompts: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Disjoint sorted (train, held-out) prompt indices; every rollout of a prompt goes where its prompt goes."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction={test_fraction} must be in (0, 1).")
    n_test = min(num_prompts - 2, max(2, round(test_fraction * num_prompts)))
    if n_test < 2:
        raise ValueError(f"{num_prompts} prompts are too few to hold out at least 2 and train on at least 2.")
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed))
    return order[n_test:].sort().values, order[:n_test].sort().values


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else math.nan


def _bootstrap_ci(pred: np.ndarray, target: np.ndarray, index: np.ndarray) -> tuple[list[float], list[float]]:
    """95% percentile intervals of MAE and Pearson r over resampled held-out prompts (`index`: (B, P))."""
    x, y = pred[index], target[index]
    mae = np.abs(x - y).mean(1)
    xc, yc = x - x.mean(1, keepdims=True), y - y.mean(1, keepdims=True)
    den = np.sqrt((xc * xc).sum(1) * (yc * yc).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(den > 0, (xc * yc).sum(1) / den, np.nan)
    return _percentile_ci(mae), _percentile_ci(r)


def _percentile_ci(samples: np.ndarray) -> list[float]:
    if not np.isfinite(samples).any():
        return [math.nan, math.nan]
    return [float(q) for q in np.nanpercentile(samples, [2.5, 97.5])]


class ValueBenchmark:
    """Train/held-out rows of one collection, the trainer's leave-one-out targets, and the scoring of estimators."""

    def __init__(
        self,
        collection: Collection,
        test_fraction: float = 0.25,
        seed: int = 0,
        n_bootstrap: int = 1000,
        vr_group_size: int = 2,
    ):
        if not 2 <= vr_group_size <= collection.k:
            raise ValueError(f"vr_group_size={vr_group_size} must be in [2, k={collection.k}].")
        self.collection, self.seed, self.vr_group_size = collection, seed, vr_group_size
        self.train_prompts, self.test_prompts = split_by_prompt(collection.num_prompts, test_fraction, seed)
        index = collection.prompt_index
        self.train_rows = torch.isin(index, self.train_prompts)
        self.test_rows = torch.isin(index, self.test_prompts)
        rewards = collection.rewards
        # φ_i's target is the mean reward of the OTHER rollouts of its prompt: never its own (paper §3).
        self.targets = leave_one_out_targets(rewards, collection.k, torch.isfinite(rewards))
        # As the trainer's buffer: rows with their own reward and at least one scored partner.
        self.fit_rows = self.train_rows & torch.isfinite(rewards) & torch.isfinite(self.targets)
        self.test_rewards = rewards[self.test_rows].view(-1, collection.k).double()
        self.avg_at_k = self.test_rewards.nanmean(1).numpy()
        self.scored = np.isfinite(self.avg_at_k)
        p = int(self.scored.sum())
        self.bootstrap_index = np.random.default_rng(seed).integers(0, p, size=(n_bootstrap, p))
        self.train_prompt_values = rewards[self.train_rows].view(-1, collection.k).nanmean(1)

    def x(self, blocks: Sequence[str], layer: int | None = None, pool: int | None = None) -> torch.Tensor:
        meta = self.collection.meta
        layer = meta["default_layer"] if layer is None else layer
        pool = meta["default_pool"] if pool is None else pool
        return self.collection.columns(blocks, layer, pool)

    def variance_reduction(self, values: torch.Tensor | None) -> float:
        """1 - Var(r - b)/Var(r) on held-out rollouts split into groups of `vr_group_size`, b the cross-rollout
        baseline of `values` (None: the RLOO baseline, mean reward of the other rollouts of the group)."""
        g, k = self.vr_group_size, self.collection.k
        used = (k // g) * g
        r = self.test_rewards[:, :used].reshape(-1)
        if values is None:
            v = torch.full_like(r, math.nan)
            b = leave_one_out_targets(r, g)
        else:
            v = values.double().view(-1, k)[:, :used].reshape(-1)
            b = cross_rollout_baselines(v, g)
        return float(baseline_diagnostics(r, b, v, g)["variance_reduction"])

    def score(self, name: str, values: torch.Tensor | None, seconds: float = math.nan, **info: Any) -> dict[str, Any]:
        """Scores of per-rollout held-out predictions `values` (prompt-major); None scores only the RLOO row."""
        row: dict[str, Any] = {"name": name, **info, "fit_seconds": seconds, "variance_reduction": math.nan}
        row.update(mae=math.nan, mae_ci=[math.nan] * 2, pearson_r=math.nan, pearson_r_ci=[math.nan] * 2)
        row["variance_reduction"] = self.variance_reduction(values)
        if values is None:
            return row
        per_prompt = values.double().view(-1, self.collection.k).mean(1).numpy()[self.scored]
        target = self.avg_at_k[self.scored]
        mae_ci, r_ci = _bootstrap_ci(per_prompt, target, self.bootstrap_index)
        row.update(mae=float(np.abs(per_prompt - target).mean()), mae_ci=mae_ci)
        row.update(pearson_r=pearson(per_prompt, target), pearson_r_ci=r_ci)
        row["per_prompt_prediction"] = [float(v) for v in per_prompt]
        return row

    # ---------------------------------------------------------------------------------------------- estimators
    def preset_probe(self, blocks: Sequence[str], preset: str) -> ValueProbe:
        """An unfitted `ValueProbe` built as the trainer builds it from a preset (clip='observed')."""
        from .config import PROBE_PRESETS

        alpha, dims = PROBE_PRESETS[preset]
        return ValueProbe(alpha=alpha, pca_dims=pca_blocks(blocks, self.collection.meta["hidden_size"], dims))

    def probe(self, x: torch.Tensor, probe: ValueProbe) -> torch.Tensor:
        """Fit `probe` on the train rows' leave-one-out targets and predict the held-out rows."""
        probe.fit(x[self.fit_rows], self.targets[self.fit_rows])
        return probe.predict(x[self.test_rows])

    def probe_preset(self, blocks: Sequence[str], preset: str, layer: int | None = None, pool: int | None = None):
        return self.probe(self.x(blocks, layer, pool), self.preset_probe(blocks, preset))

    def auto_layer(
        self, blocks: Sequence[str], preset: str, candidates: Sequence[int], folds: int, margin: float
    ) -> tuple[int, list[float]] | None:
        """The layer `probe_layer="auto"` would settle on from the train rows, by the trainer's own rule: each
        candidate's prompt-grouped K-fold MAE, starting from the candidate nearest the default layer, with hysteresis.
        Returns (layer, cross-validated MAE per candidate), or None with too few train prompts for K folds."""
        x = torch.stack([self.x(blocks, layer)[self.fit_rows] for layer in candidates], dim=1)
        groups = self.collection.prompt_index[self.fit_rows]
        errors = grouped_kfold_errors(self.preset_probe(blocks, preset), x, self.targets[self.fit_rows], groups, folds)
        if errors is None:
            return None
        mae = errors.mean(1)
        default = self.collection.meta["default_layer"]
        current = min(range(len(candidates)), key=lambda i: abs(candidates[i] - default))
        return candidates[choose_layer(mae, current, margin)], mae.tolist()

    def mlp(self, x: torch.Tensor, depth: int, width: int) -> torch.Tensor:
        """StandardScaler + sklearn MLP (ReLU, Adam, L2, early stopping), clipped to the observed target range."""
        from sklearn.neural_network import MLPRegressor
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        y = self.targets[self.fit_rows].numpy()
        model = make_pipeline(
            StandardScaler(),
            MLPRegressor(
                hidden_layer_sizes=(width,) * depth,
                early_stopping=True,
                max_iter=200,
                random_state=self.seed,
            ),
        )
        model.fit(x[self.fit_rows].numpy(), y)
        return torch.from_numpy(model.predict(x[self.test_rows].numpy()).clip(y.min(), y.max())).float()

    def train_mean(self) -> torch.Tensor:
        return torch.full((int(self.test_rows.sum()),), self.targets[self.fit_rows].mean().item())

    def critic(
        self,
        model_name_or_path: str | Path,
        device: str,
        epochs: int,
        lr: float | None,
        batch_size: int,
    ) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """SPPO-style critic (paper App. D.1) trained on the train prompts' rewards; one value per held-out prompt."""
        from .critic import load_critic, predict_critic, train_critic

        torch.manual_seed(self.seed)
        c = self.collection
        values = self.train_prompt_values
        keep = torch.isfinite(values)
        critic = load_critic(model_name_or_path, device, init_value=float(values[keep].mean()))
        train = self.train_prompts[keep]
        history = train_critic(
            critic, c.prompt_ids[train], c.prompt_mask[train], values[keep], epochs, lr, batch_size, seed=self.seed
        )
        predictions = predict_critic(critic, c.prompt_ids[self.test_prompts], c.prompt_mask[self.test_prompts])
        del critic
        return predictions.repeat_interleave(c.k), history


def _timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    values = fn()
    return values, time.perf_counter() - start


def parse_mlps(spec: str) -> list[tuple[int, int]]:
    """'1x512,3x1024' -> [(1, 512), (3, 1024)] (depth x width, paper Table 10's naming)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        depth, _, width = item.lower().partition("x")
        if not (depth.isdigit() and width.isdigit() and int(depth) > 0 and int(width) > 0):
            raise ValueError(f"MLP spec {item!r}: write DEPTHxWIDTH, e.g. 3x512")
        out.append((int(depth), int(width)))
    return out


def run_benchmark(
    collection: Collection,
    features: Sequence[str] = ("prompt", "reasoning", "entropy"),
    preset: str = "release",
    test_fraction: float = 0.25,
    seed: int = 0,
    n_bootstrap: int = 1000,
    vr_group_size: int = 2,
    mlps: Sequence[tuple[int, int]] = (),
    critic: dict[str, Any] | None = None,
    log: Log = print,
) -> dict[str, Any]:
    """Fit and score every estimator; returns the JSON-able results (sections of rows, settings, timings).

    `preset` is the probe used by the ablation, sweep and architecture sections; `critic` holds the keyword
    arguments of `ValueBenchmark.critic` (model path, device, epochs, lr, batch size), or None to skip it.
    """
    from .config import PROBE_PRESETS

    if preset not in PROBE_PRESETS:
        raise ValueError(f"preset={preset!r}: choose one of {list(PROBE_PRESETS)}")
    bench = ValueBenchmark(collection, test_fraction, seed, n_bootstrap, vr_group_size)
    meta, blocks = collection.meta, [b for b in FEATURE_BLOCKS if b in features]
    layer, pool = meta["default_layer"], meta["default_pool"]
    sections: dict[str, list[dict[str, Any]]] = {}
    sweep = dict(features=blocks, preset=preset)

    log(f"[3/4] fitting on {len(bench.train_prompts)} prompts, scoring {len(bench.test_prompts)} held-out prompts")
    main = []
    for name in PROBE_PRESETS:
        values, s = _timed(lambda name=name: bench.probe_preset(blocks, name))
        main.append(bench.score(f"POISE probe ({name} preset)", values, s, layer=layer, pool=pool, **sweep))
    critic_history = None
    if critic is not None:
        (values, critic_history), s = _timed(lambda: bench.critic(**critic))
        main.append(bench.score("Critic (policy backbone + value head, BCE)", values, s))
    main.append(bench.score("Train mean", *_timed(bench.train_mean)))
    length = bench.x(["length"])
    main.append(bench.score("Response length (linear)", *_timed(lambda: bench.probe(length, ValueProbe(alpha=1e-6)))))
    main.append(bench.score(f"RLOO, G={vr_group_size} (reward of the other rollouts; VR only)", None))
    sections["Probe vs critic"] = main
    log("      presets, critic and references done")

    ablations = []
    for label, subset in (*ABLATIONS, ("full", tuple(blocks)), ("full + response length", (*blocks, "length"))):
        subset = [b for b in FEATURE_BLOCKS if b in subset]
        values, s = _timed(lambda subset=subset: bench.probe_preset(subset, preset))
        ablations.append(bench.score(label, values, s, features=subset, preset=preset))
    sections["Feature ablation"] = ablations

    layers = sorted({lay for lay, p in collection.captures if p == pool})
    sections["Layer sweep"] = [
        bench.score(
            f"{lay}" + (" (default)" if lay == layer else ""),
            *_timed(lambda lay=lay: bench.probe_preset(blocks, preset, lay)),
            layer=lay,
            pool=pool,
            **sweep,
        )
        for lay in layers
    ]
    candidates = [lay for lay in layer_candidates(None, meta["num_layers"]) if lay in layers]
    folds, margin = _config_default("probe_layer_folds"), _config_default("probe_layer_switch_margin")
    start = time.perf_counter()
    auto = bench.auto_layer(blocks, preset, candidates, folds, margin) if len(candidates) > 1 else None
    if auto is not None:
        chosen, cv_mae = auto
        sections["Layer sweep"].append(
            bench.score(
                f"auto: {chosen} of {candidates}",
                bench.probe_preset(blocks, preset, chosen),
                time.perf_counter() - start,
                layer=chosen,
                pool=pool,
                candidates=candidates,
                cv_mae=cv_mae,
                **sweep,
            )
        )
    pools = sorted({p for lay, p in collection.captures if lay == layer})
    sections["Pooling window"] = [
        bench.score(
            f"last {p}" + (" (default)" if p == pool else ""),
            *_timed(lambda p=p: bench.probe_preset(blocks, preset, layer, p)),
            layer=layer,
            pool=p,
            **sweep,
        )
        for p in pools
    ]
    log("      ablations and sweeps done")

    x = bench.x(blocks)
    arch = [bench.score(f"Linear ridge ({preset} preset)", *_timed(lambda: bench.probe_preset(blocks, preset)))]
    for depth, width in mlps:
        values, s = _timed(lambda d=depth, w=width: bench.mlp(x, d, w))
        arch.append(bench.score(f"MLP {depth}x{width}", values, s, depth=depth, width=width))
    sections["Probe architecture"] = arch

    return {
        "collection": {
            "num_prompts": collection.num_prompts,
            "k": collection.k,
            "train_prompts": len(bench.train_prompts),
            "held_out_prompts": len(bench.test_prompts),
            "mean_reward": float(collection.rewards.nanmean()),
            "unscored_rollouts": int((~torch.isfinite(collection.rewards)).sum()),
            "held_out_avg_at_k": [float(v) for v in bench.avg_at_k[bench.scored]],
            "held_out_prompt_index": bench.test_prompts[torch.from_numpy(bench.scored)].tolist(),
            **{k: v for k, v in meta.items() if k != "prompts"},
        },
        "settings": {
            "features": blocks,
            "preset": preset,
            "test_fraction": test_fraction,
            "seed": seed,
            "n_bootstrap": n_bootstrap,
            "vr_group_size": vr_group_size,
            "mlps": [list(m) for m in mlps],
            "critic": None if critic is None else {k: str(v) for k, v in critic.items()},
        },
        "critic_history": critic_history,
        "sections": sections,
    }


# ----------------------------------------------------------------------------------------------------- reporting
SECTION_TITLES = {
    "Probe vs critic": "Value prediction on held-out prompts (paper Fig. 1, Table 2)",
    "Feature ablation": "Input features (paper Table 3)",
    "Layer sweep": "Layer (paper Tables 6-7; 'auto': the layer probe_layer='auto' picks from the train rows)",
    "Pooling window": "Pooling window (paper Tables 8-9)",
    "Probe architecture": "Probe architecture (paper Table 10)",
}
FIRST_COLUMN = {
    "Probe vs critic": "Estimator",
    "Feature ablation": "Input feature",
    "Layer sweep": "Layer",
    "Pooling window": "Pooling window",
    "Probe architecture": "Probe architecture",
}


def _num(value: float, fmt: str = "{:.3f}") -> str:
    return fmt.format(value) if isinstance(value, int | float) and math.isfinite(value) else "–"


def _ci(ci: Sequence[float]) -> str:
    return f"[{_num(ci[0])}, {_num(ci[1])}]" if all(math.isfinite(v) for v in ci) else "–"


def format_report(results: dict[str, Any]) -> str:
    """Markdown: a header with the setting, then one table per section (MAE, r with 95% CIs, VR, fit time)."""
    c, s = results["collection"], results["settings"]
    avg = float(np.mean(c["held_out_avg_at_k"]))
    lines = [
        f"# probe-bench: {c['model_name']} on {c.get('dataset', '?')}",
        "",
        f"{c['num_prompts']} prompts x K={c['k']} rollouts; {c['train_prompts']} train / {c['held_out_prompts']} "
        f"held-out prompts; mean held-out avg@{c['k']} {avg:.3f}. Features {'+'.join(s['features'])}, layer "
        f"{c['default_layer']} of {c['num_layers']}, last-{c['default_pool']} pooling; sweeps use the "
        f"{s['preset']} preset. MAE and r compare each held-out prompt's mean prediction with its avg@{c['k']} "
        f"(95% bootstrap CIs over prompts); VR = 1 - Var(r - b)/Var(r) with b the cross-rollout baseline at "
        f"G={s['vr_group_size']}.",
    ]
    for key, rows in results["sections"].items():
        lines += [
            "",
            f"### {SECTION_TITLES[key]}",
            "",
            f"| {FIRST_COLUMN[key]} | MAE ↓ | 95% CI | Pearson r ↑ | 95% CI | VR ↑ | fit s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            name = "+".join(row["features"]) if key == "Feature ablation" and row["name"] == "full" else row["name"]
            lines.append(
                f"| {name} | {_num(row['mae'])} | {_ci(row['mae_ci'])} | {_num(row['pearson_r'])} | "
                f"{_ci(row['pearson_r_ci'])} | {_num(row['variance_reduction'], '{:+.3f}')} | "
                f"{_num(row['fit_seconds'], '{:.2f}')} |"
            )
    return "\n".join(lines)


def plot_figure1(results: dict[str, Any], path: str | Path) -> Path:
    """Paper Fig. 1: held-out avg@K against each main estimator's prediction, one panel per estimator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = results["collection"]["held_out_avg_at_k"]
    rows = [r for r in results["sections"]["Probe vs critic"] if "per_prompt_prediction" in r][:3]
    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        ax.scatter(row["per_prompt_prediction"], target, s=12, alpha=0.6)
        ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
        ax.set(xlim=(-0.05, 1.05), ylim=(-0.05, 1.05), xlabel="predicted value", ylabel="held-out avg@K")
        ax.set_title(f"{row['name']}\nr={_num(row['pearson_r'])}  MAE={_num(row['mae'])}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def export_probe(collection: Collection, features: Sequence[str], path: str | Path) -> Path:
    """Refit the release-preset probe on EVERY prompt's rollouts (all data helps a warm start) and write it as
    `POISETrainer.save_probe` does (one-probe set, `_probe_metadata()` fields, no buffer), so that
    `POISEConfig(probe_init_path=path)` with the same layer, pooling, features and marker warm-starts from it."""
    from .config import PROBE_PRESETS
    from .probe import OnlineProbe, save_probe_set
    from .trainer import DEFAULT_DOMAIN

    meta, blocks = collection.meta, [b for b in FEATURE_BLOCKS if b in features]
    layer = meta["default_layer"]
    x = collection.columns(blocks, layer, meta["default_pool"])
    scored = torch.isfinite(collection.rewards)
    targets = leave_one_out_targets(collection.rewards, collection.k, scored)
    rows = scored & torch.isfinite(targets)
    alpha, dims = PROBE_PRESETS["release"]
    probe = ValueProbe(alpha=alpha, pca_dims=pca_blocks(blocks, meta["hidden_size"], dims), clip="observed")
    probe.fit(x[rows], targets[rows])
    metadata = {
        "feature_config": {
            "probe_layer": layer,
            "probe_layer_candidates": [layer],
            "probe_pool_tokens": meta["default_pool"],
            "probe_features": blocks,
            "reasoning_end_marker": meta["reasoning_end_marker"],
            "hidden_size": meta["hidden_size"],
        },
        "probe_domain_column": None,
        "model_name": meta["model_name"],
        "probe_steps": 0,
        "layer": layer,
    }
    online = OnlineProbe(probe, capacity=int(rows.sum()))
    save_probe_set(path, {DEFAULT_DOMAIN: online}, metadata, include_buffer=False)
    return Path(path)


# ---------------------------------------------------------------------------------------------------------- CLI
def _config_default(name: str) -> Any:
    """A `POISEConfig` field's default, so the bench measures what the trainer would run."""
    from .config import POISEConfig

    field = POISEConfig.__dataclass_fields__[name]
    return field.default_factory() if callable(field.default_factory) else field.default


def load_reward_fn(spec: str) -> RewardFn:
    """'package.module:function' -> the function (any TRL-style reward)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"--reward-fn {spec!r}: write MODULE:FUNCTION, e.g. poise_trl.rewards:math_answer_reward")
    return getattr(importlib.import_module(module), attr)


def load_prompts(dataset: str, num_prompts: int, seed: int, split: str | None) -> tuple[list[Prompt], dict[str, list]]:
    """Distinct prompts (duplicates would leak across the split) and the other dataset columns, for the reward."""
    if dataset == SORT_DATASET:
        from .tasks import make_sort_splits

        _, rows = make_sort_splits(num_train=0, num_eval=num_prompts, seed=seed)
    else:
        from .data import load_math_dataset

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


def _device(name: str) -> str:
    return name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def _parse_ints(spec: str | None) -> list[int] | None:
    return None if spec in (None, "auto") else [int(v) for v in spec.split(",") if v.strip()]


def collect_from_args(args: argparse.Namespace, log: Log) -> Collection:
    """Resolve the model (the demo's cached warm start for 'demo'), dataset and reward, then sample and featurize."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path, dataset = args.model, args.dataset
    if model_path == DEMO_MODEL:
        from .demo import default_cache_dir
        from .tasks import prepare_demo_model

        log("[1/4] demo model: the tiny Qwen3 warm-started on digit sorting (built on first use, then cached)")
        model_path = str(prepare_demo_model(args.cache_dir or default_cache_dir()))
        dataset = dataset or SORT_DATASET
    dataset = dataset or DEFAULT_MATH_DATASET
    if args.reward_fn:
        reward_fn = load_reward_fn(args.reward_fn)
    elif dataset == SORT_DATASET:
        from .tasks import task_reward as reward_fn
    else:
        from .rewards import math_answer_reward as reward_fn
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        from .tasks import MAX_COMPLETION_LENGTH

        max_new_tokens = MAX_COMPLETION_LENGTH if dataset == SORT_DATASET else 8192
    device = _device(args.device)
    prompts, columns = load_prompts(dataset, args.num_prompts, args.seed, args.split)
    log(f"[2/4] sampling K={args.k} rollouts for {len(prompts)} prompts of {dataset} with {model_path}")

    from .evaluation import resolve_backend

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
    marker = args.reasoning_end_marker or _config_default("reasoning_end_marker")
    return collect(
        model,
        tokenizer,
        prompts,
        reward_fn,
        columns,
        k=args.k,
        layers=_parse_ints(args.layers),
        pools=_parse_ints(args.pools) or [],
        layer=args.layer,
        pool_tokens=args.pool_tokens or _config_default("probe_pool_tokens"),
        reasoning_end_marker=None if marker.lower() == "none" else marker,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=max_new_tokens,
        batch_size=args.batch_size,
        feature_batch_size=args.feature_batch_size,
        seed=args.seed,
        completions=completions,
        meta={"model_path": str(model_path), "dataset": dataset, "device": device},
        log=log,
    )


def run_probe_bench(args: argparse.Namespace, log: Log = print) -> int:
    """Handler of `poise-trl probe-bench`: collect (or load), fit and score, print, write JSON/markdown/figure."""
    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.from_collection:
        log(f"[1/4] loading rollouts and features from {args.from_collection} (no generation)")
        collection = Collection.load(args.from_collection)
    else:
        collection = collect_from_args(args, log)
        log(f"      saved {collection.save(output_dir / COLLECTION_FILE)}")
    critic = None
    if not args.no_critic:
        meta = collection.meta
        critic = dict(
            model_name_or_path=meta.get("model_path") or meta["model_name"],
            device=_device(args.device),
            epochs=args.critic_epochs,
            lr=args.critic_lr,
            batch_size=args.critic_batch_size,
        )
    results = run_benchmark(
        collection,
        features=args.features or _config_default("probe_features"),
        preset=args.preset or _config_default("probe_preset"),
        test_fraction=args.test_fraction,
        seed=args.seed,
        n_bootstrap=args.bootstrap,
        vr_group_size=args.vr_group_size,
        mlps=parse_mlps(args.mlps),
        critic=critic,
        log=log,
    )
    report = format_report(results)
    log("[4/4] report\n")
    log(report)
    if args.export:
        path = export_probe(collection, results["settings"]["features"], args.export)
        log(f"\nexported the release-preset probe (refit on all prompts) to {path}")
    results["seconds"] = time.perf_counter() - start
    (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
    (output_dir / REPORT_FILE).write_text(report + "\n")
    figure = plot_figure1(results, output_dir / FIGURE_FILE)
    log(f"\nwrote {output_dir / RESULTS_FILE}, {output_dir / REPORT_FILE}, {figure} ({results['seconds']:.0f}s)")
    return 0


def add_probe_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `probe-bench` on the CLI's subparsers; its handler is `func` (call `args.func(args)`)."""
    parser = subparsers.add_parser(
        "probe-bench",
        help="will POISE work on my model? probe vs critic value prediction, with the paper's ablations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("model", nargs="?", default=DEMO_MODEL, help="HF model id or path; 'demo': the cached tiny sort model")
    add(
        "--dataset",
        default=None,
        help=f"'{SORT_DATASET}' (the demo task), a poise_trl.data registry name, Hub id "
        f"or local .jsonl/.parquet (default: {SORT_DATASET} for the demo, else {DEFAULT_MATH_DATASET})",
    )
    add("--split", default=None, help="dataset split (Hub ids)")
    add("--reward-fn", default=None, help="MODULE:FUNCTION, a TRL reward (default: the task's or math_answer_reward)")
    add("--num-prompts", type=int, default=320, help="distinct prompts to sample")
    add("--k", type=int, default=8, help="rollouts per prompt (the paper's avg@8)")
    add("--temperature", type=float, default=1.0, help="sampling temperature (POISE training samples at 1.0)")
    add("--top-p", type=float, default=1.0)
    add("--max-new-tokens", type=int, default=None, help="default: the demo task's length, else 8192")
    add("--backend", choices=("auto", "hf", "vllm"), default="auto", help="auto: vLLM if installed, else HF generate")
    add("--vllm-gpu-memory-utilization", type=float, default=0.5, help="vLLM's share; the HF model needs the rest")
    add("--device", default="auto", help="auto: cuda if available, else cpu")
    add("--batch-size", type=int, default=32, help="prompts per HF generate call (each expanded to K samples)")
    add("--feature-batch-size", type=int, default=64, help="rollouts per teacher-forced pass (use ~4 at 8k tokens)")
    add("--layers", default="auto", help="comma-separated layers to sweep (auto: all up to 16 layers, else odd)")
    add("--pools", default=",".join(map(str, DEFAULT_POOLS)), help="pooling windows to sweep")
    add("--layer", type=int, default=None, help="probe layer (default: POISEConfig's, round(0.53 * num_layers))")
    add("--pool-tokens", type=int, default=None, help="pooling window n (default: POISEConfig's, 10)")
    add("--features", nargs="+", choices=FEATURE_BLOCKS, default=None, help="default: POISEConfig's")
    add("--reasoning-end-marker", default=None, help="default: POISEConfig's </think>; 'none' for no marker")
    add("--preset", choices=("release", "paper"), default=None, help="probe for the sweeps (default: POISEConfig's)")
    add("--test-fraction", type=float, default=0.25, help="share of prompts held out")
    add("--bootstrap", type=int, default=1000, help="bootstrap resamples of held-out prompts for the CIs")
    add("--vr-group-size", type=int, default=2, help="G for the variance-reduction column (POISE uses 2)")
    add("--mlps", default=DEFAULT_MLPS, help="MLP probes, DEPTHxWIDTH comma-separated ('' for none)")
    add("--no-critic", action="store_true", help="skip the critic baseline")
    add("--critic-epochs", type=int, default=10, help="max epochs (early stopping on 10%% of train prompts)")
    add("--critic-lr", type=float, default=None, help="default: 1e-5 above 100M parameters, else 3e-4")
    add("--critic-batch-size", type=int, default=16)
    add("--seed", type=int, default=0, help="prompt choice, sampling, split, bootstrap and fits")
    add("--output-dir", default="runs/probe_bench", help="collection, results.json, results.md, figure1.png")
    add("--from-collection", default=None, help="refit from a saved collection.safetensors, without generation")
    add("--export", default=None, help="write the release-preset probe here, for POISEConfig(probe_init_path=...)")
    add("--cache-dir", default=None, help="demo model cache (default: $XDG_CACHE_HOME/poise-trl)")
    parser.set_defaults(func=run_probe_bench)
    return parser

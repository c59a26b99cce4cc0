"""The trainer's per-prefix probe on a saved collection, for `probe-bench --prefix` and `bench gradient`'s per-prefix
rows: its settings read from `POISEConfig(probe_granularity="prefix")` (one source of truth), and teacher-forced
passes that give the sampled tokens' feature rows and, with a fitted map, every token's V(x, y_<t)
(`poise_trl.features.prefix`: the hook keeps (b, T) scalars, never a (N, T, d) copy of the states).
"""

import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from poise_trl.estimator.baselines import cross_rollout_baselines
from poise_trl.estimator.specs import estimator_spec
from poise_trl.features.features import capture_layer, find_decoder_layers
from poise_trl.features.prefix import (
    PREFIX_SAMPLES,
    STATS,
    PrefixCapture,
    PrefixMap,
    PrefixSpans,
    prefix_pca_blocks,
    prefix_spans,
    prefix_stats,
)
from poise_trl.heads.probe import ValueProbe

from ..common import format_table
from .collect import Collection, Log
from .score import ValueBenchmark


def prefix_probe_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """What `POISEConfig(probe_granularity="prefix")` gives the trainer's per-prefix probe on the collection's model,
    at its layer and pooling window: positions sampled per rollout, window, ridge alpha, [prompt, prefix] PCA dims
    and clip range (None: the observed reward range)."""
    from poise_trl import POISEConfig

    layer, pool = int(meta["default_layer"]), int(meta["default_pool"])
    config = POISEConfig(
        output_dir="unused",
        report_to="none",
        use_cpu=True,
        probe_granularity="prefix",
        probe_layer=layer,
        probe_pool_tokens=pool,
    )
    spec = estimator_spec(config, int(meta["num_layers"]), int(meta["hidden_size"]))
    return {
        "samples": PREFIX_SAMPLES,
        "pool_tokens": config.probe_pool_tokens,
        "alpha": spec.head.alpha,
        "pca_dims": list(spec.granularity.pca_dims),
        "clip": None if spec.head.clip is None else list(spec.head.clip),
    }


def fit_prefix_probe(
    rows: torch.Tensor,
    targets: torch.Tensor,
    alpha: float = 100.0,
    pca_dims: tuple[int, int] = (0, 0),
    clip: tuple[float, float] | str | None = "observed",
) -> ValueProbe:
    """A prefix probe fitted on (N, feature_width) rows and their rollouts' rewards (N,); `PrefixMap.fold` turns it
    into the map the hook applies. The rows must come from other rollouts than the ones it will serve."""
    hidden_size = (rows.size(-1) - len(STATS)) // 2
    probe = ValueProbe(alpha=alpha, pca_dims=prefix_pca_blocks(hidden_size, pca_dims) or None, clip=clip)
    return probe.fit(rows, targets)


def fit_prefix(rows: torch.Tensor, targets: torch.Tensor, settings: dict[str, Any], hidden_size: int) -> PrefixMap:
    """The per-prefix probe fitted with `settings` on (M, F) feature rows and their rollouts' rewards, folded."""
    clip = "observed" if settings["clip"] is None else tuple(settings["clip"])
    fitted = fit_prefix_probe(rows, targets, settings["alpha"], tuple(settings["pca_dims"]), clip)
    return PrefixMap.fold(fitted, hidden_size)


def rollout_token_values(
    hidden: torch.Tensor,
    prompt_length: int,
    entropies: torch.Tensor,
    prefix_map: PrefixMap,
    pool_tokens: int,
    generated: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T,) V(x, y_<t) of every completion token of ONE unpadded rollout from the hooked layer's output (L, d),
    L = prompt_length + T, and the (T,) entropies of the distributions that emitted the tokens. `generated` (T,) is
    0 on tokens the policy did not write (their values are computed all the same, and must not be used)."""
    completion = hidden.size(0) - prompt_length
    if entropies.shape != (completion,):
        raise ValueError(f"Got {tuple(entropies.shape)} entropies for {completion} completion tokens.")
    spans = prefix_spans(
        torch.ones(1, prompt_length, dtype=torch.long, device=hidden.device),
        torch.ones(1, completion, dtype=torch.long, device=hidden.device),
        pool_tokens,
        1,
        None if generated is None else generated.view(1, -1),
        torch.Generator().manual_seed(0),  # the one sampled token is unused: leave the global generator alone
    )
    part = prefix_map.hidden_part(hidden.unsqueeze(0), spans)
    return prefix_map.values(part, prefix_stats(entropies.unsqueeze(0), spans))[0]


@torch.no_grad()
def prefix_passes(
    model: Any,
    collection: Collection,
    rollouts: torch.Tensor,
    settings: dict[str, Any],
    prefix_map: PrefixMap | None = None,
    batch_size: int = 64,
    seed: int = 0,
) -> Iterator[tuple[torch.Tensor, PrefixSpans, torch.Tensor, torch.Tensor | None]]:
    """Per batch of `rollouts` (indices into the collection): (the batch's indices, its spans, the (b, K, F) feature
    rows of its `settings["samples"]` sampled tokens, its (b, T) token values from `prefix_map` or None), from one
    teacher-forced pass of the hooked layer `meta["default_layer"]`, padded as TRL pads, at the sampling
    temperature (the entropy statistics)."""
    from trl.trainer.utils import entropy_from_logits

    layer = find_decoder_layers(model)[int(collection.meta["default_layer"])]
    temperature = float(collection.meta.get("temperature", 1.0))
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    for chunk in rollouts.split(batch_size):
        prompt_ids = collection.prompt_ids[collection.prompt_index[chunk]]
        prompt_mask = collection.prompt_mask[collection.prompt_index[chunk]].long()
        width = max(int(collection.completion_mask[chunk].sum(1).max()), 1)  # the batch's longest completion
        completion_ids = collection.completion_ids[chunk, :width].long()
        completion_mask = collection.completion_mask[chunk, :width].long()
        pool, samples = settings["pool_tokens"], settings["samples"]
        spans = prefix_spans(prompt_mask, completion_mask, pool, samples, None, generator)
        with capture_layer(
            layer, PrefixCapture(spans, None if prefix_map is None else prefix_map.to(device))
        ) as capture:
            logits = model(
                input_ids=torch.cat([prompt_ids, completion_ids], 1).to(device),
                attention_mask=torch.cat([prompt_mask, completion_mask], 1).to(device),
            ).logits[:, prompt_ids.size(1) - 1 : -1]
            entropies = entropy_from_logits(logits.float() / temperature).cpu()
            del logits
        batch = capture.batch(entropies)
        rows, values = batch.rows, batch.values
        yield chunk, spans, rows.cpu(), None if values is None else values.cpu()


def sampled_rows(
    model: Any,
    collection: Collection,
    rollouts: torch.Tensor,
    settings: dict[str, Any],
    batch_size: int = 64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, F) feature rows at the sampled tokens of `rollouts` with a finite reward, and those rewards (M,): what the
    trainer's per-prefix buffer holds for them."""
    rows, targets = [], []
    for chunk, spans, batch_rows, _ in prefix_passes(model, collection, rollouts, settings, None, batch_size, seed):
        sampled = spans.sampled & collection.rewards[chunk].isfinite()[:, None]
        rows.append(batch_rows[sampled])
        targets.append(collection.rewards[chunk][:, None].expand_as(sampled)[sampled])
    return torch.cat(rows), torch.cat(targets)


# ------------------------------------------------------------------------------------- variance explained (rho)
def _squared_errors(
    rewards: torch.Tensor, values: torch.Tensor, generated: torch.Tensor, bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rollout (b,) and column [all, bin 1..bins] (b, 1 + bins): the mean of (r - V_t)² over its generated tokens
    in the column, and whether it has any; bin j holds the tokens t with floor(bins · t / n) = j (n: its generated
    tokens), so each rollout counts once per relative-position bin whatever its length."""
    n = generated.sum(1, keepdim=True)
    rank = generated.long().cumsum(1) - 1
    position = torch.where(generated, rank * bins // n.clamp(min=1), -1)
    error = (rewards.double()[:, None] - values.double()).pow(2)
    masks = [generated] + [position == j for j in range(bins)]
    counts = torch.stack([m.sum(1) for m in masks], 1)
    sums = torch.stack([torch.where(m, error, 0.0).sum(1) for m in masks], 1)
    return sums / counts.clamp(min=1), counts > 0


def _rho(error: np.ndarray, present: np.ndarray, rewards: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """1 - E[(r - V)²] / Var(r) per column, over the rollouts present in it (finite V), for prompt weights (..., P)
    (the point estimate: ones; a bootstrap resample: its counts). error, present: (P, k, C); rewards (P, k)."""
    w = present & np.isfinite(rewards)[..., None] & np.isfinite(error)
    r = np.nan_to_num(rewards)[..., None]
    n, sr, srr = ((w * x).sum(1) for x in (np.ones_like(r), r, r * r))  # (P, C) per prompt
    se = (w * np.nan_to_num(error)).sum(1)
    n, sr, srr, se = (weights @ x for x in (n, sr, srr, se))
    with np.errstate(invalid="ignore", divide="ignore"):
        variance = srr / n - (sr / n) ** 2
        return np.where(variance > 0, 1 - (se / n) / variance, np.nan)


def sequence_baselines(bench: ValueBenchmark, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sequence-level rows beside the per-prefix probe, one value per held-out rollout from `probe` (the
    sequence-level probe's held-out predictions): the baseline POISE applies, the partner's value at G =
    `vr_group_size` (NaN past the last whole group); the rollout's own value, which reads its whole completion, so a
    reference and not an unbiased baseline for its own tokens; and the train prompts' mean reward."""
    g, k = bench.vr_group_size, bench.collection.k
    used = (k // g) * g
    own = probe.double().view(-1, k)
    partner = torch.full_like(own, math.nan)
    partner[:, :used] = cross_rollout_baselines(own[:, :used].reshape(-1), g).view(-1, used)
    return {
        f"POISE: the partner's value, G={g}": partner.flatten(),
        "Probe on the rollout's own completion (reference, biased)": own.flatten(),
        "Train mean": bench.train_mean(),
    }


def variance_explained(
    bench: ValueBenchmark,
    sequence: dict[str, torch.Tensor],
    device: str = "cpu",
    bins: int = 4,
    batch_size: int = 64,
    log: Log = print,
) -> dict[str, Any]:
    """How much of the reward variance the trainer's per-prefix probe explains on held-out rollouts, overall and by
    relative position along the completion, beside sequence-level estimators (`sequence`: name -> one held-out
    value per rollout, the order of `bench.test_rows`; the per-prefix probe's difference to the first one is given
    paired, on the same resamples): rho = 1 - E[(r - V)²] / Var(r), each rollout weighing once
    per bin, with 95% bootstrap intervals over the held-out prompts (the resamples of `bench`'s other intervals).

    The probe is fitted, as `POISEConfig(probe_granularity="prefix")` fits it, on the sampled tokens of the train
    prompts' rollouts (target: the rollout's reward); one teacher-forced pass per batch of rollouts, the hooked
    layer's states reduced inside the hook, so memory stays at (batch, T) values."""
    from transformers import AutoModelForCausalLM

    collection, meta = bench.collection, bench.collection.meta
    settings = prefix_probe_settings(meta)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(meta.get("model_path") or meta["model_name"], dtype=torch.float32)
    model = model.to(device).eval()
    rewards = collection.rewards
    train = torch.nonzero(bench.train_rows & rewards.isfinite()).flatten()
    rows, targets = sampled_rows(model, collection, train, settings, batch_size, bench.seed)
    prefix_map = fit_prefix(rows, targets, settings, int(meta["hidden_size"]))
    log(f"      per-prefix probe fitted on {rows.size(0)} sampled tokens of {train.numel()} train rollouts")
    test = torch.nonzero(bench.test_rows).flatten()
    passes = prefix_passes(model, collection, test, settings, prefix_map, batch_size, bench.seed)
    columns = [_squared_errors(rewards[chunk], values, spans.generated, bins) for chunk, spans, _, values in passes]
    shape = (-1, collection.k, 1 + bins)
    error = {"Per-prefix probe V(x, y_<t)": torch.cat([e for e, _ in columns]).view(shape).numpy()}
    present = torch.cat([p for _, p in columns]).view(shape).numpy()
    test_rewards = rewards[test].double().view(shape[:2])
    for name, values in sequence.items():  # one value for all the rollout's tokens
        squared = (test_rewards - values.double().view(shape[:2])).pow(2).numpy()
        error[name] = np.broadcast_to(squared[..., None], present.shape)
    scored, index = bench.scored, bench.bootstrap_index
    counts = np.stack([np.bincount(row, minlength=int(scored.sum())) for row in index])

    def row(name: str, point: np.ndarray, samples: np.ndarray) -> dict[str, Any]:
        cells = [
            {"value": float(point[c]), "ci": [float(q) for q in np.nanpercentile(samples[:, c], [2.5, 97.5])]}
            for c in range(1 + bins)
        ]
        return {"name": name, "all": cells[0], "bins": cells[1:]}

    rho: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, e in error.items():
        args = e[scored], present[scored], test_rewards.numpy()[scored]
        rho[name] = _rho(*args, np.ones(int(scored.sum()))), _rho(*args, counts)
    table = [row(name, *pair) for name, pair in rho.items()]
    (point, samples), (name, (other, other_samples)) = rho[next(iter(rho))], list(rho.items())[1]
    table.append(row(f"Per-prefix − {name} (paired)", point - other, samples - other_samples))
    return {
        "settings": {**settings, "bins": bins, "layer": int(meta["default_layer"])},
        "train_rows": int(rows.size(0)),
        "train_rollouts": int(train.numel()),
        "held_out_rollouts": int(present[scored, :, 0].sum()),
        "prompt_value_bound": bench.variance_reduction_bound(),
        "table": table,
        "seconds": time.perf_counter() - start,
    }


def prefix_report(prefix: dict[str, Any] | None) -> list[str]:
    """The report's section on `variance_explained` ([] when it did not run)."""
    if not prefix:
        return []
    bins = prefix["settings"]["bins"]
    headers = ["Estimator", "all tokens"] + [f"{100 * j // bins}-{100 * (j + 1) // bins}%" for j in range(bins)]

    def cell(c: dict[str, Any]) -> str:
        return f"{c['value']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]"

    s = prefix["settings"]
    return [
        "",
        "## Per-prefix value: reward variance explained by position along the completion",
        "",
        f"rho = 1 - E[(r - V)²] / Var(r) on {prefix['held_out_rollouts']} held-out rollouts (each weighs once per "
        "column; columns: relative position of the token among the rollout's generated tokens), 95% bootstrap "
        f'intervals over held-out prompts. The per-prefix probe is the trainer\'s (`probe_granularity="prefix"`: '
        f"layer {s['layer']}, window {s['pool_tokens']}, alpha {s['alpha']:g}, PCA {s['pca_dims']}, {s['samples']} "
        f"tokens per rollout), fitted on {prefix['train_rows']} sampled tokens of {prefix['train_rollouts']} train "
        "rollouts. A sequence-level row gives every token of a rollout the same value: the partner's is what POISE "
        "(default) subtracts; the own-completion one reads the rollout's last tokens. Any baseline of the prompt "
        f"alone explains at most {prefix['prompt_value_bound']:+.3f} (each held-out prompt's own avg@K).",
        "",
        format_table(headers, [[row["name"], *map(cell, [row["all"], *row["bins"]])] for row in prefix["table"]]),
    ]

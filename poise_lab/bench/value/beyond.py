"""Beyond the paper's baseline, measured on a probe-bench collection over several prompt splits.

Two questions, each answered on held-out prompts with the same split protocol as the main tables (`ValueBenchmark`):

- Baseline rules: the variance reduction at G = `vr_group_size` of RLOO, the shrunk RLOO a + w * RLOO ((a, w) the
  shrunk bootstrap's fit, `shrunk_rloo_line`, on the train prompts' groups), the POISE probe g(φ_j) and the
  partner-aware probe h(φ_j, r_j).
- Value-guided prompt selection: from `oversample` x `batch_prompts` random held-out candidates, keep `batch_prompts`
  by the predicted reward variance of a prompt-only probe (the trainer's rule, `poise_trl.sampling`: top-k by
  q(1 - q); or sampled in proportion to q(1 - q) + ε) or at random, and compare the kept prompts' true p(1 - p)
  (p = avg@K) and their share of degenerate prompts (avg@K in {0, 1}).

Each split reports one number per row; the tables give the median and [min, max] over splits.
"""

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from poise_trl.estimator.baselines import leave_one_out_targets, shrunk_rloo_line
from poise_trl.estimator.row import append_reward_column
from poise_trl.sampling import reward_variance, top_k

from .collect import Collection
from .score import ValueBenchmark

SAMPLING_EPSILON = 0.01  # ε of the proportional rule: every candidate keeps a small chance


def shrunk_line(bench: ValueBenchmark) -> tuple[float, float]:
    """(a, w) of the shrunk bootstrap's baseline a + w * m_i, fitted as the trainer fits it (`shrunk_rloo_line`) on
    the train prompts' rollouts, grouped as the VR column groups held-out ones."""
    g, k = bench.vr_group_size, bench.collection.k
    used = (k // g) * g
    rewards = bench.collection.rewards[bench.train_rows].view(-1, k)[:, :used].reshape(-1)
    means = leave_one_out_targets(rewards, g, torch.isfinite(rewards))
    intercept, weight = shrunk_rloo_line(means, rewards).tolist()
    return intercept, weight


def partner_aware_probe(bench: ValueBenchmark, blocks: Sequence[str], preset: str) -> torch.Tensor:
    """h(φ_j, r_j) on held-out rollouts: the preset probe with the rollout's own reward as one more column, fitted on
    the train rows' leave-one-out targets like the POISE probe."""
    rewards = bench.collection.rewards
    x = append_reward_column(bench.x(blocks), torch.nan_to_num(rewards))
    return bench.probe(x, bench.preset_probe(blocks, preset))


def pair_fitted_probe(bench: ValueBenchmark, blocks: Sequence[str], preset: str, pairs: int | None) -> torch.Tensor:
    """The POISE probe fitted on targets as the online buffer holds them at G = 2: each train rollout's target is
    its pair partner's reward, not the mean of its K - 1 others; `pairs` per prompt (None: all K / 2). Against the
    offline probe this separates target noise and fewer rows from what online training adds (policy drift)."""
    c, k = bench.collection, bench.collection.k
    used = 2 * (k // 2 if pairs is None else min(pairs, k // 2))
    grouped = c.rewards.view(-1, k)[:, :used].reshape(-1)
    targets = torch.full((c.num_prompts, k), math.nan)
    targets[:, :used] = leave_one_out_targets(grouped, 2, torch.isfinite(grouped)).view(-1, used)
    targets = targets.view(-1)
    rows = bench.train_rows & torch.isfinite(c.rewards) & torch.isfinite(targets)
    x, probe = bench.x(blocks), bench.preset_probe(blocks, preset)
    probe.fit(x[rows], targets[rows])
    return probe.predict(x[bench.test_rows])


def baseline_rules(bench: ValueBenchmark, blocks: Sequence[str], preset: str) -> dict[str, float]:
    """Held-out VR of each baseline rule on one split."""
    intercept, weight = shrunk_line(bench)
    held_out = bench.collection.rewards[bench.test_rows]
    return {
        "RLOO": bench.variance_reduction(None),
        "shrunk RLOO": bench.variance_reduction(intercept + weight * held_out),
        "shrunk weight w": weight,
        "POISE probe g(φ_j)": bench.variance_reduction(bench.probe_preset(blocks, preset)),
        "POISE probe, pair targets (K/2 pairs a prompt)": bench.variance_reduction(
            pair_fitted_probe(bench, blocks, preset, None)
        ),
        "POISE probe, one pair a prompt (as online)": bench.variance_reduction(
            pair_fitted_probe(bench, blocks, preset, 1)
        ),
        "partner-aware probe h(φ_j, r_j)": bench.variance_reduction(partner_aware_probe(bench, blocks, preset)),
        "best unbiased baseline V(x) (bound)": bench.variance_reduction_bound(),
    }


def prompt_values(bench: ValueBenchmark, preset: str) -> np.ndarray:
    """The prompt-only probe's predicted success rate of each held-out prompt (prompt block, default layer)."""
    values = bench.probe_preset(["prompt"], preset)
    return values.double().view(-1, bench.collection.k).mean(1).numpy()


def selection_trials(
    predicted: np.ndarray,
    avg_at_k: np.ndarray,
    batch_prompts: int,
    oversample: float,
    trials: int,
    seed: int,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> dict[str, dict[str, float]]:
    """Mean true p(1 - p) and degenerate share of the kept prompts under each rule, over random candidate draws;
    `predicted` values are read on the observed `reward_range`, as the trainer reads them."""
    rng = np.random.default_rng(seed)
    candidates = min(len(avg_at_k), math.ceil(oversample * batch_prompts))
    batch_prompts = min(batch_prompts, max(1, math.floor(candidates / oversample)))  # few held-out prompts
    variance_true = avg_at_k * (1 - avg_at_k)
    variance_predicted = reward_variance(torch.from_numpy(predicted), *reward_range).numpy()
    kept: dict[str, list[np.ndarray]] = {"random": [], "value: top-k": [], "value: sampled ∝ p(1-p)+ε": []}
    for _ in range(trials):
        pool = rng.choice(len(avg_at_k), size=candidates, replace=False)
        kept["random"].append(rng.choice(pool, size=batch_prompts, replace=False))
        kept["value: top-k"].append(pool[top_k(variance_predicted[pool].tolist(), batch_prompts)])
        weights = variance_predicted[pool] + SAMPLING_EPSILON
        kept["value: sampled ∝ p(1-p)+ε"].append(
            rng.choice(pool, size=batch_prompts, replace=False, p=weights / weights.sum())
        )
    out = {}
    for rule, rows in kept.items():
        index = np.concatenate(rows)
        degenerate = (avg_at_k[index] == 0) | (avg_at_k[index] == 1)
        out[rule] = {"mean p(1-p)": float(variance_true[index].mean()), "degenerate share": float(degenerate.mean())}
    return out


def _summary(values: Sequence[float]) -> dict[str, Any]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "per_split": list(values)}
    return {"median": float(np.median(finite)), "min": min(finite), "max": max(finite), "per_split": list(values)}


def run_beyond(
    collection: Collection,
    blocks: Sequence[str],
    preset: str,
    test_fraction: float,
    seed: int,
    splits: int,
    vr_group_size: int = 2,
    batch_prompts: int = 16,
    oversample: float = 2.0,
    trials: int = 200,
) -> dict[str, Any]:
    """Both studies over `splits` prompt splits (seeds seed, seed + 1, ...); JSON-able medians, ranges, per-split."""
    rules: dict[str, list[float]] = {}
    selection: dict[str, dict[str, list[float]]] = {}
    for split in range(splits):
        bench = ValueBenchmark(collection, test_fraction, seed + split, n_bootstrap=1, vr_group_size=vr_group_size)
        for name, value in baseline_rules(bench, blocks, preset).items():
            rules.setdefault(name, []).append(value)
        scored, rewards = bench.scored, collection.rewards[torch.isfinite(collection.rewards)]
        trials_out = selection_trials(
            prompt_values(bench, preset)[scored],
            bench.avg_at_k[scored],
            batch_prompts,
            oversample,
            trials,
            split,
            (float(rewards.min()), float(rewards.max())),
        )
        for rule, stats in trials_out.items():
            for stat, value in stats.items():
                selection.setdefault(rule, {}).setdefault(stat, []).append(value)
    rules["partner-aware − POISE probe (paired)"] = [
        h - g for h, g in zip(rules["partner-aware probe h(φ_j, r_j)"], rules["POISE probe g(φ_j)"], strict=True)
    ]
    return {
        "splits": splits,
        "vr_group_size": vr_group_size,
        "batch_prompts": batch_prompts,
        "oversample": oversample,
        "trials": trials,
        "baseline_rules": {name: _summary(values) for name, values in rules.items()},
        "selection": {
            rule: {stat: _summary(values) for stat, values in stats.items()} for rule, stats in selection.items()
        },
    }


def _cell(summary: dict[str, Any], fmt: str) -> str:
    if not math.isfinite(summary["median"]):
        return "–"
    return f"{fmt.format(summary['median'])} [{fmt.format(summary['min'])}, {fmt.format(summary['max'])}]"


def format_beyond(beyond: dict[str, Any]) -> list[str]:
    """Markdown lines of both tables (median [min, max] over splits)."""
    n, g = beyond["splits"], beyond["vr_group_size"]
    lines = [
        "",
        f"### Beyond the paper: baseline rules (held-out VR at G={g}, median [min, max] over {n} splits)",
        "",
        "| Baseline | VR ↑ |",
        "|---|---:|",
    ]
    for name, summary in beyond["baseline_rules"].items():
        lines.append(f"| {name} | {_cell(summary, '{:+.3f}')} |")
    lines += [
        "",
        f"### Beyond the paper: value-guided prompt selection ({beyond['oversample']:g}x oversampled, keep "
        f"{beyond['batch_prompts']} prompts; {beyond['trials']} draws per split, median [min, max] over {n} splits)",
        "",
        "| Kept prompts | mean p(1-p) ↑ | degenerate share ↓ |",
        "|---|---:|---:|",
    ]
    for rule, stats in beyond["selection"].items():
        lines.append(
            f"| {rule} | {_cell(stats['mean p(1-p)'], '{:.3f}')} | {_cell(stats['degenerate share'], '{:.2f}')} |"
        )
    return lines

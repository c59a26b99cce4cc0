"""Score value estimators for `poise-trl probe-bench` on a collection, split by prompt.

Every estimator is fitted on the train prompts' leave-one-out targets, as the trainer fits its probe, and scored by
the mean of its predictions over each held-out prompt's rollouts against the prompt's avg@K: MAE and Pearson r with
bootstrap CIs over prompts, and the variance reduction it would give as a cross-rollout baseline.
"""

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from poise_trl.estimator.baselines import (
    DIAGNOSTICS,
    cross_rollout_baselines,
    diagnostic_tensors,
    leave_one_out_targets,
)
from poise_trl.estimator.layer_choice import choose_layer, grouped_kfold_errors
from poise_trl.features.features import FEATURE_BLOCKS, FeatureLayout, layer_candidates
from poise_trl.heads.heads import HEADS
from poise_trl.heads.interface import ValueHead
from poise_trl.heads.probe import ValueProbe

from ..common import config_default
from .collect import Collection, Log

SCORED_PRESETS = ("release", "paper")
"""The presets whose ridge probe the main section scores (their alpha and PCA on the collection's rows), in order."""

ABLATIONS = (  # paper Table 3; `run_benchmark` adds the full set, with and without response length
    ("prompt hidden states only", ("prompt",)),
    ("reasoning hidden states only", ("reasoning",)),
    ("entropy statistics only", ("entropy",)),
    ("response length only", ("length",)),
)


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

    def _held_out_baselines(self, values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Held-out rewards, cross-rollout baselines and predictions, (prompts, used rollouts) each: rollouts split
        into groups of `vr_group_size`, b from `values` (None: the RLOO baseline, the group's other rewards)."""
        g, k = self.vr_group_size, self.collection.k
        used = (k // g) * g
        r = self.test_rewards[:, :used].reshape(-1)
        if values is None:
            v = torch.full_like(r, math.nan)
            b = leave_one_out_targets(r, g)
        else:
            v = values.double().view(-1, k)[:, :used].reshape(-1)
            b = cross_rollout_baselines(v, g)
        return r.view(-1, used), b.view(-1, used), v.view(-1, used)

    def variance_reduction(self, values: torch.Tensor | None) -> float:
        """1 - Var(r - b)/Var(r) on held-out rollouts (see `_held_out_baselines` for b)."""
        r, b, v = self._held_out_baselines(values)
        stats = diagnostic_tensors(r.flatten(), b.flatten(), v.flatten(), self.vr_group_size)
        return float(stats[DIAGNOSTICS.index("variance_reduction")])

    def variance_reduction_bound(self) -> float:
        """The variance reduction of the best unbiased baseline, each held-out prompt's true value: 1 - (mean of the
        prompts' sample reward variances over their k rollouts) / Var(r). No estimator's VR can exceed it (in
        expectation)."""
        r = self.test_rewards[torch.from_numpy(self.scored)]
        valid = torch.isfinite(r)
        n = valid.sum(1)
        centred = torch.where(valid, r - r.nanmean(1, keepdim=True), 0.0)
        within = (centred.pow(2).sum(1) / (n - 1).clamp(min=1))[n >= 2].mean()
        total = r[valid].var(unbiased=False)
        return float(1 - within / total) if total > 0 else math.nan

    def variance_reduction_ci(self, values: torch.Tensor | None) -> list[float]:
        """95% percentile interval of the variance reduction over the same resampled held-out prompts as MAE and r:
        per prompt the sums of r, r^2, A, A^2 over its valid rollouts, pooled per resample (population variances,
        as `diagnostic_tensors`)."""
        r, b, _ = self._held_out_baselines(values)
        valid = torch.isfinite(r) & torch.isfinite(b)
        r, a = torch.where(valid, r, 0.0), torch.where(valid, r - b, 0.0)
        sums = torch.stack([valid.sum(1), r.sum(1), r.pow(2).sum(1), a.sum(1), a.pow(2).sum(1)], 1).numpy()
        n, sr, srr, sa, saa = sums[self.scored][self.bootstrap_index].sum(1).T
        with np.errstate(invalid="ignore", divide="ignore"):
            var_r, var_a = srr / n - (sr / n) ** 2, saa / n - (sa / n) ** 2
            samples = np.where(var_r > 0, 1 - var_a / var_r, np.nan)
        return _percentile_ci(samples)

    def score(self, name: str, values: torch.Tensor | None, seconds: float = math.nan, **info: Any) -> dict[str, Any]:
        """Scores of per-rollout held-out predictions `values` (prompt-major); None scores only the RLOO row."""
        row: dict[str, Any] = {"name": name, **info, "fit_seconds": seconds}
        row.update(mae=math.nan, mae_ci=[math.nan] * 2, pearson_r=math.nan, pearson_r_ci=[math.nan] * 2)
        row.update(
            variance_reduction=self.variance_reduction(values),
            variance_reduction_ci=self.variance_reduction_ci(values),
        )
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
    def preset_probe(self, blocks: Sequence[str], preset: str, head: str = ValueProbe.name) -> ValueHead:
        """An unfitted value head (`probe_head`, ridge by default) built as the trainer builds it from a preset
        (clip='observed'), with the preset's ridge penalty and PCA dims."""
        from poise_trl.presets import preset_value

        alpha, dims = preset_value("probe_alpha", preset), preset_value("probe_pca_dims", preset)
        pca = FeatureLayout(tuple(blocks)).pca_blocks(self.collection.meta["hidden_size"], dims)
        return HEADS[head](alpha=alpha, pca_dims=pca)

    def probe(self, x: torch.Tensor, probe: ValueHead) -> torch.Tensor:
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
        mae = errors.mean(1).tolist()
        default = self.collection.meta["default_layer"]
        current = min(range(len(candidates)), key=lambda i: abs(candidates[i] - default))
        return candidates[choose_layer(mae, current, margin)], mae

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
        from poise_lab.bench.critic import load_critic, predict_critic, train_critic

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
    heads: Sequence[str] = (),
) -> dict[str, Any]:
    """Fit and score every estimator; returns the JSON-able results (sections of rows, settings, timings).

    `preset` is the probe used by the ablation, sweep and architecture sections; `critic` holds the keyword
    arguments of `ValueBenchmark.critic` (model path, device, epochs, lr, batch size), or None to skip it; `heads`
    are the trainer's other value heads (`probe_head`), scored in the architecture section at `preset`.
    """
    from poise_trl.grpo.config import PROBE_PRESETS

    if preset not in PROBE_PRESETS:
        raise ValueError(f"preset={preset!r}: choose one of {list(PROBE_PRESETS)}")
    bench = ValueBenchmark(collection, test_fraction, seed, n_bootstrap, vr_group_size)
    meta, blocks = collection.meta, [b for b in FEATURE_BLOCKS if b in features]
    layer, pool = meta["default_layer"], meta["default_pool"]
    sections: dict[str, list[dict[str, Any]]] = {}
    sweep = dict(features=blocks, preset=preset)

    log(f"[3/4] fitting on {len(bench.train_prompts)} prompts, scoring {len(bench.test_prompts)} held-out prompts")
    main = []
    for name in SCORED_PRESETS:
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
    folds, margin = config_default("probe_layer_folds"), config_default("probe_layer_switch_margin")
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
    for head in heads:  # the same scaler and PCA front end as the ridge row, another head on it
        values, s = _timed(lambda h=head: bench.probe(x, bench.preset_probe(blocks, preset, h)))
        arch.append(bench.score(f"probe_head={head} ({preset} preset)", values, s, head=head))
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
            "held_out_variance_reduction_bound": bench.variance_reduction_bound(),
            "held_out_prompt_index": bench.test_prompts[torch.from_numpy(bench.scored)].tolist(),
            **{k: v for k, v in meta.items() if k not in ("prompts", "model_path")},  # a machine path: not kept
        },
        "settings": {
            "features": blocks,
            "preset": preset,
            "test_fraction": test_fraction,
            "seed": seed,
            "n_bootstrap": n_bootstrap,
            "vr_group_size": vr_group_size,
            "mlps": [list(m) for m in mlps],
            "heads": list(heads),
            "critic": None if critic is None else {k: str(v) for k, v in critic.items() if k != "model_name_or_path"},
        },
        "critic_history": critic_history,
        "sections": sections,
    }

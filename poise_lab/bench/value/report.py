"""Report `poise-trl probe-bench`: markdown tables in the paper's layout, JSON, Fig. 1, and the exported probe."""

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from poise_lab.bench.common import DEMO_MODEL
from poise_trl.estimator.baselines import leave_one_out_targets
from poise_trl.estimator.learner import OnlineLearner
from poise_trl.estimator.row import append_reward_column
from poise_trl.features.features import FEATURE_BLOCKS, FeatureLayout
from poise_trl.heads.probe import ValueProbe

from ..common import config_default, other_heads, resolve_device
from .beyond import format_beyond, run_beyond
from .collect import Collection, Log
from .prefix import prefix_report, sequence_baselines, variance_explained
from .resolve import collect_from_args
from .score import ValueBenchmark, parse_mlps, run_benchmark

COLLECTION_FILE = "collection.safetensors"
RESULTS_FILE = "results.json"
REPORT_FILE = "results.md"
FIGURE_FILE = "figure1.png"

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
    bound = _num(c.get("held_out_variance_reduction_bound", math.nan), "{:+.3f}")
    lines = [
        f"# probe-bench: {c['model_name']} on {c.get('dataset', '?')}",
        "",
        f"{c['num_prompts']} prompts x K={c['k']} rollouts; {c['train_prompts']} train / {c['held_out_prompts']} "
        f"held-out prompts; mean held-out avg@{c['k']} {avg:.3f}. Features {'+'.join(s['features'])}, layer "
        f"{c['default_layer']} of {c['num_layers']}, last-{c['default_pool']} pooling; sweeps use the "
        f"{s['preset']} preset. MAE and r compare each held-out prompt's mean prediction with its avg@{c['k']}"
        f"; VR = 1 - Var(r - b)/Var(r) over held-out rollouts with b the cross-rollout baseline at "
        f"G={s['vr_group_size']} (95% bootstrap CIs over prompts for all three). The best unbiased baseline, each "
        f"held-out prompt's true value, would reach VR {bound} "
        "(1 - mean within-prompt reward variance / Var(r)): no estimator can beat it.",
    ]
    for key, rows in results["sections"].items():
        lines += [
            "",
            f"### {SECTION_TITLES[key]}",
            "",
            f"| {FIRST_COLUMN[key]} | MAE ↓ | 95% CI | Pearson r ↑ | 95% CI | VR ↑ | 95% CI | fit s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            name = "+".join(row["features"]) if key == "Feature ablation" and row["name"] == "full" else row["name"]
            lines.append(
                f"| {name} | {_num(row['mae'])} | {_ci(row['mae_ci'])} | {_num(row['pearson_r'])} | "
                f"{_ci(row['pearson_r_ci'])} | {_num(row['variance_reduction'], '{:+.3f}')} | "
                f"{_ci(row.get('variance_reduction_ci', [math.nan] * 2))} | {_num(row['fit_seconds'], '{:.2f}')} |"
            )
    if results.get("beyond_paper"):
        lines += format_beyond(results["beyond_paper"])
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


def save_probe_set(
    path: str | Path,
    probes: dict[str, OnlineLearner],
    metadata: dict[str, Any] | None = None,
    include_buffer: bool = True,
) -> None:
    """Write several named `OnlineLearner`s (e.g. one per domain) to ONE safetensors file plus `path` + '.json'.

    Tensor keys are `domain.<i>.probe.*` / `domain.<i>.buffer.*`; the JSON lists the names in order (names may hold
    any character), each with its probe settings and counters. Nothing is pickled.
    """
    path = Path(path)
    tensors, domains = {}, []
    for i, (name, online) in enumerate(probes.items()):
        tensors.update({f"domain.{i}.{k}": v for k, v in online.state_dict(include_buffer).items()})
        domains.append({"name": name, **online.info(include_buffer)})
    save_file(tensors, str(path))
    info = {**(metadata or {}), "domains": domains}
    path.with_suffix(path.suffix + ".json").write_text(json.dumps(info, indent=2, sort_keys=True))


def export_probe(collection: Collection, features: Sequence[str], path: str | Path) -> Path:
    """Refit the release-preset probe on EVERY prompt's rollouts (all data helps a warm start) and write it as
    `POISETrainer.save_probe` does (one-probe set, `_probe_metadata()` fields, no buffer), so that
    `POISEConfig(probe_init_path=path)` with the same layer, pooling, features and marker warm-starts from it. It is
    partner-aware (the reward column appended) when `probe_partner_reward` defaults to True, as the trainer fits it."""
    from poise_trl.estimator.batch import DEFAULT_DOMAIN
    from poise_trl.presets import preset_value

    meta, blocks = collection.meta, [b for b in FEATURE_BLOCKS if b in features]
    layer = meta["default_layer"]
    x = collection.columns(blocks, layer, meta["default_pool"])
    scored = torch.isfinite(collection.rewards)
    targets = leave_one_out_targets(collection.rewards, collection.k, scored)
    rows = scored & torch.isfinite(targets)
    partner_reward = bool(config_default("probe_partner_reward"))  # the probe POISEConfig's default would fit
    if partner_reward:
        x = append_reward_column(x, torch.nan_to_num(collection.rewards))
    alpha, dims = preset_value("probe_alpha", "release"), preset_value("probe_pca_dims", "release")
    layout = FeatureLayout(tuple(blocks))  # the collection's rows: the default rollout scalars
    pca = layout.pca_blocks(meta["hidden_size"], dims)
    probe = ValueProbe(alpha=alpha, pca_dims=pca, clip="observed")
    probe.fit(x[rows], targets[rows])
    metadata = {
        "feature_config": {
            "probe_layer": layer,
            "probe_layer_candidates": [layer],
            "probe_pool_tokens": meta["default_pool"],
            "probe_features": blocks,
            "probe_scalars": list(layout.read_scalars),
            "reasoning_end_marker": meta["reasoning_end_marker"],
            "hidden_size": meta["hidden_size"],
            "probe_partner_reward": partner_reward,
        },
        "probe_domain_column": None,
        "model_name": meta["model_name"],
        "probe_steps": 0,
        "layer": layer,
    }
    online = OnlineLearner(probe, capacity=int(rows.sum()))
    save_probe_set(path, {DEFAULT_DOMAIN: online}, metadata, include_buffer=False)
    return Path(path)


def run_probe_bench(args: argparse.Namespace, log: Log = print) -> int:
    """Handler of `poise-trl probe-bench`: collect (or load), fit and score, print, write JSON/markdown/figure."""
    unknown = sorted(set(args.features or ()) - set(FEATURE_BLOCKS))
    if unknown:
        raise ValueError(f"--features {unknown} unknown: choose from {list(FEATURE_BLOCKS)}")
    if args.k < 2 and not args.from_collection:  # checked before the model loads and samples
        raise ValueError(f"--k {args.k}: leave-one-out targets need at least 2 rollouts per prompt; use --k 2 or more")
    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.from_collection:
        log(f"[1/4] loading rollouts and features from {args.from_collection} (no generation)")
        collection = Collection.load(args.from_collection)
        if args.model != DEMO_MODEL:  # the name the user gave, for the report (the collection keeps its path)
            collection.meta["model_name"] = args.model
    else:
        collection = collect_from_args(args, log, args.layers, args.pools)
        log(f"      saved {collection.save(output_dir / COLLECTION_FILE)}")
    critic = None
    if not args.no_critic:
        meta = collection.meta
        critic = dict(
            model_name_or_path=meta.get("model_path") or meta["model_name"],
            device=resolve_device(args.device),
            epochs=args.critic_epochs,
            lr=args.critic_lr,
            batch_size=args.critic_batch_size,
        )
    results = run_benchmark(
        collection,
        features=args.features or config_default("probe_features"),
        preset=args.preset or config_default("probe_preset"),
        test_fraction=args.test_fraction,
        seed=args.seed,
        n_bootstrap=args.bootstrap,
        vr_group_size=args.vr_group_size,
        mlps=parse_mlps(args.mlps),
        critic=critic,
        log=log,
        heads=other_heads(args.probe_heads),
    )
    results["beyond_paper"] = None
    if args.splits > 0:
        settings = results["settings"]
        results["beyond_paper"] = run_beyond(
            collection,
            settings["features"],
            settings["preset"],
            args.test_fraction,
            args.seed,
            args.splits,
            args.vr_group_size,
        )
        log(f"      beyond-the-paper study over {args.splits} splits done")
    results["prefix"] = None
    if args.prefix:
        settings = results["settings"]
        bench = ValueBenchmark(collection, args.test_fraction, args.seed, args.bootstrap, args.vr_group_size)
        sequence = sequence_baselines(bench, bench.probe_preset(settings["features"], settings["preset"]))
        results["prefix"] = variance_explained(
            bench, sequence, resolve_device(args.device), batch_size=args.feature_batch_size, log=log
        )
        log(f"      per-prefix variance explained done ({results['prefix']['seconds']:.0f}s)")
    report = "\n".join([format_report(results), *prefix_report(results["prefix"])])
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

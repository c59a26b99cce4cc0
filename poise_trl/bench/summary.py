"""Statistics and report of `poise-trl bench efficiency`: AUC over completions generated, completions to target,
paired ratios with bootstrap CIs over seeds, the table, the headline and the learning-curve plot."""

from itertools import pairwise
from pathlib import Path
from typing import Any

from .common import (
    COUNTERS,
    REFERENCES,
    Contender,
    bootstrap_median,
    fmt,
    fmt_ci,
    fmt_spread,
    format_table,
    ratio,
    spread,
)

TARGET_FRACTIONS = (0.5, 0.75, 0.9)  # of GRPO-8's median gain, reported side by side in the JSON
HEADLINE_FRACTION = "0.75"
MIN_SEEDS_FOR_CI = 8  # below it the percentile bootstrap of a median over seeds has too few distinct resamples


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return sum(finite) / len(finite) if finite else None


def completions_to_gain(run: dict[str, Any], gain: float) -> float | None:
    """Completions generated when held-out avg@k first reaches the seed's starting accuracy + `gain`, linearly
    interpolated between evaluations; None if it never does. Per seed, because warm starts differ in starting accuracy
    more than contenders do."""
    target = run["avg_at_k"][0] + gain
    points = list(zip(run["eval_completions"], run["avg_at_k"], strict=True))
    if points[0][1] >= target:
        return float(points[0][0])
    for (c0, a0), (c1, a1) in pairwise(points):
        if a1 >= target:  # a0 < target: the curve crosses within this interval
            return c0 + (target - a0) / (a1 - a0) * (c1 - c0)
    return None


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """The piecewise-linear curve through (xs, ys) at x (xs increasing, x within them)."""
    for (x0, y0), (x1, y1) in pairwise(zip(xs, ys, strict=True)):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return ys[-1]


def normalized_auc(run: dict[str, Any], budget: float) -> float:
    """Mean held-out avg@k over the first `budget` completions generated: the area under the linearly interpolated
    curve divided by the budget. One number per run that uses every evaluation, not one threshold crossing."""
    xs, ys = run["eval_completions"], run["avg_at_k"]
    if budget <= 0 or xs[-1] < budget:
        raise ValueError(f"the run covers {xs[-1]} completions, not the budget {budget}")
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if x < budget] + [(budget, interpolate(xs, ys, budget))]
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in pairwise(points))
    return area / budget


def common_budget(runs: list[dict[str, Any]]) -> float:
    """The smallest final completions-generated count over all runs: every curve covers it."""
    return float(min(r["eval_completions"][-1] for r in runs))


def reference_gain(runs: list[dict[str, Any]], reference: str) -> float | None:
    """The reference contender's median gain over training (final - start, per seed); None if it did not improve,
    since a target tied to no progress means nothing."""
    gain = spread(r["avg_at_k"][-1] - r["avg_at_k"][0] for r in runs if r["contender"] == reference)["median"]
    return None if gain is None or gain <= 0 else gain


def _paired(
    mine: dict[int, float | None],
    theirs: dict[int, float | None],
    kind: str,
    their_budget: dict[int, float] | None = None,
) -> list[float | None]:
    """Per-seed `kind` ("ratio" or "difference") of two contenders' values on the seeds both ran.

    For completions to a target, None means never reached, and the ratio stays conservative for `mine`: mine never
    reached, an infinite ratio (None); the reference never reached, its final count (`their_budget`, less than what it
    would need) stands in, an upper bound on the ratio; neither reached, the seed says nothing and is left out.
    """
    values = []
    for seed in sorted(set(mine) & set(theirs)):
        a, b = mine[seed], theirs[seed]
        if kind == "difference":
            values.append(None if a is None or b is None else a - b)
        elif a is None:
            if b is not None:
                values.append(None)
        elif b is None:
            if their_budget is None:
                raise ValueError("a reference that never reached the target needs its budget")
            values.append(a / their_budget[seed])
        else:
            values.append(ratio(a, b))
    return values


def summarize(
    runs: list[dict[str, Any]], contenders: list[Contender], full_gain: float | None, budget: float
) -> dict[str, Any]:
    """Per contender: medians of the compute counts, AUC over the common budget with a bootstrap CI over seeds, the
    completions to each target, and per-seed paired statistics against each reference, each [median, low, high]."""
    targets = {str(f): f * full_gain for f in TARGET_FRACTIONS} if full_gain is not None else {}
    per_seed: dict[str, dict[str, dict[int, float | None]]] = {}
    for contender in contenders:
        mine = [r for r in runs if r["contender"] == contender.name]
        per_seed[contender.name] = {
            "auc": {r["seed"]: normalized_auc(r, budget) for r in mine},
            "auc_gain": {r["seed"]: normalized_auc(r, budget) - r["avg_at_k"][0] for r in mine},
            **{f"to_{f}": {r["seed"]: completions_to_gain(r, g) for r in mine} for f, g in targets.items()},
        }
    summary: dict[str, Any] = {}
    for contender in contenders:
        mine = [r for r in runs if r["contender"] == contender.name]
        seeds = per_seed[contender.name]
        stats: dict[str, Any] = {
            "name": contender.name,
            "label": contender.label,
            "trainer": contender.trainer,
            "group_size": contender.group_size,
            "overrides": contender.overrides,
            **{key: spread(r[key] for r in mine)["median"] for key in COUNTERS},
            "auc": bootstrap_median(seeds["auc"].values())[0],
            "auc_ci": bootstrap_median(seeds["auc"].values())[1:],
            "auc_gain": bootstrap_median(seeds["auc_gain"].values()),
            "start_avg_at_k": spread(r["avg_at_k"][0] for r in mine),
            "final_avg_at_k": spread(r["avg_at_k"][-1] for r in mine),
            "completions_to_target": {f: bootstrap_median(seeds[f"to_{f}"].values()) for f in targets},
            "reached_target": {f: sum(v is not None for v in seeds[f"to_{f}"].values()) for f in targets},
            "mean_grad_norm": spread(r["mean_grad_norm"] for r in mine),
            "frac_zero_advantage_prompts": spread(r["mean_frac_zero_advantage_prompts"] for r in mine),
            "frac_reward_zero_std": spread(r["mean_frac_reward_zero_std"] for r in mine),
            "train_seconds": spread(r["train_seconds"] for r in mine),
            "paired": {},
            "paired_auc_difference": {},
            "paired_auc_gain_ratio": {},
            "paired_completions_to_target": {},
        }
        if contender.trainer == "poise":
            stats["probe_variance_reduction"] = spread(r["probe_variance_reduction"] for r in mine)
            stats["probe_pearson_r"] = spread(r["probe_pearson_r"] for r in mine)
        for reference in REFERENCES:
            if reference not in per_seed:
                continue
            theirs = per_seed[reference]
            # Paired by seed (same warm start, data and evaluator): the seed-to-seed spread of warm starts cancels.
            stats["paired"][reference] = bootstrap_median(_paired(seeds["auc"], theirs["auc"], "ratio"))
            stats["paired_auc_difference"][reference] = bootstrap_median(
                _paired(seeds["auc"], theirs["auc"], "difference")
            )
            stats["paired_auc_gain_ratio"][reference] = bootstrap_median(
                _paired(seeds["auc_gain"], theirs["auc_gain"], "ratio")
            )
            their_budget = {r["seed"]: r["completions_generated"] for r in runs if r["contender"] == reference}
            stats["paired_completions_to_target"][reference] = {
                f: bootstrap_median(_paired(seeds[f"to_{f}"], theirs[f"to_{f}"], "ratio", their_budget))
                for f in targets
            }
        summary[contender.name] = stats
    return summary


def task_check(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Can this task separate the contenders? The G=8 groups that tie at the start (median over seeds of GRPO-8's
    first steps; the issue asks for >= 25%) and the best final accuracy (no contender may saturate)."""
    first = [_mean(r["per_step"]["frac_reward_zero_std"][:5]) for r in runs if r["contender"] in ("grpo8", "dapo_ds")]
    return {
        "degenerate_g8_groups_at_start": spread(v for v in first if v is not None)["median"],
        "best_final_avg_at_k": max(r["avg_at_k"][-1] for r in runs),
    }


def format_report(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """The table, then the headline."""
    k = settings["eval_k"]
    target = HEADLINE_FRACTION
    headers = [
        "contender",
        "generated / trained",
        "tokens gen.",
        "prefill tok.",
        "fwd rows",
        f"AUC avg@{k} [95% CI]",
        "AUC ratio vs GRPO-8",
        "AUC ratio vs DAPO-DS",
        f"to {target} target vs DAPO-DS",
        f"to {target} target vs RLOO-2",
        f"final avg@{k}",
        "zero-adv prompts",
        "train s",
    ]
    rows = []
    for s in summary.values():
        to_dapo = s["paired_completions_to_target"].get("dapo_ds", {}).get(target)
        to_rloo = s["paired_completions_to_target"].get("rloo2", {}).get(target)
        rows.append(
            [
                s["label"],
                f"{fmt(s['completions_generated'])} / {fmt(s['completions_trained'])}",
                fmt(s["tokens_generated"]),
                fmt(s["prefill_tokens"]),
                fmt(s["forward_rows"]),
                fmt_ci([s["auc"], *s["auc_ci"]]),
                fmt_ci(s["paired"]["grpo8"]) if "grpo8" in s["paired"] else "–",
                fmt_ci(s["paired"]["dapo_ds"]) if "dapo_ds" in s["paired"] else "–",
                fmt_ci(to_dapo, 2) if to_dapo else "–",
                fmt_ci(to_rloo, 2) if to_rloo else "–",
                fmt_spread(s["final_avg_at_k"]),
                fmt_spread(s["frac_zero_advantage_prompts"], 2),
                fmt_spread(s["train_seconds"]),
            ]
        )
    return format_table(headers, rows) + "\n" + headline(summary, settings)


def _verdict(interval: list[float | None], better_below: bool) -> str:
    """Whether a ratio's CI excludes 1, in words."""
    low, high = interval[1], interval[2]
    if low is not None and high is not None and (high < 1 if better_below else low > 1):
        return "wins"
    if low is not None and (low > 1 if better_below else high is not None and high < 1):
        return "loses"
    return "undecided"


def headline(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """One line: each POISE contender against each reference, AUC ratio and completions to the target, with CIs."""
    seeds, budget, target = len(settings["seeds"]), settings["common_budget"], HEADLINE_FRACTION
    parts = []
    for s in summary.values():
        if s["trainer"] != "poise":
            continue
        for reference in REFERENCES:
            if reference not in s["paired"]:
                continue
            auc, gain = s["paired"][reference], s["paired_auc_gain_ratio"][reference]
            to = s["paired_completions_to_target"][reference].get(target, [None] * 3)
            parts.append(
                f"{s['label']} vs {summary[reference]['label']}: AUC ×{fmt_ci(auc)} ({_verdict(auc, False)}; "
                f"above the start ×{fmt_ci(gain, 2)}), completions to the {target} target ×{fmt_ci(to, 2)} "
                f"({_verdict(to, True)})"
            )
    if not parts:
        return f"Summary: no POISE contender or no reference run, so no paired ratios ({seeds} seeds)."
    caution = f" (only {seeds} seeds: a bootstrap CI needs about {MIN_SEEDS_FOR_CI} to mean much)" * (
        seeds < MIN_SEEDS_FOR_CI
    )
    return (
        f"Summary, paired by seed, median [95% bootstrap CI] over {seeds} seeds{caution}, AUC over the first "
        f"{fmt(budget)} "
        "completions generated (ratio > 1: POISE better), completions ratio < 1: POISE needs fewer: "
        + "; ".join(parts)
        + "."
    )


def plot_curves(runs: list[dict[str, Any]], contenders: list[Contender], path: Path, budget: float, k: int) -> Path:
    """Held-out avg@k gain over each seed's start against completions generated (median and min-max over seeds,
    interpolated onto a common grid up to the common budget), and the zero-advantage prompts per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    grid = [budget * i / 50 for i in range(51)]
    for contender in contenders:
        mine = [r for r in runs if r["contender"] == contender.name]
        if not mine:
            continue
        gains = [[interpolate(r["eval_completions"], r["avg_at_k"], x) - r["avg_at_k"][0] for x in grid] for r in mine]
        columns = [spread(column) for column in zip(*gains, strict=True)]
        line = axes[0].plot(grid, [c["median"] for c in columns], label=contender.label)[0]
        if len(mine) > 1:
            axes[0].fill_between(
                grid, [c["min"] for c in columns], [c["max"] for c in columns], color=line.get_color(), alpha=0.1
            )
        zero = [_trailing_mean(r["per_step"]["frac_zero_advantage_prompts"]) for r in mine]
        steps = list(range(1, len(zero[0]) + 1))
        axes[1].plot(steps, [spread(c)["median"] for c in zip(*zero, strict=True)], label=contender.label)
    axes[0].set_title(f"held-out avg@{k} gain over the seed's start (median, min-max over seeds)")
    axes[0].set_xlabel("completions generated")
    axes[1].set_title("prompts with zero advantage (10-step mean, median over seeds)")
    axes[1].set_xlabel("optimizer step")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _trailing_mean(values: list[float | None], window: int = 10) -> list[float]:
    """A per-step metric as a trailing `window`-step mean (a missing value counts 0)."""
    clean = [0.0 if v is None else v for v in values]
    return [sum(clean[max(0, i - window + 1) : i + 1]) / min(window, i + 1) for i in range(len(clean))]

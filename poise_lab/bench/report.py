"""The efficiency study's statistics and report, rebuilt from whatever run files exist (so partial results report).

Per task and contender: AUC (mean held-out avg@k over the first `budget` completions generated) with a bootstrap CI
over seeds; per headline comparison (each POISE row against each reference), paired by seed: the wins, the
difference of AUC above the start, the ratio of completions generated until avg@k gains 75% of GRPO-8's median gain,
each with a BCa bootstrap CI, and Wilcoxon signed-rank p-values, Holm-corrected across every headline comparison of
the report. A run that never reaches the target counts as needing infinitely many completions, against its
contender.
"""

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from .common import ALPHA, TASKS, fmt, format_table, mean_or_none, median, smallest_p_holm, write_json
from .contenders import CONTENDERS, HEADLINE_CONTENDERS, REFERENCES, paired_references
from .summary import completions_to_gain, interpolate, normalized_auc

TARGET_FRACTION = 0.75
BOOTSTRAP_RESAMPLES = 9999
_LOG_NEVER = 50.0  # a log-ratio standing for "never reached" (ranks and medians only need it beyond any real one)
_LOG_REAL = 20.0  # no real ratio of completion counts comes near e^20; a median or bound beyond it involves "never"
TARGET_REFERENCE = "grpo8"  # the target: TARGET_FRACTION of its median gain
GOAL_CONTENDER = "poise"  # the study's goal is this row's; its headline lines come first
GOAL_RATIO_BOUNDS = {"dapo_ds_carry": 0.6, "rloo2": 0.9}  # the study's goal: upper CI ends of completions to target


def _bootstrap_ci(values: list[float], statistic=np.median) -> tuple[float | None, float | None]:
    """95% BCa bootstrap CI of `statistic` over seeds (scipy); percentile where BCa is undefined (ties, few seeds)."""
    data = np.asarray(values, dtype=float)
    if data.size < 3:
        return None, None
    if np.all(data == data[0]):
        return float(data[0]), float(data[0])
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():  # BCa on degenerate data warns and returns NaN: the fallback handles it
            warnings.simplefilter("ignore")
            result = stats.bootstrap(
                (data,), statistic, n_resamples=BOOTSTRAP_RESAMPLES, method=method, random_state=0, vectorized=False
            )
        low, high = result.confidence_interval
        if math.isfinite(low) and math.isfinite(high):
            return float(low), float(high)
    return None, None


def _wilcoxon(differences: list[float]) -> float | None:
    """Two-sided Wilcoxon signed-rank p-value of paired differences (zeros dropped); None if nothing differs."""
    nonzero = [d for d in differences if d != 0]
    if not nonzero:
        return None
    return float(stats.wilcoxon(nonzero).pvalue)


def holm(p_values: dict[Any, float | None]) -> dict[Any, float | None]:
    """Holm-Bonferroni adjusted p-values (scipy.stats.false_discovery_control has no FWER method)."""
    keys = [k for k, p in p_values.items() if p is not None]
    ordered = sorted(keys, key=p_values.get)
    adjusted, running = {}, 0.0
    for rank, key in enumerate(ordered):
        running = max(running, (len(ordered) - rank) * p_values[key])
        adjusted[key] = min(1.0, running)
    return {k: adjusted.get(k) for k in p_values}


def _eval_runs(runs: list[dict[str, Any]], rates: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per contender, its evaluation runs by seed at its chosen rate (the tuned one where tuning ran), on the seeds
    that every contender has finished."""
    chosen: dict[str, dict[int, dict[str, Any]]] = {}
    for run in runs:
        if run["role"] != "eval":
            continue
        rate = rates.get(run["contender"], {}).get("learning_rate")
        if rate is not None and not math.isclose(run["learning_rate"], rate):
            continue
        chosen.setdefault(run["contender"], {})[run["seed"]] = run
    # Only seeds every contender has finished, so a partial study's medians cover the same seeds for all.
    complete = set.intersection(*(set(seeds) for seeds in chosen.values())) if chosen else set()
    return {name: {s: run for s, run in seeds.items() if s in complete} for name, seeds in chosen.items() if complete}


def _ratio_summary(log_ratios: list[float]) -> list[float | None]:
    """[median, low, high] of per-seed ratios given as logs; one involving "never reached" is None (mine) or 0."""
    if not log_ratios:
        return [None, None, None]
    low, high = _bootstrap_ci(log_ratios)

    def back(v: float | None) -> float | None:  # |log ratio| <= log(budget) for real ones; beyond, "never" weighs in
        if v is None or v > _LOG_REAL:
            return None
        return 0.0 if v < -_LOG_REAL else math.exp(v)

    return [back(float(np.median(log_ratios))), back(low), back(high)]


def _log_ratio(mine: float | None, theirs: float | None) -> float:
    """log(mine / theirs) of completions to the target; never reached is infinite, so it counts against its side."""
    if mine is None and theirs is None:
        return 0.0
    if mine is None:
        return _LOG_NEVER
    if theirs is None:
        return -_LOG_NEVER
    return math.log(max(mine, 1.0) / max(theirs, 1.0))


def summarize_task(task: str, runs: list[dict[str, Any]], rates: dict[str, Any], budget: float) -> dict[str, Any]:
    """Per contender of one task: rate, AUC with CI, compute medians and paired statistics against each reference."""
    by_contender = _eval_runs(runs, rates)
    starts = {seed: run["avg_at_k"][0] for seeds in by_contender.values() for seed, run in seeds.items()}
    reference = by_contender.get(TARGET_REFERENCE, {})
    gains = [interpolate(r["eval_completions"], r["avg_at_k"], budget) - r["avg_at_k"][0] for r in reference.values()]
    target_gain = TARGET_FRACTION * median(gains) if gains and median(gains) > 0 else None
    summary: dict[str, Any] = {}
    for name, seeds in sorted(by_contender.items(), key=lambda item: list(CONTENDERS).index(item[0])):
        aucs = {seed: normalized_auc(run, budget) for seed, run in seeds.items()}
        to_target = {seed: _to_target(run, target_gain, budget) for seed, run in seeds.items()}
        auc_values, runs_of = list(aucs.values()), list(seeds.values())
        entry = {
            "label": CONTENDERS[name].label,
            "seeds": sorted(seeds),
            "learning_rate": rates.get(name, {}).get("learning_rate", next(iter(seeds.values()))["learning_rate"]),
            "learning_rate_source": rates.get(name, {}).get("source", "--learning-rate"),
            "auc": median(auc_values),
            "auc_ci": list(_bootstrap_ci(auc_values)),
            "auc_above_start": median([aucs[s] - starts[s] for s in aucs]),
            "completions_generated": median([r["completions_generated"] for r in seeds.values()]),
            "completions_trained": median([r["completions_trained"] for r in seeds.values()]),
            "final_avg_at_k": median([interpolate(r["eval_completions"], r["avg_at_k"], budget) for r in runs_of]),
            "start_avg_at_k": median([starts[s] for s in seeds]),
            "frac_zero_advantage_prompts": mean_or_none(r["mean_frac_zero_advantage_prompts"] for r in runs_of),
            "train_seconds": median([r["train_seconds"] for r in seeds.values()]),
            "reached_target": sum(v is not None for v in to_target.values()),
            "paired": {},
        }
        if CONTENDERS[name].headline:
            for ref in paired_references(name):
                if ref in by_contender:
                    entry["paired"][ref] = _paired(aucs, to_target, by_contender[ref], budget, target_gain)
        summary[name] = entry
    return {"task": task, "budget": budget, "target_gain": target_gain, "contenders": summary, "check": _check(runs)}


def _to_target(run: dict[str, Any], gain: float | None, budget: float) -> float | None:
    """Completions generated to reach start + gain within the budget; None (never) past it or without a target."""
    if gain is None:
        return None
    value = completions_to_gain(run, gain)
    return value if value is not None and value <= budget else None


def _paired(
    aucs: dict[int, float],
    to_target: dict[int, float | None],
    theirs: dict[int, dict[str, Any]],
    budget: float,
    target_gain: float | None,
) -> dict[str, Any]:
    seeds = sorted(set(aucs) & set(theirs))
    their_auc = {s: normalized_auc(theirs[s], budget) for s in seeds}
    differences = [aucs[s] - their_auc[s] for s in seeds]  # same start per seed: the difference of AUC above it
    log_ratios = [_log_ratio(to_target[s], _to_target(theirs[s], target_gain, budget)) for s in seeds]
    low, high = _bootstrap_ci(differences)
    return {
        "seeds": len(seeds),
        "wins": sum(d > 0 for d in differences),
        "auc_gain_diff": [median(differences) if differences else None, low, high],
        "p_wilcoxon": _wilcoxon(differences),
        "target_wins": sum(r < 0 for r in log_ratios),
        "completions_to_target_ratio": _ratio_summary(log_ratios) if target_gain is not None else [None] * 3,
        "p_wilcoxon_target": _wilcoxon(log_ratios) if target_gain is not None else None,
    }


def _check(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Can this task separate the contenders? G=8 groups tied in the first 5 steps (the G=8 references' runs, median;
    want >= 0.25), start avg@k (want 0.3-0.7) and the best final avg@k (no contender may saturate)."""
    first = [
        mean_or_none(r["per_step"]["frac_reward_zero_std"][:5])
        for r in runs
        if CONTENDERS[r["contender"]].g8_reference
    ]
    first = [v for v in first if v is not None]
    return {
        "tied_g8_groups_at_start": median(first) if first else None,
        "start_avg_at_k": median([r["avg_at_k"][0] for r in runs]) if runs else None,
        "best_final_avg_at_k": max((r["avg_at_k"][-1] for r in runs), default=None),
    }


def verdict(diff: list[float | None], p_holm: float | None, better_below: bool = False) -> str:
    """wins / loses / undecided: Holm-corrected p below ALPHA decides, the median's side says who; a median that
    is "never reached" (None for a ratio) loses outright."""
    middle = diff[0]
    if middle is None:
        return "loses" if better_below else "undecided"
    if p_holm is None or p_holm >= ALPHA:
        return "undecided"
    good = middle < 1 if better_below else middle > 0
    return "wins" if good else "loses"


def goal(summary: dict[str, Any]) -> dict[str, Any]:
    """The study's goal for one task: POISE (default) wins on AUC above the start against every comparator
    (p_holm < ALPHA), and its completions-to-target ratio's upper CI end is below each bound of GOAL_RATIO_BOUNDS."""
    entry = summary["contenders"].get(GOAL_CONTENDER)
    paired = entry["paired"] if entry else {}
    auc_wins = {ref: verdict(p["auc_gain_diff"], p.get("p_holm")) == "wins" for ref, p in paired.items()}
    ratio_below = {
        ref: ref in paired and (high := paired[ref]["completions_to_target_ratio"][2]) is not None and high < bound
        for ref, bound in GOAL_RATIO_BOUNDS.items()
    }
    complete = set(auc_wins) == set(REFERENCES)
    return {
        "auc_wins": auc_wins,
        "ratio_bounds": GOAL_RATIO_BOUNDS,
        "ratio_upper_below_bound": ratio_below,
        "met": complete and all(auc_wins.values()) and all(ratio_below.values()),
    }


def build_report(results_dir: str | Path, allow_mixed_code: bool = False) -> dict[str, Any]:
    """Every task's summary from the run files, with Holm's correction across all headline tests of the report.
    Runs of different code (poise-trl version and commit, recorded in each run file) are refused unless allowed."""
    from .study import load_runs

    results_dir = Path(results_dir)
    settings = json.loads((results_dir / "study.json").read_text())["settings"]
    runs = load_runs(results_dir)
    codes: dict[str, int] = {}
    for run in runs:
        code = run.get("environment", {}).get("code")
        key = "unrecorded" if code is None else f"poise-trl {code['version']} at {code['commit'] or 'no git commit'}"
        codes[key] = codes.get(key, 0) + 1
    if len(codes) > 1 and not allow_mixed_code:
        listed = ", ".join(f"{n} runs by {key}" for key, n in codes.items())
        raise SystemExit(
            f"{results_dir} holds runs of different code ({listed}); re-run them with one version, or pass "
            "--allow-mixed-code to report them together."
        )
    tasks = sorted(
        {r["task"] for r in runs}, key=lambda task: (TASKS.index(task) if task in TASKS else len(TASKS), task)
    )
    report: dict[str, Any] = {"settings": settings, "tasks": {}, "runs_done": len(runs), "code": codes}
    for task in tasks:
        tuning_file = results_dir / f"tuning_{task}.json"
        rates = json.loads(tuning_file.read_text()) if tuning_file.exists() else {}
        task_runs = [r for r in runs if r["task"] == task]
        report["tasks"][task] = summarize_task(task, task_runs, rates, settings["budget"])
        report["tasks"][task]["tuning"] = tuning_table(task_runs, rates, settings["budget"])
        report["tasks"][task]["runs_done"] = {
            role: sum(r["role"] == role for r in task_runs) for role in ("tune", "eval")
        }
        eval_seeds: dict[str, list[int]] = {}
        for run in task_runs:
            if run["role"] == "eval":
                eval_seeds.setdefault(run["contender"], []).append(run["seed"])
        report["tasks"][task]["eval_seeds"] = {name: sorted(seeds) for name, seeds in sorted(eval_seeds.items())}
    tests = {}
    for task, summary in report["tasks"].items():
        for name, entry in summary["contenders"].items():
            for ref, paired in entry["paired"].items():
                tests[(task, name, ref, "auc")] = paired["p_wilcoxon"]
                tests[(task, name, ref, "target")] = paired["p_wilcoxon_target"]
    adjusted = holm(tests)
    for (task, name, ref, metric), p in adjusted.items():
        paired = report["tasks"][task]["contenders"][name]["paired"][ref]
        paired["p_holm" if metric == "auc" else "p_holm_target"] = p
    for summary in report["tasks"].values():
        summary["goal"] = goal(summary)
    report["holm_family"] = len([p for p in tests.values() if p is not None])
    return report


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.2g}"


def _ci(values: list[float | None], digits: int = 3, signed: bool = False) -> str:
    def one(v: float | None) -> str:
        if v is None:
            return "never"
        return f"{v:+.{digits}f}" if signed else fmt(v, digits)

    if values[0] is not None and values[1] is None and values[2] is None:
        return f"{one(values[0])} [no CI]"  # fewer than 3 seeds
    return f"{one(values[0])} [{one(values[1])}, {one(values[2])}]"


def format_task(summary: dict[str, Any], k: int = 8) -> str:
    """The task's table, then its headline lines (per POISE row and comparator)."""
    contenders, has_target = summary["contenders"], summary["target_gain"] is not None
    if not contenders:
        return "No evaluation runs yet."
    headers = [
        "contender",
        "lr",
        "seeds",
        "generated / trained",
        f"AUC avg@{k} [95% CI]",
        "AUC above start",
        f"final avg@{k}",
        "zero-adv prompts",
        "reached target",
        "train s",
    ]
    rows = [
        [
            e["label"],
            f"{e['learning_rate']:g}",
            str(len(e["seeds"])),
            f"{fmt(e['completions_generated'])} / {fmt(e['completions_trained'])}",
            _ci([e["auc"], *e["auc_ci"]]),
            f"{e['auc_above_start']:+.3f}",
            fmt(e["final_avg_at_k"]),
            fmt(e["frac_zero_advantage_prompts"], 2),
            f"{e['reached_target']}/{len(e['seeds'])}",
            fmt(e["train_seconds"]),
        ]
        for e in contenders.values()
    ]
    lines = [format_table(headers, rows), ""]
    headers = [
        "POISE row",
        "vs",
        "AUC wins",
        "AUC diff [95% CI]",
        "p_holm",
        "verdict",
        "to-target ratio [95% CI]",
        "p_holm",
        "verdict",
    ]
    rows = []
    for entry in contenders.values():
        for ref, p in entry["paired"].items():
            ratio = p["completions_to_target_ratio"]
            rows.append(
                [
                    entry["label"],
                    contenders[ref]["label"],
                    f"{p['wins']}/{p['seeds']}",
                    _ci(p["auc_gain_diff"], 3, True),
                    _p(p.get("p_holm")),
                    verdict(p["auc_gain_diff"], p.get("p_holm")),
                    _ci(ratio, 2),
                    _p(p.get("p_holm_target")),
                    verdict(ratio, p.get("p_holm_target"), better_below=True) if has_target else "no target",
                ]
            )
    if not rows:
        return "\n".join(lines)
    legend = (
        "\n\nTo-target ratio: completions the POISE row generated to reach the target over the comparator's, per "
        "seed; 0 means the comparator never reached it within the budget and the POISE row did, never the reverse.\n"
    )
    return "\n".join(lines) + "\n" + format_table(headers, rows) + legend


def format_headline(summary: dict[str, Any]) -> str:
    """Plain words per POISE row and comparator (verdict, seeds won, Holm-corrected p), then the goal's verdict."""
    contenders = summary["contenders"]
    lines = []
    for name in sorted(HEADLINE_CONTENDERS, key=lambda name: name != GOAL_CONTENDER):
        if name not in contenders or not contenders[name]["paired"]:
            continue
        auc, target = [], []
        for ref, p in contenders[name]["paired"].items():
            label, ratio = contenders[ref]["label"], p["completions_to_target_ratio"]
            auc_verdict = verdict(p["auc_gain_diff"], p.get("p_holm"))
            target_verdict = verdict(ratio, p.get("p_holm_target"), better_below=True)
            auc.append(f"{auc_verdict} vs {label} ({p['wins']}/{p['seeds']} seeds, p_holm {_p(p.get('p_holm'))})")
            target.append(f"{_ci(ratio, 2)}× {label}'s ({target_verdict}, p_holm {_p(p.get('p_holm_target'))})")
        label = contenders[name]["label"]
        lines.append(f"- **{label}**, AUC above the start: {'; '.join(auc)}. To the target: {'; '.join(target)}.")
    if not lines:
        return ""
    result = summary["goal"]
    missing = [f"AUC vs {CONTENDERS[ref].label}" for ref in REFERENCES if not result["auc_wins"].get(ref)]
    missing += [
        f"completions to target < {bound}× {CONTENDERS[ref].label}'s"
        for ref, bound in result["ratio_bounds"].items()
        if not result["ratio_upper_below_bound"][ref]
    ]
    state = "**met**" if result["met"] else f"**not met** (short of it: {'; '.join(missing)})"
    bounds = " and ".join(f"{bound}× {CONTENDERS[ref].label}'s" for ref, bound in GOAL_RATIO_BOUNDS.items())
    lines.append(
        f"- **Goal** (POISE (default) wins on AUC above the start against every comparator, and reaches the target "
        f"with at most {bounds} completions, the CI's upper end below): {state}."
    )
    return "\n".join(lines)


def tuning_table(runs: list[dict[str, Any]], rates: dict[str, Any], budget: float) -> dict[str, Any]:
    """Per tuned contender: median AUC over the tuning seeds run so far at each rate, and the chosen rate (None
    until its tuning has finished), rebuilt from the run files so a partial study reports its tuning too."""
    aucs: dict[str, dict[float, list[float]]] = {}
    for run in runs:
        if run["role"] == "tune":
            aucs.setdefault(run["contender"], {}).setdefault(run["learning_rate"], []).append(
                normalized_auc(run, budget)
            )
    return {
        name: {
            "learning_rate": rates.get(name, {}).get("learning_rate"),
            "table": [
                {"learning_rate": lr, "median_auc": median(values), "seeds": len(values)}
                for lr, values in sorted(by_rate.items())
            ],
        }
        for name, by_rate in sorted(aucs.items(), key=lambda item: list(CONTENDERS).index(item[0]))
    }


def format_tuning(summary: dict[str, Any]) -> str:
    """Median AUC over the tuning seeds per contender and rate (seeds run so far in parentheses)."""
    rows = []
    for name, tuned in summary["tuning"].items():
        cells = [f"{row['learning_rate']:g}: {row['median_auc']:.3f} ({row['seeds']})" for row in tuned["table"]]
        chosen = "tuning" if tuned["learning_rate"] is None else f"{tuned['learning_rate']:g}"
        rows.append([CONTENDERS[name].label, chosen, "; ".join(cells)])
    headers = ["contender", "tuned lr", "median AUC per lr (tuning seeds run)"]
    return format_table(headers, rows) if rows else "No tuning runs yet."


def write_report(results_dir: str | Path, allow_mixed_code: bool = False) -> str:
    """efficiency.json, one PNG per task and report.md under `results_dir`; returns the markdown."""
    results_dir = Path(results_dir)
    report = build_report(results_dir, allow_mixed_code)
    parts = []
    for task, summary in report["tasks"].items():
        check, done = summary["check"], summary["runs_done"]
        if not summary["contenders"]:  # a study in progress: report what exists, compare nothing yet
            listed = "; ".join(f"{name}: seeds {seeds}" for name, seeds in summary["eval_seeds"].items())
            parts.append(
                f"## {task}\n\nRuns done: {done['tune']} tuning, {done['eval']} evaluation. No seed has been "
                f"finished by every contender yet, so nothing is compared (evaluation runs: {listed or 'none'}).\n"
            )
            continue
        headline = format_headline(summary)
        seeds = min((p["seeds"] for e in summary["contenders"].values() for p in e["paired"].values()), default=0)
        if seeds and (floor := smallest_p_holm(seeds, max(report["holm_family"], 1))) >= ALPHA:
            headline += (
                f"\n\n**Undecidable as run:** with {seeds} paired seeds and {report['holm_family']} headline tests, "
                f"no Holm-corrected p-value can fall below {floor:.2g}, so every verdict reads undecided; add seeds."
            )
        parts.append(
            f"## {task}\n\nRuns done: {done['tune']} tuning, {done['eval']} evaluation. Task check: "
            f"{fmt(check['tied_g8_groups_at_start'], 2)} of G=8 groups tied in the first 5 steps (median), start "
            f"avg@8 {fmt(check['start_avg_at_k'])}, best final avg@8 {fmt(check['best_final_avg_at_k'])}. AUC over "
            f"the first {fmt(summary['budget'])} completions generated; target: 75% of GRPO-8's median gain "
            f"({fmt(summary['target_gain'])}).\n\n{headline}\n\n{format_tuning(summary)}\n\n{format_task(summary)}\n"
        )
        plot_task(summary, results_dir / f"efficiency_{task}.png")
    markdown = "\n".join(parts) + f"\nHolm's correction across {report['holm_family']} headline tests.\n"
    markdown += "Runs by code: " + ", ".join(f"{key} ({n})" for key, n in report["code"].items()) + ".\n"
    write_json(results_dir / "efficiency.json", report)
    (results_dir / "report.md").write_text(markdown)
    return markdown


def plot_task(summary: dict[str, Any], path: Path) -> Path:
    """Held-out avg@k against completions generated, median over evaluation seeds (left), and its gain above each
    seed's start with the 25-75% band (right): seeds start at different levels, and the statistics are paired on the
    gain, so the spread that matters is the gain's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .study import load_runs

    budget = summary["budget"]
    grid = np.linspace(0, budget, 41)
    runs = [r for r in load_runs(path.parent) if r["task"] == summary["task"] and r["role"] == "eval"]
    fig, (level, gain) = plt.subplots(1, 2, figsize=(13, 5))
    colors = [*plt.get_cmap("tab10").colors, "black"]  # eleven contenders: the cycle of ten would repeat one
    for index, (name, entry) in enumerate(summary["contenders"].items()):
        mine = [
            r
            for r in runs
            if r["contender"] == name
            and r["seed"] in entry["seeds"]  # the seeds the tables count, so every curve starts from the same runs
            and math.isclose(r["learning_rate"], entry["learning_rate"])
        ]
        curves = np.array([[interpolate(r["eval_completions"], r["avg_at_k"], x) for x in grid] for r in mine])
        gains = curves - curves[:, :1]
        solid = CONTENDERS[name].trainer == "poise"
        style = dict(linestyle="-" if solid else "--", color=colors[index % len(colors)])
        level.plot(grid, np.median(curves, 0), label=f"{entry['label']} (lr {entry['learning_rate']:g})", **style)
        gain.plot(grid, np.median(gains, 0), **style)
        if len(mine) > 1:
            low, high = np.percentile(gains, [25, 75], axis=0)
            gain.fill_between(grid, low, high, color=style["color"], alpha=0.1)
    seeds = len(next(iter(summary["contenders"].values()))["seeds"])
    level.set_title(f"{summary['task']}: held-out avg@8, median over {seeds} seeds")
    gain.set_title("gain above each seed's start: median and 25-75% over seeds")
    for ax in (level, gain):
        ax.set_xlabel("completions generated")
        ax.grid(alpha=0.3)
    level.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

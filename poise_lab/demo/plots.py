"""The paper's training-dynamics figure (App. "Training Dynamics") from a TRL run's `log_history`.

Panels over training steps: the paper's five (batch reward, predicted value, token entropy, online MAE, advantage
variance ratio) plus the Pearson correlation between baselines and rewards. A run that did not log a quantity
(e.g. a plain GRPO run has no `poise/*` keys) gets a panel that says so, so one function plots POISE and baselines.
"""

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

# (log key, panel title, y-axis label, colour): the paper's five panels in its order, then Pearson r.
PANELS = (
    ("reward", "Batch reward", "mean reward", "tab:blue"),
    ("poise/value_mean", "Predicted value", "mean g_f(φ)", "tab:purple"),
    ("entropy", "Entropy", "mean token entropy", "tab:orange"),
    ("poise/mae", "Online MAE", "mean |b - r|", "tab:green"),
    ("poise/variance_reduction", "Variance reduction", "1 - Var(A) / Var(R)", "tab:red"),
    ("poise/pearson_r", "Baseline-reward correlation", "Pearson r(b, r)", "tab:brown"),
)
# Second, dashed line on a panel: the paper's Fig. 4 MAE compares per-prompt means, ours per rollout.
OVERLAYS = {"poise/mae": ("poise/group_mae", "per prompt, |mean b - mean r|")}
STATE_FILE = "trainer_state.json"


def load_log_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """`log_history` of a run: `RUN_DIR/trainer_state.json`, else that of the newest `checkpoint-*`.

    `trainer.save_state()` writes the top-level file at the end of a run; checkpoints carry one each, so a run that
    was interrupted can still be plotted from its last checkpoint.
    """
    run_dir = Path(run_dir)
    state = run_dir / STATE_FILE
    if not state.exists():
        checkpoints = [p for p in run_dir.glob("checkpoint-*") if (p / STATE_FILE).exists()]
        checkpoints = [p for p in checkpoints if p.name.split("-", 1)[1].isdigit()]
        if not checkpoints:
            raise FileNotFoundError(
                f"No {STATE_FILE} in {run_dir} or its checkpoint-* folders: pass the trainer's output_dir, and call "
                "`trainer.save_state()` after training (or save checkpoints)."
            )
        state = max(checkpoints, key=lambda p: int(p.name.split("-", 1)[1])) / STATE_FILE
    return json.loads(state.read_text())["log_history"]


def series(log_history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one logged quantity, skipping entries without it and non-finite values."""
    steps, values = [], []
    for entry in log_history:
        value = entry.get(key)
        if isinstance(value, int | float) and math.isfinite(value) and "step" in entry:
            steps.append(int(entry["step"]))
            values.append(float(value))
    return steps, values


def training_dynamics_figure(log_history: list[dict[str, Any]], title: str | None = None) -> Figure:
    """The training-dynamics figure; logging windows with bootstrap steps are shaded.

    TRL averages a metric over each logging window, so `poise/bootstrap` > 0 marks windows that contain bootstrap
    steps. A bare `Figure` renders with Agg and leaves pyplot's global backend (and a notebook's) untouched.
    """
    fig = Figure(figsize=(13, 7), layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    boot_steps, boot_flags = series(log_history, "poise/bootstrap")
    bootstrap_end = max((s for s, flag in zip(boot_steps, boot_flags, strict=True) if flag > 0), default=None)
    legend_drawn = False
    for ax, (key, panel_title, ylabel, colour) in zip(axes, PANELS, strict=True):
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        steps, values = series(log_history, key)
        if not steps:
            ax.text(0.5, 0.5, f"{key}\nnot logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        marker = "o" if len(steps) < 30 else None
        ax.plot(
            steps, values, color=colour, marker=marker, markersize=3, label="per rollout" if key in OVERLAYS else None
        )
        overlay_key, overlay_label = OVERLAYS.get(key, (None, None))
        overlay_steps, overlay_values = series(log_history, overlay_key) if overlay_key else ([], [])
        if overlay_steps:
            ax.plot(
                overlay_steps,
                overlay_values,
                color=colour,
                linestyle="--",
                marker=marker,
                markersize=3,
                label=overlay_label,
            )
        if bootstrap_end is not None:
            ax.axvspan(0, bootstrap_end, color="gray", alpha=0.15, label="bootstrap (probe not trusted)")
        if overlay_steps or (bootstrap_end is not None and not legend_drawn):  # the bootstrap key once is enough
            ax.legend(loc="best", fontsize="small")
            legend_drawn = legend_drawn or bootstrap_end is not None
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def plot_training_dynamics(log_history: list[dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Write `training_dynamics_figure` as a PNG at `path` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    training_dynamics_figure(log_history, title).savefig(path, dpi=110)
    return path

"""Training-dynamics plot: panels from a synthetic log_history, 'not logged' panels, and finding trainer_state.json."""

import json
import math

import pytest

from poise_lab.demo.plots import PANELS, load_log_history, plot_training_dynamics, series, training_dynamics_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_history(steps: int = 60, with_poise: bool = True) -> list[dict]:
    history = []
    for step in range(2, steps + 1, 2):
        entry = {"step": step, "reward": 0.3 + step / 200, "entropy": 0.6 - step / 500, "loss": 0.0}
        if with_poise:
            entry.update(
                {
                    "poise/value_mean": 0.25 + step / 220,
                    "poise/mae": 0.4 - step / 400,
                    "poise/group_mae": 0.2,
                    "poise/variance_reduction": math.nan if step <= 10 else 0.3,  # NaN: undefined that window
                    "poise/pearson_r": 0.5,
                    "poise/bootstrap": 1.0 if step <= 10 else 0.0,
                }
            )
        history.append(entry)
    history.append({"step": steps, "train_runtime": 12.0})  # TRL's closing entry has no metrics
    return history


def panel_texts(fig) -> dict[str, list[str]]:
    return {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes}


def test_series_skips_missing_and_non_finite_values():
    steps, values = series(synthetic_history(20), "poise/variance_reduction")
    assert steps == [12, 14, 16, 18, 20]
    assert values == [0.3] * 5
    assert series(synthetic_history(20), "no/such_key") == ([], [])


def test_figure_has_every_panel_with_data_and_bootstrap_shading():
    fig = training_dynamics_figure(synthetic_history(), title="synthetic")
    assert [ax.get_title() for ax in fig.axes] == [title for _, title, _, _ in PANELS]
    for ax, (key, _, _, _) in zip(fig.axes, PANELS, strict=True):
        assert len(ax.lines) == (2 if key == "poise/mae" else 1) and not ax.texts  # MAE: per rollout and per prompt
        assert len(ax.patches) == 1  # the RLOO bootstrap span
    reward_line = fig.axes[0].lines[0]
    assert list(reward_line.get_xdata()) == list(range(2, 61, 2))
    assert fig.axes[0].get_legend() is not None and fig.axes[1].get_legend() is None  # bootstrap key shown once


def test_missing_metrics_give_not_logged_panels(tmp_path):
    history = synthetic_history(with_poise=False)  # a plain GRPO run
    texts = panel_texts(training_dynamics_figure(history))
    assert texts["Batch reward"] == [] and texts["Entropy"] == []
    for key, title, _, _ in PANELS:
        if key.startswith("poise/"):
            assert texts[title] == [f"{key}\nnot logged"]
    path = plot_training_dynamics(history, tmp_path / "sub" / "grpo.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert plot_training_dynamics([], tmp_path / "empty.png").exists()


def test_plot_writes_a_png(tmp_path):
    path = plot_training_dynamics(synthetic_history(), tmp_path / "dynamics.png", title="synthetic")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000


def test_load_log_history_prefers_top_level_then_newest_checkpoint(tmp_path):
    def write_state(folder, marker):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": marker}]}))

    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        load_log_history(tmp_path)
    write_state(tmp_path / "checkpoint-9", 9.0)
    write_state(tmp_path / "checkpoint-10", 10.0)  # newest by number, not by string order
    (tmp_path / "checkpoint-11").mkdir()  # being written: no state yet
    assert load_log_history(tmp_path)[0]["reward"] == 10.0
    write_state(tmp_path, 0.5)
    assert load_log_history(tmp_path)[0]["reward"] == 0.5

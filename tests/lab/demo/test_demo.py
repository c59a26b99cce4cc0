"""The demo end to end (a few steps), its per-step table, the CLI's knobs and `poise-trl plot` on a real run dir."""

import json

import pytest
from datasets import load_from_disk

from poise_lab.demo import run
from poise_lab.demo.defaults import REAL_DEFAULTS, TOY_DEFAULTS
from poise_lab.demo.plots import load_log_history
from poise_lab.demo.settings import DemoSettings
from poise_trl import cli
from poise_trl.choices import DEFAULT_PRESET
from poise_trl.grpo.resume import ESTIMATOR_FILE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 6


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One short real run: 6 steps of 8 prompts x 2 rollouts, bootstrap for 2 steps then the probe."""
    root = tmp_path_factory.mktemp("demo")
    lines: list[str] = []
    settings = DemoSettings(
        output_dir=root / "run",
        steps=STEPS,
        seed=0,
        min_digits=2,
        max_digits=5,
        num_train=100,
        num_eval=8,
        warmup_steps=10,
        prompts_per_step=8,
        probe_warmup_steps=2,
        eval_k=2,
        logging_steps=1,
        cache_dir=root / "cache",
        show_progress=False,
    )
    summary = run.run_demo(settings, write=lines.append)
    return root / "run", summary, lines


def test_demo_writes_summary_plot_state_and_model(demo_run):
    run_dir, summary, _ = demo_run
    on_disk = json.loads((run_dir / run.SUMMARY_FILE).read_text())
    assert on_disk["avg_at_k_before"] == summary["avg_at_k_before"]
    for key in ("avg_at_k_before", "avg_at_k_after"):
        assert 0.0 <= on_disk[key] <= 1.0
    assert set(on_disk["by_difficulty_after"]) == {"2", "3", "4", "5"}
    assert on_disk["steps"] == STEPS and on_disk["held_out_prompts"] == 8
    assert on_disk["final_window"]["reward"] is not None
    assert on_disk["final_window"]["poise/mae"] is not None
    assert (run_dir / run.PLOT_FILE).read_bytes()[:8] == PNG_MAGIC
    # Relative to the run folder, or a model folder's name: a committed summary names no machine's paths.
    assert (on_disk["plot"], on_disk["final_model_dir"]) == (run.PLOT_FILE, "final")
    assert "/" not in on_disk["model_dir"]
    assert (run_dir / "final" / "config.json").exists()
    assert (run_dir / "final" / ESTIMATOR_FILE).exists()  # the trained probe travels with the final model
    trained_on = load_from_disk(str(run_dir / on_disk["train_prompts"]))  # the prompts, as the run saw them
    assert len(trained_on) == 100 and trained_on.column_names[0] == "prompt"
    assert (on_disk["probe_head"], on_disk["probe_history"]) == ("ridge", False)
    # the demo's bootstrap length is a change from the default preset, and the summary says so
    assert on_disk["probe_preset"] == DEFAULT_PRESET and on_disk["probe_preset_changes"] == {"probe_warmup_steps": 2}
    history = load_log_history(run_dir)
    assert [e["step"] for e in history if "reward" in e] == list(range(1, STEPS + 1))
    assert all("poise/mae" in e for e in history if "reward" in e)


def test_demo_prints_one_table_row_per_log_and_the_switch_to_the_probe(demo_run):
    _, _, lines = demo_run
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "reward"])
    rows = [line.split() for line in lines[header + 1 : header + 1 + STEPS]]
    assert [int(row[0]) for row in rows] == list(range(1, STEPS + 1))
    baselines = [row[-2] for row in rows]
    assert baselines[:2] == ["RLOO", "RLOO"] and baselines[-1] == "probe"
    closing = "\n".join(lines[header + 1 + STEPS :])
    assert "held-out avg@2:" in closing and "variance reduction" in closing


def test_plot_command_on_a_real_run_dir(demo_run, tmp_path, capsys):
    run_dir, _, _ = demo_run
    output = tmp_path / "from_cli.png"
    assert cli.main(["plot", str(run_dir), "--output", str(output), "--title", "real run"]) == 0
    assert output.read_bytes()[:8] == PNG_MAGIC
    assert str(output) in capsys.readouterr().out


def test_cli_help_lists_subcommands_and_demo_knobs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    top = capsys.readouterr().out
    for command in ("demo", "plot", "eval", "probe-bench", "bench"):
        assert command in top
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = capsys.readouterr().out
    for knob in ("--steps", "--seed", "--task-size", "--min-digits", "--max-digits", "--output-dir", "--warmup-steps"):
        assert knob in text


def test_cli_demo_passes_its_knobs_through(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(run, "run_demo", lambda settings: seen.update(vars(settings)))
    argv = ["demo", "--steps", "7", "--seed", "3", "--task-size", "99", "--min-digits", "3", "--max-digits", "6"]
    argv += ["--output-dir", str(tmp_path), "--warmup-steps", "11", "--no-progress", "--task", "hops"]
    argv += ["--probe-head", "logistic", "--probe-history"]
    assert cli.main(argv) == 0
    assert seen["task"] == "hops"
    assert (seen["probe_head"], seen["probe_history"]) == ("logistic", True)
    assert seen["steps"] == 7 and seen["seed"] == 3 and seen["num_train"] == 99
    assert (seen["min_digits"], seen["max_digits"]) == (3, 6)
    assert seen["output_dir"] == str(tmp_path) and seen["warmup_steps"] == 11 and seen["show_progress"] is False


def test_a_named_preset_keeps_its_bootstrap_length_unless_the_caller_sets_it(monkeypatch, tmp_path):
    """Without --probe-preset the demo scales the default preset's bootstrap to its model; a named preset runs as it
    says (None: POISEConfig fills the preset's), except a --probe-warmup-steps the caller gives."""
    assert DemoSettings(model="smollm2-135m").resolved().probe_warmup_steps == REAL_DEFAULTS.probe_warmup_steps
    assert DemoSettings().resolved().probe_warmup_steps == TOY_DEFAULTS.probe_warmup_steps
    named = DemoSettings(model="smollm2-135m", probe_preset="reference").resolved()
    assert named.probe_warmup_steps is None and named.steps == REAL_DEFAULTS.steps
    assert DemoSettings(probe_preset="paper", probe_warmup_steps=6).resolved().probe_warmup_steps == 6
    seen = {}
    monkeypatch.setattr(run, "run_demo", lambda settings: seen.update(vars(settings)))
    assert cli.main(["demo", "--output-dir", str(tmp_path)]) == 0
    assert seen["probe_preset"] is None and seen["probe_warmup_steps"] is None
    assert cli.main(["demo", "--output-dir", str(tmp_path), "--probe-preset", "reference"]) == 0
    assert seen["probe_preset"] == "reference"

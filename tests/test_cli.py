"""`poise-trl`'s own commands as a user meets them: `--version` works, and a user error of `eval` or `train` is one
line on stderr with exit status 2. Every subcommand's `--help` and the lab's commands: tests/lab/test_cli.py."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poise_trl import cli

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"poise-trl {importlib.metadata.version('poise-trl')}\n"


def _one_error_line(capsys, prog: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{prog}: error: ")
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_eval_offline_on_a_hub_benchmark_in_a_real_process(tiny_model_path):
    """The whole path a user runs: console output of a fresh process with the Hub unreachable."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "poise_trl.cli", "eval", str(tiny_model_path), "--benchmarks", "AIME24"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("poise-trl eval: error: "), done.stderr
    assert "HuggingFaceH4/aime_2024" in errors[0] and "local .jsonl" in errors[0]


RECIPE = str(ROOT / "configs" / "poise_qwen3_4b_dapo.yaml")


@pytest.mark.parametrize("argv,prog", [(["train", "--help"], "poise-trl train"), (["--help"], "train_poise.py")])
def test_train_help_is_trl_parsers_and_names_config(argv, prog, capsys):
    """`poise-trl train --help` (and the example script's) is the training parser's own help: `--config` first, then
    every field of the script's arguments, POISEConfig and TRL's ModelConfig."""
    from poise_trl.rlvr.train import run

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv) if prog == "poise-trl train" else run(argv, prog=prog)
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {prog} [-h] [--config RECIPE.yaml]")
    assert "--config RECIPE.yaml  a YAML file" in text and "accelerate launch" in text
    for option in ("--trainer", "--probe_layer", "--num_generations", "--learning_rate", "--model_name_or_path"):
        assert option in text, option


def test_train_with_a_misspelt_option_is_one_line(capsys):
    assert cli.main(["train", "--config", RECIPE, "--use_cpu", "true", "--lerning_rate", "2e-6"]) == 2
    assert "--lerning_rate" in _one_error_line(capsys, "poise-trl train")

"""`poise-trl bench overhead --importance`: POISE with the importance sampler takes its turn beside POISE (default) and
GRPO, and the report carries the sampler's own seconds (its `_select_prompts`) and their share of its cycle."""

import json

import pytest

from .conftest import parse_bench


@pytest.mark.slow
def test_overhead_importance_times_the_sampler(tmp_path, capsys):
    out = tmp_path / "ovh"
    args = parse_bench(
        ["bench", "overhead", "--completion-lengths", "4", "--layouts", "default", "--cycles", "2"]
        + ["--warmup-cycles", "1", "--completions-per-step", "4", "--skip-probe-fit", "--skip-memory"]
        + ["--importance", "--output-dir", str(out)]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert "; importance/POISE: 4 tok, TRL default ×" in printed[-1]
    assert "; sampler share of its cycle: " in printed[-1]
    assert any(line.startswith("| 4 tok, TRL default (importance) |") for line in printed)
    result = json.loads((out / "overhead.json").read_text())
    assert result["settings"]["importance"] is True
    (row,) = result["timing"]
    assert len(row["poise_importance_seconds"]) == len(row["poise_seconds"]) == len(row["grpo_seconds"]) == 2
    assert row["importance_selection_seconds"]["n"] == row["importance_selection_share"]["n"] == 2
    assert 0 < row["importance_selection_share"]["min"] <= row["importance_selection_share"]["max"] < 1
    ratios = sorted(a / b for a, b in zip(row["poise_importance_seconds"], row["poise_seconds"], strict=True))
    assert row["importance_poise_time_ratio"]["median"] == pytest.approx(sum(ratios) / 2)

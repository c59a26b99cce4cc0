"""`poise-trl bench`: the parser, overhead helpers and smoke runs (efficiency v3 has its own file, test_efficiency.py).

Timings are never asserted: only that the commands run, print a table ending in a summary line, and write JSON
with the expected fields.
"""

import argparse
import json
import threading

import pytest
import torch

from poise_lab.bench.common import summarize
from poise_lab.bench.contenders import CONTENDERS
from poise_lab.bench.efficiency import micro_batching
from poise_lab.bench.overhead.timing import Baton
from poise_lab.bench.settings import EfficiencySettings
from poise_lab.bench.trainers import DynamicSampling
from poise_trl.choices import HEADS

from .conftest import parse_bench


def test_parser_registers_both_subcommands():
    efficiency = parse_bench(["bench", "efficiency"])
    assert efficiency.bench_command == "efficiency" and callable(efficiency.func)
    assert efficiency.contenders == list(CONTENDERS) and len(efficiency.seeds) >= 10
    assert {"grpo8", "dapo_ds", "rloo2", "grpo2", "poise_paper", "poise"} <= set(efficiency.contenders)
    assert efficiency.jobs is None and efficiency.gradient_checkpointing is None  # resolved by --model at run time
    assert parse_bench(["bench", "efficiency", "--no-gradient-checkpointing"]).gradient_checkpointing is False
    overhead = parse_bench(["bench", "overhead"])
    assert overhead.bench_command == "overhead" and callable(overhead.func) and overhead.func is not efficiency.func
    assert max(overhead.completion_lengths) >= 128 and overhead.layouts == ["default", "trl-pass"]
    assert overhead.capture_route is False
    with pytest.raises(SystemExit):
        parse_bench(["bench"])


def test_summarize_counts_never_reached_as_infinite():
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summarize([1.0, None, 3.0, None])["median"] is None  # two of four never reached: the median is not finite
    assert summarize([1.0, None, 3.0]) == {"median": 3.0, "min": 1.0, "max": None, "n": 3}
    assert summarize([])["n"] == 0


def test_micro_batching_keeps_the_completions_per_step():
    assert micro_batching(32, None) == dict(
        per_device_train_batch_size=32, gradient_accumulation_steps=1, steps_per_generation=1
    )
    assert micro_batching(32, 4) == dict(
        per_device_train_batch_size=4, gradient_accumulation_steps=8, steps_per_generation=8
    )
    with pytest.raises(SystemExit):
        micro_batching(32, 5)


def test_dynamic_sampling_concatenates_rounds_with_padding():
    sampler = DynamicSampling()
    sampler.processing_class = argparse.Namespace(pad_token_id=9)

    def round_output(rows: int, prompt_width: int, completion_width: int) -> dict:
        return {
            "prompt_ids": torch.arange(rows * prompt_width).view(rows, prompt_width),
            "prompt_mask": torch.ones(rows, prompt_width, dtype=torch.long),
            "completion_ids": torch.arange(rows * completion_width).view(rows, completion_width),
            "completion_mask": torch.ones(rows, completion_width, dtype=torch.long),
            "advantages": torch.arange(rows, dtype=torch.float),
            "num_items_in_batch": torch.tensor(rows * completion_width),
        }

    first, second = round_output(4, 3, 2), round_output(4, 2, 5)  # 2 groups of 2 per round
    merged = sampler._concatenate([(first, torch.tensor([1])), (second, torch.tensor([0]))], group=2)
    assert merged["prompt_ids"].shape == (4, 3) and merged["completion_ids"].shape == (4, 5)
    assert merged["advantages"].tolist() == [2.0, 3.0, 0.0, 1.0]  # group 1 of round 1, then group 0 of round 2
    assert merged["prompt_ids"][2].tolist() == [9, 0, 1] and merged["prompt_mask"][2].tolist() == [0, 1, 1]
    assert merged["completion_ids"][0].tolist() == [4, 5, 9, 9, 9] and merged["completion_mask"][0].sum() == 2
    assert int(merged["num_items_in_batch"]) == 2 * 2 + 2 * 5


@pytest.mark.parametrize("parties", [2, 3])
def test_baton_takes_turns_in_rounds_of_alternating_order(parties):
    """One cycle each per round, every round in the reverse order of the one before: each contender's k-th cycle is
    taken first in one round and last in the next, so a drift of the machine between turns biases no paired ratio.
    A party that finishes is skipped."""
    baton, order, turns = Baton(parties=parties, timeout=30), [], [3] * (parties - 1) + [2]

    def worker(me: int) -> None:
        baton.arrive(me)
        for turn in range(turns[me]):
            order.append(me)
            baton.pass_on(me, finished=turn == turns[me] - 1)
            if turn < turns[me] - 1:
                baton.wait_turn(me)
        baton.pass_on(me, finished=True)  # as CycleTimer.on_train_end does, while another may hold the turn

    threads = [threading.Thread(target=worker, args=(i,)) for i in reversed(range(parties))]  # start order: any
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    last = parties - 1  # takes 2 turns, the others 3
    expected = {2: [0, 1, 1, 0, 0], 3: [0, 1, 2, 2, 1, 0, 0, 1]}[parties]
    assert order == expected and order.count(last) == 2


def test_baton_abort_releases_waiters():
    baton = Baton(parties=2, timeout=30)
    errors = []

    def waiter() -> None:
        try:
            baton.arrive(1)
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=waiter)
    thread.start()
    baton.abort()
    thread.join(30)
    assert errors and not thread.is_alive()


@pytest.mark.slow
def test_efficiency_smoke_with_a_model_and_dataset(tmp_path, tiny_model_path, capsys):
    """The real-model path (on a GPU in practice) on the tiny model and a local math file: it runs end to end."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(16)))
    out = tmp_path / "real"
    args = parse_bench(
        ["bench", "efficiency", "--model", str(tiny_model_path), "--train-dataset", str(data)]
        + ["--eval-dataset", str(data), "--eval-limit", "2", "--eval-k", "2", "--max-completion-length", "4"]
        + ["--contenders", "poise", "grpo8", "--seeds", "0", "--budget", "8", "--eval-every", "8"]
        + ["--completions-per-step", "8", "--per-device-batch-size", "4", "--output-dir", str(out)]
    )
    assert args.func(args) == 0
    settings = EfficiencySettings.from_args(args)  # what the handler ran with; the namespace stays as parsed
    assert settings.gradient_checkpointing and settings.jobs == 1  # resolved for --model
    result = json.loads((out / "efficiency.json").read_text())
    assert result["settings"]["model"] == str(tiny_model_path) and set(result["tasks"]) == {"model"}
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("runs/model/*/*.json"))]
    assert [run["eval_steps"] for run in runs] == [[0, 1], [0, 1]]
    assert [run["completions_trained"] for run in runs] == [8, 8]  # two micro-batches of 4, one step


def test_probe_fit_times_each_head_against_ridge_and_reports_a_row_for_it():
    from poise_lab.bench.overhead import format_report, probe_fit_benchmark

    results = probe_fit_benchmark(1, hidden=80, rows=96, heads=["logistic", "ensemble"])
    for preset in results:
        assert list(preset["heads"]) == ["logistic", "ensemble"]
        for head in preset["heads"].values():
            assert head["cpu_ratio_to_ridge"] == pytest.approx(head["torch_cpu_seconds"] / preset["torch_cpu_seconds"])
    report = format_report([], [], results, {"group_size": 2}).splitlines()
    assert sum(line.startswith("| logistic head fit (") for line in report) == 2
    with pytest.raises(ValueError, match=r"Unknown value heads \['forest'\]"):
        probe_fit_benchmark(1, hidden=80, rows=96, heads=["forest"])


@pytest.mark.slow
def test_overhead_smoke(tmp_path, capsys):
    """Timing and the probe fit; peak memory (fresh worker processes per contender) is checked in the --prefix smoke,
    whose workers include POISE's and GRPO's."""
    out = tmp_path / "ovh"
    args = parse_bench(
        ["bench", "overhead", "--completion-lengths", "4", "--cycles", "1", "--warmup-cycles", "1"]
        + ["--skip-memory", "--completions-per-step", "4", "--per-device-batch-size", "2"]
        + ["--probe-fit-repeats", "1"]
        + ["--probe-fit-rows", "96", "--probe-fit-hidden", "80", "--capture-route", "--output-dir", str(out)]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("Summary: POISE/GRPO step time")
    assert "; own pass/GRPO: 4 tok, TRL default ×" in printed[-1]
    assert any(line.startswith("| 4 tok, TRL default (own pass) |") for line in printed)
    assert sum(line.startswith("| probe fit ") for line in printed) == 2  # a row per preset, then one per other head
    assert any(line.startswith("| ensemble head fit (release)") for line in printed)
    result = json.loads((out / "overhead.json").read_text())
    assert set(result) >= {"settings", "environment", "timing", "memory", "memory_method", "probe_fit", "headline"}
    # Folders relative to the run (the file gets committed), not this machine's tmp_path.
    assert (result["settings"]["output_dir"], result["settings"]["cache_dir"]) == (".", "models")
    assert str(tmp_path) not in json.dumps(result)
    assert [t["name"] for t in result["timing"]] == ["4 tok, TRL default", "4 tok, TRL pass"]
    for row, own_passes in zip(result["timing"], (1, 0), strict=True):
        assert len(row["poise_seconds"]) == len(row["grpo_seconds"]) == len(row["poise_pass_seconds"]) == 1
        assert row["poise_feature_passes_per_cycle"] == [0]  # the loss's forward or TRL's pass: no pass added
        assert row["poise_pass_feature_passes_per_cycle"] == [own_passes]  # "pass": its own where TRL runs none
        assert set(row["time_ratio"]) == set(row["own_pass_time_ratio"]) == {"median", "min", "max", "n"}
        # one timed cycle, round 1 of the alternating order (the warm-up was round 0): GRPO went first
        assert row["time_ratio_by_order"]["grpo_first"]["median"] == row["time_ratio"]["median"]
        assert row["time_ratio_by_order"]["poise_first"]["n"] == 0
    assert result["memory"] == []  # measured in the --prefix smoke below: its workers are these contenders' too
    assert [p["preset"] for p in result["probe_fit"]] == ["paper", "release"]
    assert list(result["probe_fit"][0]["heads"]) == [name for name in HEADS if name != "ridge"]  # every head but ridge
    assert "per-prefix" not in printed[-1] and "poise_prefix_seconds" not in result["timing"][0]
    paper = result["probe_fit"][0]
    assert paper["shape"] == [96, 163]
    assert paper["max_abs_prediction_difference"] < 1e-4 * max(1.0, paper["prediction_std"])  # same math as sklearn


@pytest.mark.slow
def test_overhead_prefix_times_the_per_prefix_trainer_serving_token_advantages(tmp_path, capsys):
    """`--prefix`: a third trainer takes its turns; every timed step served token advantages (the probe is trusted
    after one step), and its time and peak memory are reported against GRPO and POISE (default)."""
    out = tmp_path / "ovh"
    args = parse_bench(
        ["bench", "overhead", "--completion-lengths", "4", "--layouts", "default", "trl-pass", "--cycles", "1"]
        + ["--warmup-cycles", "1", "--memory-cycles", "2", "--completions-per-step", "4", "--skip-probe-fit"]
        + ["--prefix", "--output-dir", str(out)]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert "; per-prefix/GRPO: 4 tok, TRL default ×" in printed[-1] and "; per-prefix/POISE: " in printed[-1]
    assert any(line.startswith("| 4 tok, TRL pass (per-prefix) |") for line in printed)
    result = json.loads((out / "overhead.json").read_text())
    assert result["settings"]["prefix"] is True
    for row in result["timing"]:
        assert len(row["poise_prefix_seconds"]) == len(row["poise_seconds"]) == len(row["grpo_seconds"]) == 1
        assert row["prefix_timed_generations"] == row["prefix_served_generations"] == 1
        assert row["poise_probe_fit_seconds_per_step"]["n"] == row["poise_prefix_probe_fit_seconds_per_step"]["n"] == 1
        assert row["poise_prefix_feature_passes_per_cycle"] == row["poise_feature_passes_per_cycle"]  # same pass
        ratio = row["poise_prefix_seconds"][0] / row["poise_seconds"][0]
        assert row["prefix_poise_time_ratio"]["median"] == pytest.approx(ratio)
    assert [row["name"] for row in result["memory"]] == ["4 tok, TRL default", "4 tok, TRL pass"]
    for row in result["memory"]:
        for contender in ("poise", "grpo"):
            assert row[contender]["peak_mib"] >= row[contender]["start_mib"] > 0
        assert row["training_peak_ratio"] is not None
        assert row["poise_prefix"]["peak_mib"] >= row["poise_prefix"]["start_mib"] > 0
        assert row["prefix_training_peak_ratio"] is not None and row["prefix_poise_training_peak_ratio"] is not None

"""`poise-trl bench`: smoke runs of both commands (few steps, few seeds) and the helpers they report with.

Timings are never asserted: only that the commands run, print a table ending in a summary line, and write JSON
with the expected fields.
"""

import argparse
import json
import math
import threading

import pytest
import torch

from poise_trl.bench.cli import add_bench_parser
from poise_trl.bench.common import CONTENDERS, PAPER_PINS, bootstrap_median, spread
from poise_trl.bench.efficiency import _config, micro_batching
from poise_trl.bench.overhead.timing import Baton
from poise_trl.bench.summary import _paired, completions_to_gain, normalized_auc, reference_gain
from poise_trl.bench.trainers import DynamicSampling, unavailable_reason


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="poise-trl")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_parser_registers_both_subcommands():
    efficiency = _parse(["bench", "efficiency"])
    assert efficiency.bench_command == "efficiency" and callable(efficiency.func)
    assert efficiency.contenders == list(CONTENDERS) and len(efficiency.seeds) >= 10
    assert {"grpo8", "dapo_ds", "rloo2", "grpo2", "poise_paper", "poise"} <= set(efficiency.contenders)
    assert efficiency.jobs is None and efficiency.gradient_checkpointing is None  # resolved by --model at run time
    assert _parse(["bench", "efficiency", "--no-gradient-checkpointing"]).gradient_checkpointing is False
    overhead = _parse(["bench", "overhead"])
    assert overhead.bench_command == "overhead" and callable(overhead.func) and overhead.func is not efficiency.func
    assert max(overhead.completion_lengths) >= 128 and overhead.extra_passes == [1, 0]
    with pytest.raises(SystemExit):
        _parse(["bench"])


def test_spread_counts_never_reached_as_infinite():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([1.0, None, 3.0, None])["median"] is None  # two of four never reached: the median is not finite
    assert spread([1.0, None, 3.0]) == {"median": 3.0, "min": 1.0, "max": None, "n": 3}
    assert spread([])["n"] == 0


def test_completions_to_gain_is_per_seed_and_interpolated():
    run = {"eval_completions": [0, 64, 128, 192], "avg_at_k": [0.5, 0.52, 0.61, 0.7]}
    assert math.isclose(completions_to_gain(run, 0.1), 64 + 64 * 0.08 / 0.09)  # crosses 0.6 between 64 and 128
    assert completions_to_gain(run, 0.2) == 192
    assert completions_to_gain(run, 0.0) == 0
    assert completions_to_gain(run, 0.3) is None
    runs = [
        {"contender": "grpo8", "avg_at_k": [0.5, 0.7]},
        {"contender": "grpo8", "avg_at_k": [0.6, 0.7]},
        {"contender": "poise", "avg_at_k": [0.5, 0.9]},
    ]
    assert math.isclose(reference_gain(runs, "grpo8"), 0.15)  # the reference's median gain over seeds (0.2, 0.1)
    assert reference_gain([{"contender": "grpo8", "avg_at_k": [0.5, 0.4]}], "grpo8") is None


def test_auc_is_the_mean_accuracy_over_the_budget():
    run = {"eval_completions": [0, 100, 200, 300], "avg_at_k": [0.2, 0.4, 0.4, 1.0]}
    assert math.isclose(normalized_auc(run, 200), (0.3 * 100 + 0.4 * 100) / 200)
    assert math.isclose(normalized_auc(run, 250), (0.3 * 100 + 0.4 * 100 + 0.55 * 50) / 250)  # interpolated end
    with pytest.raises(ValueError):
        normalized_auc(run, 400)  # a budget the run does not cover


def test_bootstrap_median_and_paired_ratios():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 100.0]
    middle, low, high = bootstrap_median(values)
    assert middle == 5.0 and 1.0 < low < middle < high < 100.0  # the median's CI resists the outlier
    assert bootstrap_median(values) == [middle, low, high]  # seeded: a re-run reports the same interval
    assert bootstrap_median([None, None, 1.0]) == [None, 1.0, None]  # never reached counts as +inf
    mine, reference = {0: 50.0, 1: None, 2: 30.0, 3: None}, {0: 100.0, 1: 80.0, 2: None, 3: None}
    # Conservative for `mine`: never reached is an infinite ratio (None); the reference never reached stands at its
    # final count (a bound); neither reached says nothing.
    assert _paired(mine, reference, "ratio", {0: 200, 1: 200, 2: 120, 3: 200}) == [0.5, None, 0.25]
    with pytest.raises(ValueError):
        _paired(mine, reference, "ratio")
    assert _paired({0: 0.6, 5: 0.1}, {0: 0.5}, "difference") == [pytest.approx(0.1)]  # only seeds both ran


def test_contenders_are_configs_and_missing_fields_are_reported(tmp_path):
    args = _parse(["bench", "efficiency", "--completions-per-step", "8"])
    args.learning_rate, args.gradient_checkpointing = 1e-5, False
    task = argparse.Namespace(max_completion_length=4)
    paper = _config(CONTENDERS["poise_paper"], task, args, 0, tmp_path)
    assert paper.probe_preset == "paper" and paper.loss_type == "dapo" and paper.num_generations == 2
    for key, value in PAPER_PINS.items():  # pinned to the paper where this library version has the field
        assert getattr(paper, key, value) == value
    dapo = _config(CONTENDERS["dapo_ds"], task, args, 0, tmp_path)
    assert dapo.num_generations == 8 and dapo.scale_rewards == "group"
    for name in ("poise_partner", "poise_shrunk", "poise_select"):
        contender = CONTENDERS[name]
        reason = unavailable_reason(contender)
        if reason is None:  # issue 12 merged: the one change is set on top of the paper's algorithm
            config = _config(contender, task, args, 0, tmp_path)
            assert all(getattr(config, key) == value for key, value in contender.overrides.items())
        else:
            assert "has no field" in reason and next(iter(set(contender.overrides) - {"probe_preset"})) in reason


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


def test_baton_alternates_threads_strictly():
    baton, order = Baton(parties=2, timeout=30), []

    def worker(me: int) -> None:
        baton.arrive(me)
        for turn in range(3):
            order.append(me)
            baton.pass_on(me, finished=turn == 2)
            if turn < 2:
                baton.wait_turn(me)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (1, 0)]  # start order must not matter
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert order == [0, 1, 0, 1, 0, 1]


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


# The references of every ratio, both POISE rows and the one contender with its own generation path (selection).
SMOKE_CONTENDERS = ("grpo8", "dapo_ds", "rloo2", "poise_paper", "poise", "poise_select")


@pytest.mark.slow
def test_efficiency_smoke(tmp_path, capsys):
    out = tmp_path / "eff"
    steps, budget = 2, 8
    args = _parse(
        ["bench", "efficiency", "--seeds", "0", "1", "--jobs", "2", "--steps", str(steps), "--eval-every", "1"]
        + ["--completions-per-step", str(budget), "--eval-k", "2", "--num-eval", "14", "--warmup-steps", "5"]
        + ["--dapo-max-rounds", "2", "--output-dir", str(out), "--contenders", *SMOKE_CONTENDERS]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("Summary, paired by seed")
    assert any(line.startswith("| POISE (default) G=2 |") for line in printed)
    assert any(line.startswith("Task check:") for line in printed)
    result = json.loads((out / "efficiency.json").read_text())
    assert (out / "efficiency.png").stat().st_size > 0
    assert set(result) >= {"settings", "environment", "summary", "runs", "headline", "wall_seconds", "task_check"}
    ran = [name for name in SMOKE_CONTENDERS if name not in result["settings"]["unavailable"]]
    assert set(result["summary"]) == set(ran) and len(result["runs"]) == 2 * len(ran)
    for name, stats in result["summary"].items():
        assert stats["name"] == name
        assert set(stats) >= {"completions_generated", "completions_trained", "auc", "auc_ci", "final_avg_at_k"}
        assert set(stats["paired"]) == {"grpo8", "dapo_ds", "rloo2"}
        assert all(len(interval) == 3 for interval in stats["paired"].values())
        assert len(stats["auc_ci"]) == 2 and stats["completions_trained"] == steps * budget
    for seed in (0, 1):  # one model and evaluator per seed, each run in its own process: the same start
        assert len({run["avg_at_k"][0] for run in result["runs"] if run["seed"] == seed}) == 1
    for run in result["runs"]:
        assert run["eval_steps"] == [0, 1, 2] and run["completions_trained"] == steps * budget
        assert run["eval_completions"][0] == 0 and run["eval_completions"][-1] == run["completions_generated"]
        assert run["tokens_generated"] > 0 and run["prefill_tokens"] > 0 and run["forward_rows"] >= steps * budget
        per_step = run["per_step"]
        assert len(per_step["grad_norm"]) == steps and all(g is not None for g in per_step["grad_norm"])
        if run["contender"] == "dapo_ds":  # ties were dropped and regenerated: it generates more than it trains
            if any(per_step["frac_reward_zero_std"]):
                assert run["completions_generated"] > run["completions_trained"]
            assert all(1 <= rounds <= 2 for rounds in per_step["dapo/rounds"])
        else:
            assert run["completions_generated"] == run["completions_trained"]
            if not run["contender"].startswith("poise"):  # without a probe, zero advantage <=> a tied group
                assert per_step["frac_zero_advantage_prompts"] == per_step["frac_reward_zero_std"]


@pytest.mark.slow
def test_efficiency_smoke_with_a_model_and_dataset(tmp_path, tiny_model_path, capsys):
    """The real-model path (on a GPU in practice) on the tiny model and a local math file: it runs end to end."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(16)))
    out = tmp_path / "real"
    args = _parse(
        ["bench", "efficiency", "--model", str(tiny_model_path), "--train-dataset", str(data)]
        + ["--eval-dataset", str(data), "--eval-limit", "2", "--eval-k", "2", "--max-completion-length", "4"]
        + ["--contenders", "poise", "grpo8", "--seeds", "0", "--steps", "1", "--eval-every", "1"]
        + ["--completions-per-step", "8", "--per-device-batch-size", "4", "--output-dir", str(out)]
    )
    assert args.func(args) == 0
    result = json.loads((out / "efficiency.json").read_text())
    settings = result["settings"]
    assert settings["model"] == str(tiny_model_path) and settings["gradient_checkpointing"] and settings["jobs"] == 1
    assert [run["eval_steps"] for run in result["runs"]] == [[0, 1], [0, 1]]
    assert [run["completions_trained"] for run in result["runs"]] == [8, 8]  # two micro-batches of 4, one step


@pytest.mark.slow
def test_overhead_smoke(tmp_path, capsys):
    out = tmp_path / "ovh"
    args = _parse(
        ["bench", "overhead", "--completion-lengths", "4", "--cycles", "1", "--warmup-cycles", "1"]
        + ["--memory-cycles", "1", "--completions-per-step", "4", "--per-device-batch-size", "2"]
        + ["--probe-fit-repeats", "1"]
        + ["--probe-fit-rows", "96", "--probe-fit-hidden", "80", "--output-dir", str(out)]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("Summary: POISE/GRPO step time") and printed[-2].startswith("| probe fit ")
    result = json.loads((out / "overhead.json").read_text())
    assert set(result) >= {"settings", "environment", "timing", "memory", "memory_method", "probe_fit", "headline"}
    assert [t["name"] for t in result["timing"]] == ["4 tok, +1 pass", "4 tok, +0 pass"]
    for row, expected_passes in zip(result["timing"], (1, 0), strict=True):
        assert len(row["poise_seconds"]) == len(row["grpo_seconds"]) == 1
        assert row["poise_feature_passes_per_cycle"] == [expected_passes]  # POISE's pass only where TRL runs none
        assert set(row["time_ratio"]) == {"median", "min", "max", "n"}
    for row in result["memory"]:
        for contender in ("poise", "grpo"):
            assert row[contender]["peak_mib"] >= row[contender]["start_mib"] > 0
        assert row["training_peak_ratio"] is not None
    assert [p["preset"] for p in result["probe_fit"]] == ["paper", "release"]
    paper = result["probe_fit"][0]
    assert paper["shape"] == [96, 163]
    assert paper["max_abs_prediction_difference"] < 1e-4 * max(1.0, paper["prediction_std"])  # same math as sklearn

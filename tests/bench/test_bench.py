"""`poise-trl bench`: smoke runs of both commands (few steps, one seed) and the helpers they report with.

Timings are never asserted: only that the commands run, print a table ending in a summary line, and write JSON
with the expected fields.
"""

import argparse
import json
import math
import threading

import pytest

from poise_trl.bench.cli import add_bench_parser
from poise_trl.bench.common import CONTENDERS, spread
from poise_trl.bench.efficiency import completions_to_gain, reference_gain
from poise_trl.bench.overhead import Baton


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="poise-trl")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_parser_registers_both_subcommands():
    efficiency = _parse(["bench", "efficiency"])
    assert efficiency.bench_command == "efficiency" and callable(efficiency.func)
    assert efficiency.contenders == list(CONTENDERS) and len(efficiency.seeds) >= 5
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


@pytest.mark.slow
def test_efficiency_smoke(tmp_path, capsys):
    out = tmp_path / "eff"
    args = _parse(
        ["bench", "efficiency", "--seeds", "0", "--steps", "2", "--eval-every", "1", "--completions-per-step", "8"]
        + ["--eval-k", "2", "--num-eval", "14", "--warmup-steps", "5", "--output-dir", str(out)]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("Summary vs GRPO G=8") and printed[-2].startswith("| GRPO G=2 |")
    result = json.loads((out / "efficiency.json").read_text())
    assert (out / "efficiency.png").stat().st_size > 0
    assert set(result) >= {
        "settings",
        "environment",
        "summary",
        "runs",
        "headline",
        "wall_seconds",
        "target_sensitivity",
    }
    assert set(result["summary"]) == set(CONTENDERS)
    for stats in result["summary"].values():
        assert set(stats) >= {
            "start_avg_at_k",
            "final_avg_at_k",
            "gain",
            "completions_to_target",
            "mean_grad_norm",
            "frac_zero_advantage_prompts",
            "frac_reward_zero_std",
            "train_seconds",
            "vs_grpo8",
        }
    assert result["summary"]["grpo8"]["vs_grpo8"]["train_seconds"] == 1.0
    assert len(result["runs"]) == len(CONTENDERS)
    starts = {run["avg_at_k"][0] for run in result["runs"]}
    assert len(starts) == 1  # one model and evaluator per seed: every contender starts from the same accuracy
    for run in result["runs"]:
        assert run["eval_steps"] == [0, 1, 2] and run["eval_completions"] == [0, 8, 16]
        per_step = run["per_step"]
        assert len(per_step["grad_norm"]) == 2 and all(g is not None for g in per_step["grad_norm"])
        if run["contender"] != "poise":  # without POISE's probe, zero advantage <=> a degenerate group
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
        + ["--completions-per-step", "8", "--output-dir", str(out)]
    )
    assert args.func(args) == 0
    result = json.loads((out / "efficiency.json").read_text())
    assert result["settings"]["model"] == str(tiny_model_path)
    assert [run["eval_steps"] for run in result["runs"]] == [[0, 1], [0, 1]]


@pytest.mark.slow
def test_overhead_smoke(tmp_path, capsys):
    out = tmp_path / "ovh"
    args = _parse(
        ["bench", "overhead", "--completion-lengths", "4", "--cycles", "1", "--warmup-cycles", "1"]
        + ["--memory-cycles", "1", "--completions-per-step", "4", "--probe-fit-repeats", "1"]
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

"""`poise-trl bench efficiency` v3: the study's run files, learning-rate tuning, statistics and a smoke run.

Timings are never asserted.
"""

import argparse
import dataclasses
import itertools
import json
import math

import pytest
import torch

import poise_trl
from poise_lab.bench import study as study_module
from poise_lab.bench.cli import add_efficiency_parser
from poise_lab.bench.common import environment, smallest_p_holm
from poise_lab.bench.contenders import CONTENDERS, REFERENCES, paired_references
from poise_lab.bench.efficiency import HeldOutCurve, _config, micro_batching, task_factory
from poise_lab.bench.report import _log_ratio, _wilcoxon, goal, holm, summarize_task, verdict, write_report
from poise_lab.bench.settings import EfficiencySettings
from poise_lab.bench.study import run_path, validate
from poise_lab.bench.summary import completions_to_gain, normalized_auc
from poise_lab.bench.trainers import DynamicSampling, _TrainedAccounting, unavailable_reason

from .conftest import parse_bench


def test_parser_defaults_size_the_study_per_the_issue():
    args = parse_bench(["bench", "efficiency"])
    assert len(args.seeds) >= 20 and len(args.lr_grid) >= 3 and not set(args.seeds) & set(args.tuning_seeds)
    assert all(b / a == 2 for a, b in itertools.pairwise(sorted(args.lr_grid)))  # a factor of 2 apart
    assert {"grpo8_noscale", "dapo_ds_carry", "dapo_ds", "rloo2", "poise", "poise_paper"} <= set(args.contenders)
    args = parse_bench(["bench", "efficiency", "--task", "sort", "hops", "--task-seeds", "hops=0-9"])
    assert args.task == ["sort", "hops"] and args.task_seeds == [("hops", list(range(10)))]
    with pytest.raises(SystemExit):
        parse_bench(["bench", "efficiency", "--task-seeds", "nosuchtask=0-3"])


def test_every_flag_is_a_setting_with_a_role():
    """A new flag must be declared in EfficiencySettings, where its role says whether it decides a run's result (and
    so joins the identity a resumed study must match)."""
    parser = argparse.ArgumentParser()
    add_efficiency_parser(parser.add_subparsers())
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["efficiency"]._actions} - {"help"}
    assert flags == {f.name for f in dataclasses.fields(EfficiencySettings)}
    identity = EfficiencySettings.from_args(parse_bench(["bench", "efficiency"])).identity()
    assert {"budget", "completions_per_step", "model", "eval_seed", "warmup_steps"} <= set(identity)
    assert not {"jobs", "cpu_threads", "output_dir", "seeds", "learning_rate"} & set(identity)


def test_tuning_and_evaluation_seeds_must_be_disjoint():
    args = parse_bench(["bench", "efficiency", "--tune-lr", "--seeds", "0", "1", "--tuning-seeds", "1", "2"])
    with pytest.raises(SystemExit, match="overlap"):
        validate(EfficiencySettings.from_args(args), [CONTENDERS["grpo8"]])
    argv = ["--tune-lr", "--seeds", "0", "--task", "sort", "hops", "--task-seeds", "hops=1000"]
    args = parse_bench(["bench", "efficiency", *argv])  # a task's own seeds count too
    with pytest.raises(SystemExit, match="overlap"):
        validate(EfficiencySettings.from_args(args), [CONTENDERS["grpo8"]])


def test_contender_configs(tmp_path):
    args = EfficiencySettings.from_args(
        parse_bench(["bench", "efficiency", "--completions-per-step", "8", "--budget", "20"])
    )
    assert args.gradient_checkpointing is False  # the tiny demo model's default
    task = argparse.Namespace(max_completion_length=4)
    paper = _config(CONTENDERS["poise_paper"], task, args, 0, tmp_path, 3e-5)
    assert paper.probe_preset == "paper" and paper.loss_type == "dapo" and paper.learning_rate == 3e-5
    assert paper.max_steps == 3  # enough steps of 8 to reach the budget of 20
    assert not paper.preset_changes()  # every setting of the paper's algorithm, from its preset
    assert (paper.probe_partner_reward, paper.probe_bootstrap, paper.prompt_selection) == (False, "rloo", None)
    assert _config(CONTENDERS["grpo8"], task, args, 0, tmp_path, 1e-5).scale_rewards == "group"
    assert _config(CONTENDERS["grpo8_noscale"], task, args, 0, tmp_path, 1e-5).scale_rewards == "none"
    carry = _config(CONTENDERS["dapo_ds_carry"], task, args, 0, tmp_path, 1e-5)
    assert carry.num_generations == 8 and carry.loss_type == "dapo" and carry.scale_rewards == "group"
    for name in ("poise_partner", "poise_shrunk", "poise_select", "poise_prefix"):
        if unavailable_reason(CONTENDERS[name]) is None:
            config = _config(CONTENDERS[name], task, args, 0, tmp_path, 1e-5)
            assert all(getattr(config, k) == v for k, v in CONTENDERS[name].overrides.items())
    assert micro_batching(32, 4)["gradient_accumulation_steps"] == 4 * 2
    a2po = _config(CONTENDERS["a2po"], task, args, 0, tmp_path, 1e-5)  # one completion per prompt, no group
    assert a2po.per_device_train_batch_size == 8 and a2po.max_steps == 20 and not hasattr(a2po, "loss_type")
    if unavailable_reason(CONTENDERS["cgrpo"]) is None:
        cgrpo = _config(CONTENDERS["cgrpo"], task, args, 0, tmp_path, 1e-5)
        assert cgrpo.budget_grid == [2, 4, 8] and cgrpo.num_generations == 8 and cgrpo.loss_type == "dapo"
        assert cgrpo.max_steps == 10  # one prompt a step stopped at 2 completions each time reaches the budget of 20
        assert cgrpo.recalibrate_every == 50  # its default
        assert _config(CONTENDERS["cgrpo_once"], task, args, 0, tmp_path, 1e-5).recalibrate_every == 0


def test_an_ablation_runs_at_the_tuned_rate_of_the_contender_it_changes():
    from types import SimpleNamespace

    settings = EfficiencySettings.from_args(parse_bench(["bench", "efficiency", "--tune-lr"]))
    study = SimpleNamespace(settings=settings)
    with pytest.raises(SystemExit, match="add cgrpo to --contenders"):
        study_module.learning_rates(study, "sort", [CONTENDERS["cgrpo_once"], CONTENDERS["poise"]])


class _ScriptedRounds:
    """Stands in for GRPOTrainer under DynamicSampling: each call is one round whose groups have the scripted
    advantages (0: a tied group), its rows tagged with the round's number."""

    def _generate_and_score_completions(self, inputs):
        groups = self.rounds.pop(0)
        self.calls += 1
        advantages = torch.tensor([[g, -g] for g in groups], dtype=torch.float).flatten()
        ids = torch.full((advantages.numel(), 2), self.calls)
        return {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "completion_ids": ids,
                "completion_mask": torch.ones_like(ids), "advantages": advantages}  # fmt: skip


class _FakeRounds(DynamicSampling, _ScriptedRounds):
    def __init__(self, rounds: list[list[float]], carry: bool):
        self.rounds, self.dapo_carry, self.num_generations, self.calls = list(rounds), carry, 2, 0
        self.model = argparse.Namespace(training=True)
        self.accelerator = argparse.Namespace(num_processes=1)
        self._metrics = {"train": {"dapo/rounds": [], "dapo/capped": [], "dapo/carried": []}}
        self.processing_class = argparse.Namespace(pad_token_id=0)

    def _fresh_prompts(self, count):
        return [None] * count


def test_dapo_carry_keeps_the_last_rounds_surplus():
    # Step 1 wants 2 groups: round 1 has 1 informative, round 2 has 3 (1 taken, 2 surplus). Step 2: with carry, the
    # 2 carried groups fill it and its own round's 2 informative groups are carried on; without, they are trained.
    for carry, carried_at_step2 in ((False, 0.0), (True, 2.0)):
        sampler = _FakeRounds([[1, 0], [0, 1, 1, 1], [1, 1]], carry)
        first = sampler._generate_and_score_completions([None] * 4)
        assert first["advantages"].numel() == 4 and sampler.calls == 2
        second = sampler._generate_and_score_completions([None] * 4)
        assert sampler.calls == 3  # the sampler's own batch is generated every step
        assert sampler._metrics["train"]["dapo/carried"] == [0.0, carried_at_step2]
        if carry:
            assert second["prompt_ids"][:, 0].tolist() == [2, 2, 2, 2]  # both groups come from step 1's round 2
            assert len(sampler._dapo_carried[0][1]) == 2  # and step 2's own round is carried on
        else:
            assert second["prompt_ids"][:, 0].tolist() == [3, 3, 3, 3]


def test_curve_evaluates_on_a_grid_of_completions_and_stops_at_the_budget():
    curve = HeldOutCurve(lambda model, tokenizer: 0.5, every=10, budget=30)
    state, control = argparse.Namespace(global_step=0, max_steps=99), argparse.Namespace(should_training_stop=False)
    curve.on_train_begin(None, state, control)
    for generated in (4, 8, 12, 26, 34):  # a contender whose steps generate unevenly (DAPO-DS refills)
        state.global_step += 1
        curve.counts["completions_generated"] = generated
        curve.on_step_end(None, state, control)
    assert curve.completions_generated == [0, 12, 26, 34] and control.should_training_stop


def test_auc_and_completions_to_target():
    run = {"eval_completions": [0, 100, 200, 300], "avg_at_k": [0.2, 0.4, 0.4, 1.0]}
    assert math.isclose(normalized_auc(run, 200), (0.3 * 100 + 0.4 * 100) / 200)
    assert math.isclose(completions_to_gain(run, 0.5), 200 + 100 * 0.3 / 0.6)  # 0.7 crossed between 200 and 300
    assert completions_to_gain(run, 0.9) is None


def test_statistics_use_scipy_and_never_reached_counts_against():
    assert _wilcoxon([0.01] * 10) < 0.01 and _wilcoxon([0.0, 0.0]) is None
    assert holm({"a": 0.01, "b": 0.04, "c": None}) == {"a": 0.02, "b": 0.04, "c": None}
    assert holm({"a": 0.03, "b": 0.02}) == {"a": 0.04, "b": 0.04}  # monotone: never below an earlier step
    assert _log_ratio(None, 100.0) > 10 and _log_ratio(100.0, None) < -10 and _log_ratio(None, None) == 0
    assert verdict([None, None, None], 0.5, better_below=True) == "loses"  # median never reached: it loses
    assert verdict([0.01, 0.0, 0.02], 0.01) == "wins" and verdict([-0.01, -0.02, 0.0], 0.01) == "loses"
    assert verdict([0.01, -0.01, 0.02], 0.2) == "undecided"


def _fake_run(name: str, seed: int, curve: list[float], lr: float = 1e-4, role: str = "eval") -> dict:
    return {
        "task": "sort", "contender": name, "seed": seed, "learning_rate": lr, "role": role,
        "eval_completions": [0, 100, 200], "avg_at_k": curve, "completions_generated": 200,
        "completions_trained": 200, "mean_frac_zero_advantage_prompts": 0.1, "train_seconds": 1.0,
        "per_step": {"frac_reward_zero_std": [0.3, 0.3]},
    }  # fmt: skip


def test_summary_pairs_seeds_and_reads_loses_for_a_target_never_reached():
    runs = []
    for seed in range(8):
        start = 0.3 + 0.01 * seed
        runs += [
            _fake_run("grpo8", seed, [start, start + 0.1, start + 0.2]),
            _fake_run("poise", seed, [start, start + 0.15, start + 0.25]),
            _fake_run("rloo2", seed, [start, start, start + 0.01]),  # never reaches 75% of GRPO-8's gain
        ]
    runs.append(_fake_run("poise", 0, [0.0, 0.0, 0.0], lr=5e-5))  # another rate's run is not this contender's
    runs.append(_fake_run("poise", 100, [0.0, 0.0, 0.0], role="tune"))
    runs.append(_fake_run("grpo8", 8, [0.3, 0.9, 0.9]))  # a seed not every contender has finished: left out
    summary = summarize_task("sort", runs, {"poise": {"learning_rate": 1e-4, "source": "tuned"}}, 200)
    poise = summary["contenders"]["poise"]
    assert poise["seeds"] == list(range(8)) and poise["learning_rate"] == 1e-4
    assert set(poise["paired"]) == {"grpo8", "rloo2"} and summary["contenders"]["grpo8"]["paired"] == {}
    paired = poise["paired"]["grpo8"]
    assert paired["wins"] == 8 and paired["seeds"] == 8 and paired["p_wilcoxon"] < 0.01
    assert paired["auc_gain_diff"][0] == pytest.approx(0.0375) and paired["completions_to_target_ratio"][0] < 1
    assert (
        summary["contenders"]["rloo2"]["reached_target"] == 0
        and summary["contenders"]["grpo8"]["seeds"] == poise["seeds"]
    )
    assert poise["paired"]["rloo2"]["completions_to_target_ratio"][0] == 0.0  # the reference never got there
    assert summary["check"]["tied_g8_groups_at_start"] == pytest.approx(0.3)


def test_smallest_p_holm_says_when_no_verdict_can_be_decided():
    assert _wilcoxon([0.01 * (i + 1) for i in range(10)]) == pytest.approx(smallest_p_holm(10, 1))  # 2 / 2^10
    assert smallest_p_holm(10, 40) == pytest.approx(0.078125)  # 10 seeds cannot decide among 40 tests
    assert smallest_p_holm(11, 40) < 0.05 and smallest_p_holm(2, 20) == 1.0


def test_goal_needs_every_auc_win_and_both_completion_bounds():
    def summary(**changes: dict) -> dict:
        paired = {
            ref: {"auc_gain_diff": [0.02, 0.01, 0.03], "p_holm": 0.01, "completions_to_target_ratio": [0.4, 0.3, 0.55]}
            for ref in REFERENCES
        }
        for ref, change in changes.items():
            paired[ref] = {**paired[ref], **change}
        return {"contenders": {"poise": {"paired": paired}}}

    assert goal(summary())["met"]
    assert not goal(summary(grpo8={"p_holm": 0.06}))["met"]  # a win needs p_holm < 0.05
    assert not goal(summary(rloo2={"auc_gain_diff": [-0.02, -0.03, -0.01]}))["met"]
    result = goal(summary(dapo_ds_carry={"completions_to_target_ratio": [0.5, 0.4, 0.65]}))
    assert not result["met"] and result["ratio_upper_below_bound"] == {"dapo_ds_carry": False, "rloo2": True}
    assert not goal(summary(rloo2={"completions_to_target_ratio": [0.5, 0.4, None]}))["met"]  # "never" in the CI
    partial = summary()
    del partial["contenders"]["poise"]["paired"]["grpo8_noscale"]
    assert not goal(partial)["met"]  # a comparator without runs is not beaten


def test_run_files_are_keyed_by_task_contender_rate_and_seed(tmp_path):
    path = run_path(tmp_path, "hops", "poise", 2.5e-5, 3)
    assert path.relative_to(tmp_path).as_posix() == "runs/hops/poise/lr2.5e-05_seed3.json"


def _write_study(out, runs: list[dict]) -> None:
    (out / "study.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps({"settings": {"budget": 200}}))
    for run in runs:
        path = run_path(out, run["task"], run["contender"], run["learning_rate"], run["seed"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))


def test_summarize_a_study_where_no_seed_is_finished_by_every_contender(tmp_path):
    _write_study(tmp_path, [_fake_run("grpo8", 0, [0.3, 0.4, 0.5]), _fake_run("poise", 1, [0.3, 0.4, 0.5])])
    report = write_report(tmp_path)
    assert "No seed has been finished by every contender yet" in report
    assert "grpo8: seeds [0]; poise: seeds [1]" in report


def test_summarize_refuses_runs_of_different_code_unless_told(tmp_path):
    runs = [_fake_run("grpo8", seed, [0.3, 0.4, 0.5]) for seed in range(2)]
    for run, commit in zip(runs, ["abc", "def"], strict=True):
        run["environment"] = {"code": {"version": "0.2.0", "commit": commit}}
    _write_study(tmp_path, runs)
    with pytest.raises(SystemExit, match=r"different code \(1 runs by poise-trl 0.2.0 at abc, 1 runs by .* at def"):
        write_report(tmp_path)
    assert "Runs by code: poise-trl 0.2.0 at abc (1), poise-trl 0.2.0 at def (1)" in write_report(tmp_path, True)
    assert environment()["code"]["version"] == poise_trl.__version__


SMOKE = ("grpo8", "dapo_ds_carry", "poise_paper", "poise", "poise_shrunk")


@pytest.mark.slow
def test_efficiency_study_smoke_resumes_and_reports(tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["bench", "efficiency", "--tune-lr", "--lr-grid", "5e-5", "1e-4", "--max-grid-extensions", "0"]
    argv += ["--tuning-seeds", "100", "--seeds", "0", "1", "--budget", "16", "--eval-every", "8"]
    argv += ["--completions-per-step", "8", "--eval-k", "2", "--num-eval", "8", "--warmup-steps", "5"]
    argv += ["--dapo-max-rounds", "2", "--jobs", "2", "--output-dir", str(out), "--contenders", *SMOKE]
    argv += ["--cache-dir", str(tmp_path / "models")]
    args = parse_bench(argv)
    assert args.func(args) == 0
    assert "sort has 2 evaluation seeds; across 8 headline tests" in capsys.readouterr().out
    files = sorted(out.glob("runs/sort/*/*.json"))
    ran = {name for name in SMOKE if unavailable_reason(CONTENDERS[name]) is None}
    tuned = ran - {"poise_shrunk"}
    assert len(files) == 2 * len(tuned) + 2 * len(ran)  # two rates x one tuning seed, then two evaluation seeds
    runs = [json.loads(f.read_text()) for f in files]
    assert {r["seed"] for r in runs if r["role"] == "tune"} == {100}
    assert {r["seed"] for r in runs if r["role"] == "eval"} == {0, 1}
    for run in runs:
        assert run["eval_completions"][0] == 0 and run["completions_generated"] >= 16
        assert run["learning_rate"] in (5e-5, 1e-4)
    result = json.loads((out / "efficiency.json").read_text())
    sort = result["tasks"]["sort"]
    tuning = json.loads((out / "tuning_sort.json").read_text())
    assert tuning["poise_shrunk"]["learning_rate"] == tuning["poise_paper"]["learning_rate"]
    assert [row["learning_rate"] for row in tuning["poise"]["table"]] == [5e-5, 1e-4]
    for name, entry in sort["contenders"].items():
        assert set(entry) >= {"learning_rate", "auc", "auc_ci", "completions_generated", "completions_trained",
                              "final_avg_at_k", "paired"}  # fmt: skip
        assert entry["learning_rate"] == tuning[name]["learning_rate"]
        for paired in entry["paired"].values():
            assert set(paired) >= {"wins", "seeds", "auc_gain_diff", "completions_to_target_ratio", "p_wilcoxon",
                                   "p_holm"}  # fmt: skip
    assert set(sort["contenders"]["poise"]["paired"]) == {"grpo8", "dapo_ds_carry"}
    assert sort["goal"]["met"] is False  # three comparators never ran
    assert (
        "- **Goal**" in (out / "report.md").read_text()
        and "**Undecidable as run:**" in (out / "report.md").read_text()
    )
    assert (out / "efficiency_sort.png").stat().st_size > 0 and "## sort" in (out / "report.md").read_text()
    (out / "report.md").unlink()
    summarize = parse_bench(["bench", "summarize", str(out)])
    assert summarize.func(summarize) == 0 and "## sort" in (out / "report.md").read_text()
    # A re-run finds every run on disk and trains nothing; other settings are refused.
    stamps = {f: f.stat().st_mtime_ns for f in files}
    assert args.func(parse_bench(argv)) == 0
    assert {f: f.stat().st_mtime_ns for f in files} == stamps
    with pytest.raises(SystemExit, match="other settings"):
        args = parse_bench([*argv, "--eval-k", "4"])
        args.func(args)


def test_per_prefix_contender_trains_and_is_paired_with_poise_default(tmp_path):
    """POISE per-prefix is a headline row paired with the references and with POISE (default): the difference is
    the per-prefix baseline's effect. A two-step run exercises its capture, buffer and fit (the prefix probe is not
    trusted before `probe_warmup_steps`, so this checks that it trains, not what it gains)."""
    assert paired_references("poise_prefix") == (*REFERENCES, "poise")
    out = tmp_path / "study"
    argv = ["bench", "efficiency", "--seeds", "0", "--budget", "16", "--eval-every", "8"]
    argv += ["--completions-per-step", "8", "--eval-k", "2", "--num-eval", "8", "--warmup-steps", "5", "--jobs", "1"]
    argv += ["--output-dir", str(out)]
    argv += ["--contenders", "poise", "poise_prefix", "--cache-dir", str(tmp_path / "models")]
    args = parse_bench(argv)
    assert args.func(args) == 0
    (run,) = out.glob("runs/sort/poise_prefix/*.json")
    assert json.loads(run.read_text())["completions_generated"] >= 16
    entry = json.loads((out / "efficiency.json").read_text())["tasks"]["sort"]["contenders"]["poise_prefix"]
    assert entry["label"] == "POISE per-prefix G=2" and set(entry["paired"]) == {"poise"}


def test_history_contender_trains_where_prompts_repeat(tmp_path):
    """POISE +history is POISE (default) with `probe_history`, paired with it; `--train-limit` makes a demo task's
    prompts repeat (RL on its first N prompts), so the history has something to read."""
    assert paired_references("poise_history") == (*REFERENCES, "poise")
    assert CONTENDERS["poise_history"].rate_of == "poise"
    out = tmp_path / "study"
    argv = ["bench", "efficiency", "--seeds", "0", "--budget", "24", "--eval-every", "8", "--train-limit", "4"]
    argv += ["--completions-per-step", "8", "--eval-k", "2", "--num-eval", "8", "--warmup-steps", "5", "--jobs", "1"]
    argv += ["--output-dir", str(out), "--contenders", "poise", "poise_history", "--cache-dir", str(tmp_path / "m")]
    args = parse_bench(argv)
    settings = EfficiencySettings.from_args(args)
    assert len(task_factory(settings, "sort")(0).train) == 4
    assert _config(
        CONTENDERS["poise_history"], argparse.Namespace(max_completion_length=4), settings, 0, tmp_path, 1e-5
    ).probe_history
    assert args.func(args) == 0
    (run,) = out.glob("runs/sort/poise_history/*.json")
    assert json.loads(run.read_text())["completions_generated"] >= 24
    with pytest.raises(SystemExit, match="--train-limit 0"):
        validate(EfficiencySettings.from_args(parse_bench(["bench", "efficiency", "--train-limit", "0"])), [])


@pytest.mark.parametrize("token_level", [False, True])
def test_trained_accounting_counts_rollouts_and_silent_prompts_with_token_advantages(token_level):
    """With probe_granularity="prefix" the advantages are (B, T): a completion is one row, not T, and a prompt
    teaches nothing only when every token of every completion has advantage 0. A row whose completion mask is all 0
    (C-GRPO's padding) is not trained on."""
    from collections import defaultdict
    from types import SimpleNamespace

    from accelerate import Accelerator

    class Scored:
        def _generate_and_score_completions(self, inputs):
            mask = torch.ones(inputs.size(0), 3, dtype=torch.int)
            mask[-1] = 0  # a row C-GRPO padded its stopped prompt with: masked out, never trained on
            return {"advantages": inputs, "completion_mask": mask}

    class Trainer(_TrainedAccounting, Scored):
        accelerator = Accelerator(cpu=True)
        model = SimpleNamespace(training=True)
        num_generations = 2

        def __init__(self):
            self._metrics = {"train": defaultdict(list)}
            self.bench_counts = {"completions_trained": 0}

    advantages = torch.tensor([0.0, 0.0, 0.5, -0.5, 0.0, 0.3])  # prompts: silent, teaching, teaching
    if token_level:  # 5 tokens each; the third row's signal is on its last token only
        advantages = advantages.unsqueeze(1).repeat(1, 5)
        advantages[4, -1] = 0.2
    trainer = Trainer()
    trainer._generate_and_score_completions(advantages)
    assert trainer.bench_counts["completions_trained"] == 5
    assert trainer._metrics["train"]["frac_zero_advantage_prompts"] == [pytest.approx(1 / 3)]


def test_tuning_one_contender_keeps_the_other_contenders_tuned_rates(tmp_path, monkeypatch):
    """A study run on a subset of contenders (adding one to a finished study) merges into `tuning_TASK.json`."""
    settings = EfficiencySettings.from_args(
        parse_bench(["bench", "efficiency", "--tune-lr", "--output-dir", str(tmp_path)])
    )
    earlier = {"task": "sort", "tuning_seeds": [1000], "grpo8": {"learning_rate": 5e-5, "source": "tuned"}}
    (tmp_path / "tuning_sort.json").write_text(json.dumps(earlier))
    monkeypatch.setattr(study_module, "tune", lambda study, task, names: {n: {"learning_rate": 2.5e-5} for n in names})
    study_module.learning_rates(study_module.Study(settings, None), "sort", [CONTENDERS["poise_importance"]])
    written = json.loads((tmp_path / "tuning_sort.json").read_text())
    assert written["grpo8"] == earlier["grpo8"]
    assert written["poise_importance"] == {"learning_rate": 2.5e-5, "source": "tuned"}


def test_peer_contenders_charge_every_completion(tmp_path):
    """A*-PO's Stage-1 value samples are charged before its first step (the curve holds the starting score until
    they are spent) and C-GRPO's calibration rollouts with its budget increments; neither counts what it does not
    generate (C-GRPO's padding rows)."""
    from poise_lab.bench.trainers import TRAINERS

    if "cgrpo" not in TRAINERS:
        pytest.fail("trl-cgrpo is not installed: `make install` installs it (pip install --no-deps trl-cgrpo==0.2.0)")
    out = tmp_path / "study"
    argv = ["bench", "efficiency", "--seeds", "0", "--budget", "48", "--eval-every", "16", "--completions-per-step"]
    argv += ["8", "--eval-k", "2", "--num-eval", "8", "--warmup-steps", "60", "--jobs", "1", "--output-dir", str(out)]
    argv += ["--contenders", "a2po", "cgrpo", "--cache-dir", str(tmp_path / "models")]
    args = parse_bench(argv)
    assert args.func(args) == 0
    (a2po,) = (json.loads(f.read_text()) for f in out.glob("runs/sort/a2po/*.json"))
    offline = a2po["eval_completions"][1]  # the first evaluation after Stage 1: its value samples
    assert offline == 3 * 8  # budget 48 x A2PO_OFFLINE_SHARE / num_value_samples = 3 prompts, 8 samples each
    assert a2po["eval_completions"][0] == 0 and a2po["avg_at_k"][0] == a2po["avg_at_k"][1]
    assert a2po["completions_generated"] == offline + a2po["completions_trained"] >= 48
    assert a2po["forward_rows"] == 2 * a2po["completions_trained"]  # the reference and the policy pass
    (cgrpo,) = (json.loads(f.read_text()) for f in out.glob("runs/sort/cgrpo/*.json"))
    calibration = sum(v or 0 for v in cgrpo["per_step"]["cgrpo/calibration_rollouts"])
    assert calibration == 32 * 8  # one calibration: 32 held-out prompts x max(budget_grid)
    real = sum(k for k in cgrpo["per_step"]["cgrpo/mean_k"])  # one prompt a step: its completions generated
    assert cgrpo["completions_generated"] == calibration + real and cgrpo["completions_trained"] == real


def test_a_peer_that_is_not_installed_is_reported_with_its_install_command(monkeypatch):
    from poise_lab.bench import trainers

    monkeypatch.delitem(trainers.TRAINERS, "cgrpo", raising=False)
    assert "pip install --no-deps trl-cgrpo==0.2.0" in unavailable_reason(CONTENDERS["cgrpo"])
    assert unavailable_reason(CONTENDERS["a2po"]) is None

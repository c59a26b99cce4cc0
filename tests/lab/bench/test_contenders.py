"""Conformance of every contender of `bench efficiency` (`poise_lab.bench.contenders`), one check per entry, as
tests/test_registries.py checks the library's tables: each entry builds its trainer with the config the study gives
it, its traits agree with each other and with that config, both commands and the report offer it, and every name
that points at a contender (a pairing, a rate, a goal, a comparator, the docs' prose names) points at one. A new peer
is one entry in the table and needs no edit here."""

import argparse
import re
import statistics
from pathlib import Path

import pytest
from datasets import Dataset

from poise_lab.bench import gradient, gradient_samplers, prefix_gradient, probes, report
from poise_lab.bench.contenders import (
    CONTENDERS,
    GRADIENT_CONTENDERS,
    GRADIENT_PREFIX_ROWS,
    GRADIENT_RULES,
    HEADLINE_CONTENDERS,
    REFERENCES,
    contenders_help,
    paired_references,
)
from poise_lab.bench.efficiency import _config
from poise_lab.bench.settings import EfficiencySettings
from poise_lab.bench.trainers import TRAINERS, trainer_inputs, unavailable_reason

from ...docs import figures
from .conftest import parse_bench

NAMES = list(CONTENDERS)
BENCHMARKS = Path(__file__).parents[3] / "benchmarks"


def _settings() -> EfficiencySettings:
    """The study's settings at a tiny budget: 8 completions a step, each contender's group dividing it."""
    argv = ["bench", "efficiency", "--completions-per-step", "8", "--budget", "16", "--eval-every", "8"]
    return EfficiencySettings.from_args(parse_bench(argv))


@pytest.mark.parametrize("name", NAMES)
def test_each_contenders_traits_agree(name):
    c = CONTENDERS[name]
    assert c.name == name and c.label.strip() and c.summary.strip() and c.trainer
    assert 8 % c.group_size == 0 and 32 % c.group_size == 0  # a step of B completions holds whole groups
    assert not (c.reference and c.headline), "a reference is what headline rows are paired with, not one of them"
    assert not c.paired_with or c.headline, "a contender paired with another is a headline row"
    assert all(other in CONTENDERS and other != name for other in c.paired_with), c.paired_with
    assert not set(c.paired_with) & set(REFERENCES), "every headline row is paired with the references already"
    assert all(CONTENDERS[other].headline or CONTENDERS[other].reference for other in c.paired_with)
    if c.rate_of is not None:  # a one-change ablation: its parent is tuned and trains with the same trainer
        parent = CONTENDERS.get(c.rate_of)
        assert parent is not None and parent.rate_of is None and parent.trainer == c.trainer, c.rate_of
    assert c.gradient in (None, *GRADIENT_RULES)
    if c.gradient in ("probe", "prefix"):
        assert c.trainer == "poise" and c.group_size == 2
    if c.gradient == "leave_one_out":
        assert c.group_size == 2
    assert c.g8_reference == (c.reference and c.group_size == 8)


def test_labels_are_unique_and_the_tables_order_is_the_reports():
    labels = [c.label for c in CONTENDERS.values()]
    assert len(set(labels)) == len(labels)
    assert list(REFERENCES) == [n for n in NAMES if CONTENDERS[n].reference] and REFERENCES
    assert report.GOAL_CONTENDER in HEADLINE_CONTENDERS and report.TARGET_REFERENCE in REFERENCES
    assert set(report.GOAL_RATIO_BOUNDS) <= set(REFERENCES)


@pytest.mark.parametrize("name", NAMES)
def test_each_contender_builds_its_trainer_with_the_studys_config(name, tiny_model_path, tmp_path):
    """The config `_config` gives it: its group, its overrides (a paper row's preset filling the rest), the study's
    reward scaling for the GRPO family and POISE's own for POISE; then its trainer is built on the tiny model with the
    data `trainer_inputs` gives it. A contender this environment cannot run says why."""
    c = CONTENDERS[name]
    if (reason := unavailable_reason(c)) is not None:
        assert c.trainer not in TRAINERS and "pip install" in reason
        pytest.skip(reason)
    settings = _settings()
    config = _config(c, argparse.Namespace(max_completion_length=4), settings, 0, tmp_path, 1e-5)
    assert config.learning_rate == 1e-5 and config.max_steps > 0
    if hasattr(config, "num_generations"):
        assert config.num_generations == c.group_size
    assert all(getattr(config, key) == value for key, value in c.overrides.items())
    if c.overrides.get("probe_preset") == "paper":  # the paper's algorithm, but for the one change an ablation makes
        changed = set(c.overrides) - {"probe_preset"}
        assert set(config.preset_changes()) == changed, config.preset_changes()
    if hasattr(config, "scale_rewards"):
        expected = "none" if c.trainer == "poise" else settings.grpo_scale_rewards
        assert config.scale_rewards == c.overrides.get("scale_rewards", expected)
    train = Dataset.from_list([{"prompt": f"{i % 10}{(3 * i) % 10}", "answer": str(i % 10)} for i in range(48)])
    inputs = trainer_inputs(c.trainer, config, settings.budget, train, lambda text: text.strip()[:1] or None)
    trainer = TRAINERS[c.trainer][0](
        model=str(tiny_model_path),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=config,
        **inputs,
    )
    assert set(trainer.bench_counts) >= {"completions_generated", "forward_rows"}  # its spend is counted


@pytest.mark.parametrize("name", NAMES)
def test_the_command_lines_offer_each_contender(name):
    assert parse_bench(["bench", "efficiency", "--contenders", name]).contenders == [name]
    assert name in parse_bench(["bench", "efficiency"]).contenders  # run by default
    c = CONTENDERS[name]
    listed = re.search(
        rf"(?m)^  {name} +{re.escape(c.label)}, {re.escape(c.prompts_per_step)}(.*)$", contenders_help()
    )
    assert listed, f"{name} is not listed in `bench efficiency --help`"
    assert ("a reference" in listed.group(1)) == c.reference
    assert all(other in listed.group(1) for other in c.paired_with)
    if c.gradient is not None:  # bench gradient: by default, or when named for a second pass
        assert name in parse_bench(["bench", "gradient", "--contenders", name]).contenders
        assert (name in parse_bench(["bench", "gradient"]).contenders) == (c.gradient != "prefix")
    else:
        assert name not in GRADIENT_CONTENDERS and name not in GRADIENT_PREFIX_ROWS


def _run(name: str, seed: int, gain: float, tied: float) -> dict:
    start = 0.3 + 0.01 * seed
    return {
        "task": "sort", "contender": name, "seed": seed, "learning_rate": 1e-4, "role": "eval",
        "eval_completions": [0, 100, 200], "avg_at_k": [start, start + gain / 2, start + gain],
        "completions_generated": 200, "completions_trained": 200, "mean_frac_zero_advantage_prompts": 0.1,
        "train_seconds": 1.0, "per_step": {"frac_reward_zero_std": [tied] * 5},
    }  # fmt: skip


def test_the_report_offers_every_contender_with_its_pairings(monkeypatch):
    """Runs of every contender: each is a row with its label, each headline row is paired with the references and its
    own pairings (each headline line printed), and only the G=8 references' runs make the task check."""
    monkeypatch.setattr(report, "BOOTSTRAP_RESAMPLES", 99)  # the intervals are not what is checked here
    g8 = [name for name in NAMES if CONTENDERS[name].g8_reference]
    tied = {name: 0.5 ** (g8.index(name) + 1) if name in g8 else 0.9 for name in NAMES}  # any one left out or added
    runs = [
        _run(name, seed, 0.1 + 0.01 * i + 0.001 * seed, tied[name])
        for i, name in enumerate(NAMES)
        for seed in range(4)
    ]
    summary = report.summarize_task("sort", runs, {}, 200)
    assert list(summary["contenders"]) == NAMES
    for name, entry in summary["contenders"].items():
        c = CONTENDERS[name]
        assert entry["label"] == c.label and entry["seeds"] == [0, 1, 2, 3]
        assert list(entry["paired"]) == (list(paired_references(name)) if c.headline else []), name
    expected = statistics.median(tied[name] for name in g8 for _ in range(4))
    assert summary["check"]["tied_g8_groups_at_start"] == pytest.approx(expected)
    summary["goal"] = report.goal(summary)
    table, headline = report.format_task(summary), report.format_headline(summary)
    assert all(f"| {c.label} |" in table for c in CONTENDERS.values())
    lines = headline.splitlines()
    assert len(lines) == len(HEADLINE_CONTENDERS) + 1 and lines[-1].startswith("- **Goal**")
    assert lines[0].startswith(f"- **{CONTENDERS[report.GOAL_CONTENDER].label}**")  # the goal's row leads
    assert {line.split("**")[1] for line in lines[:-1]} == {CONTENDERS[n].label for n in HEADLINE_CONTENDERS}


def test_every_name_that_points_at_a_contender_points_at_one():
    """The selections the benches make by name, the committed studies' run folders, and the docs' prose names: the
    figures checker knows by its prose name every comparator a page may name (the references and the peers)."""
    selections = {
        "bench gradient's share comparators": gradient.COMPARATORS,
        "its per-prefix comparators": prefix_gradient.PREFIX_COMPARATORS,
        "its sampled rows": tuple(gradient_samplers.SAMPLED),
        "bench scalars' default probes": probes.DEFAULT_PROBES,
    }
    for what, names in selections.items():
        assert set(names) <= set(CONTENDERS), f"{what}: {sorted(set(names) - set(CONTENDERS))}"
    assert all(
        CONTENDERS[n].gradient not in (None, "prefix") for n in (*gradient.COMPARATORS, *gradient_samplers.SAMPLED)
    )
    assert set(prefix_gradient.PREFIX_MIX) == set(GRADIENT_PREFIX_ROWS)
    studied = {path.name for path in BENCHMARKS.glob("efficiency-*/runs/*/*") if path.is_dir()}
    assert studied and studied <= set(CONTENDERS), sorted(studied - set(CONTENDERS))
    compared = set(REFERENCES) | {n for n in HEADLINE_CONTENDERS if CONTENDERS[n].trainer != "poise"}
    named = set(figures.CONTENDERS)
    assert named == compared, (
        "tests/docs/figures.py's CONTENDERS must name by their prose name exactly the references and the peers: "
        f"missing {sorted(compared - named)}, not contenders {sorted(named - compared)}"
    )

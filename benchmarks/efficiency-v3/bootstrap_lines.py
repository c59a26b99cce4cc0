"""The shrunk bootstrap's line in `bench efficiency` v3, replayed: how often the line the study ran with (before issue
58: an unclamped least-squares fit r_i ~ a + w m_i, free intercept) left the reward range, and how often it differs
from today's (a convex mix (1 - w) r̄ + w m_i with the least-squares w held in [0, 1]).

The study's 620 runs took hours, so they are not rerun. Instead the first 16 steps (`probe_warmup_steps`: every
baseline is the bootstrap's) of each evaluation run of the two contenders that use the shrunk line, POISE (default)
and POISE +shrunk, on both tasks, are rerun as the study ran them (its settings, seed and learning rate, G = 2, 32
completions a step), with the old line serving the baselines as it served the study's. At every step the line fitted
on the earlier steps' pairs is recorded in both forms, with the range of the baselines the old line gave.
`steps_as_study` counts the leading steps whose mean reward is the committed run's: past it, today's code has
taken another trajectory than the study's (its commit was 6f24dd8), in the same settings.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/efficiency-v3/bootstrap_lines.py

writes `benchmarks/efficiency-v3/bootstrap-lines.json` (`--output`). `--seeds N` replays only each contender's first
N evaluation seeds of the study's 20 (each seed warm-starts its own model).
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from poise_lab.bench import efficiency
from poise_lab.bench.cli import add_bench_parser
from poise_lab.bench.common import CONTENDERS
from poise_lab.bench.settings import EfficiencySettings
from poise_trl.estimator import estimator as estimator_module
from poise_trl.estimator.baselines import BOOTSTRAPS, shrunk_rloo_line

STUDY = Path(__file__).parent
CONTENDER_NAMES = ("poise", "poise_shrunk")
STEPS = 16  # POISEConfig's probe_warmup_steps: the bootstrap period


def study_line(partner_means: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The line the study ran with: the unclamped least-squares fit of r_i on m_i (a=0, w=1 with no pairs; w=0 and
    a the mean reward when every m_i is the same)."""
    keep = torch.isfinite(partner_means) & torch.isfinite(rewards)
    n = keep.sum().double()
    m_mean = torch.where(keep, partner_means.double(), 0.0).sum() / n.clamp(min=1)
    r_mean = torch.where(keep, rewards.double(), 0.0).sum() / n.clamp(min=1)
    dm = torch.where(keep, partner_means.double() - m_mean, 0.0)
    dr = torch.where(keep, rewards.double() - r_mean, 0.0)
    variance = dm.pow(2).sum() / n.clamp(min=1)
    weight = torch.where(variance > 1e-12, (dm * dr).sum() / n.clamp(min=1) / variance.clamp(min=1e-300), 0.0)
    line = torch.stack([r_mean - weight * m_mean, weight])
    return torch.where(n > 0, line, torch.tensor([0.0, 1.0], dtype=torch.float64, device=line.device))


class Recorder:
    """Serves the study's line to the estimator and records, per step, both lines and the baselines' range."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = [{"old": [0.0, 1.0], "new": [0.0, 1.0]}]  # step 0: no pairs, RLOO
        self.advantages = estimator_module.poise_advantages

    def fit(self, partner_means: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        old = study_line(partner_means, rewards)
        self.steps.append({"old": old.tolist(), "new": shrunk_rloo_line(partner_means, rewards).tolist()})
        return old

    def poise_advantages(self, rewards, values, num_generations, usable, has_completion, trusted, fallback=None):
        advantages, baselines, receives = self.advantages(
            rewards, values, num_generations, usable, has_completion, trusted, fallback
        )
        got = baselines[receives]
        if got.numel():
            step = self.steps[-1]
            step["low"] = min(step.get("low", math.inf), got.min().item())
            step["high"] = max(step.get("high", -math.inf), got.max().item())
        return advantages, baselines, receives


def replay(settings: EfficiencySettings, task: str, contender: str, run: dict) -> dict:
    recorder = Recorder()
    BOOTSTRAPS["shrunk"] = recorder.fit
    estimator_module.poise_advantages = recorder.poise_advantages
    try:
        seed_task = efficiency.task_factory(settings, task)(run["seed"])
        result = efficiency.run_one(CONTENDERS[contender], run["seed"], seed_task, settings, run["learning_rate"])
    finally:
        BOOTSTRAPS["shrunk"] = shrunk_rloo_line
        estimator_module.poise_advantages = recorder.advantages
    steps = recorder.steps[:STEPS]  # the line after step t serves step t + 1; the last fit serves no step here
    rewards, study = result["per_step"]["reward"][:STEPS], run["per_step"]["reward"][:STEPS]
    return {
        "seed": run["seed"],
        "learning_rate": run["learning_rate"],
        "steps_as_study": next((t for t, (a, b) in enumerate(zip(rewards, study, strict=True)) if a != b), STEPS),
        "reward": rewards,
        "bootstrap": result["per_step"]["poise/bootstrap"][:STEPS],
        "steps": steps,
    }


def _differ(step: dict) -> bool:
    return max(abs(old - new) for old, new in zip(step["old"], step["new"], strict=True)) > 1e-12


def summary(replays: list[dict]) -> dict:
    """Counts as {count, of}: steps whose old line gave a baseline outside [0, 1], steps and runs where the two
    lines differ, steps whose old weight fell below 0 or rose above 1; the ranges of the old baselines and weights."""
    steps = [step for run in replays for step in run["steps"]]
    left = [s for s in steps if s.get("low", 0) < 0 or s.get("high", 1) > 1]
    return {
        "steps_as_study_median": statistics.median(run["steps_as_study"] for run in replays),
        "steps_where_old_line_left_0_1": {"count": len(left), "of": len(steps)},
        "steps_where_lines_differ": {"count": sum(map(_differ, steps)), "of": len(steps)},
        "runs_where_lines_differ": {
            "count": sum(any(map(_differ, run["steps"])) for run in replays),
            "of": len(replays),
        },
        "steps_where_old_weight_below_0": {"count": sum(s["old"][1] < 0 for s in steps), "of": len(steps)},
        "steps_where_old_weight_above_1": {"count": sum(s["old"][1] > 1 for s in steps), "of": len(steps)},
        "old_baseline_range": [min(s.get("low", 0) for s in steps), max(s.get("high", 1) for s in steps)],
        "old_weight_range": [min(s["old"][1] for s in steps), max(s["old"][1] for s in steps)],
        "new_weight_range": [min(s["new"][1] for s in steps), max(s["new"][1] for s in steps)],
    }


def main() -> None:
    own = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--seeds", type=int, default=20, help="the first N evaluation seeds of each contender and task")
    own.add_argument("--output", type=Path, default=STUDY / "bootstrap-lines.json")
    options = own.parse_args()
    seeds = options.seeds
    identity = json.loads((STUDY / "study.json").read_text())["settings"]
    parser = argparse.ArgumentParser(prog="poise-trl")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    settings = EfficiencySettings.from_args(parser.parse_args(["bench", "efficiency"]))
    run_settings = {**identity, "warmup_steps": None, "budget": STEPS * identity["completions_per_step"]}
    settings = dataclasses.replace(settings, **run_settings)
    out: dict = {"steps": STEPS, "seeds": seeds, "contenders": list(CONTENDER_NAMES), "tasks": {}}
    for task in ("sort", "hops"):
        for contender in CONTENDER_NAMES:
            runs = [json.loads(p.read_text()) for p in sorted((STUDY / "runs" / task / contender).glob("*.json"))]
            runs = sorted((r for r in runs if r["role"] == "eval"), key=lambda r: r["seed"])[:seeds]
            replays = []
            for run in runs:
                replays.append(replay(settings, task, contender, run))
                print(task, contender, run["seed"], summary(replays[-1:]), file=sys.stderr, flush=True)
            out["tasks"].setdefault(task, {})[contender] = {"summary": summary(replays), "runs": replays}
    out["summary"] = summary([r for t in out["tasks"].values() for c in t.values() for r in c["runs"]])
    options.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The contenders of `poise-trl bench efficiency` as data: one entry per contender with its traits, the one place
that holds them. The study, the report, the trainers' configs, `bench gradient` and both commands' `--help` read this
table; where a bench picks a few contenders by name (the report's goal, `bench gradient`'s comparators), the name is
checked to be an entry. `tests/lab/bench/test_contenders.py` checks every entry, so a new peer is one entry here
(plus how the docs name it in prose, `tests/docs/figures.py`'s `CONTENDERS`, which that test asks for).

It imports no torch, so the commands' `--help` can list the contenders.
"""

import textwrap
from dataclasses import dataclass, field
from typing import Any

# How `bench gradient` measures a contender's policy-gradient estimate exactly over a pool (`gradient.rule_moments`):
# each rollout against the mean of the other rollouts of its group of `group_size` (std-scaled unless the contender
# sets scale_rewards="none"), the same over informative groups only (dynamic sampling), against its partner's reward
# (leave-one-out at G = 2), against the probe's value of its partner, or per token against a per-prefix probe (a
# second gradient pass, so only when named).
GRADIENT_RULES = ("group", "informative_groups", "leave_one_out", "probe", "prefix")


@dataclass(frozen=True)
class Contender:
    """One contender and its traits.

    `trainer` is a key of `bench.trainers.TRAINERS`; `group_size` the completions per prompt a step (C-GRPO: the
    most, max(budget_grid); A*-PO: 1); `summary` what it runs, for `--help`. `overrides` must all exist as config
    fields (a missing one makes the contender unavailable, reported, not run). "POISE (paper)" is
    `probe_preset="paper"`, which sets every field of the paper's algorithm (poise_trl.choices.PROBE_PRESETS); its
    one-change ablations change one of them.

    The study's roles: a `reference` is a comparator every headline row is paired with; a `headline` row is paired
    with each reference and with each of `paired_with` (a row that changes POISE (default), or a peer in its place, is
    paired with it: the difference is that change's effect, or which of the two a user should pick), and those tests
    form Holm's family; a one-change ablation skips learning-rate tuning and runs at the tuned rate of `rate_of`.
    `gradient` says how `bench gradient` measures it (one of GRADIENT_RULES; None: not a row there).
    """

    name: str
    label: str
    trainer: str
    group_size: int
    summary: str
    overrides: dict[str, Any] = field(default_factory=dict)
    reference: bool = False
    headline: bool = False
    paired_with: tuple[str, ...] = ()
    rate_of: str | None = None
    gradient: str | None = None

    @property
    def g8_reference(self) -> bool:
        """A reference trained on groups of 8: its share of tied groups at the start is the task check's (a task must
        leave many G=8 groups tied, or neither dynamic sampling nor POISE's answer to them is tested)."""
        return self.reference and self.group_size == 8

    @property
    def prompts_per_step(self) -> str:
        """Prompts a step of B completions covers, for `--help`."""
        return "B prompts" if self.group_size == 1 else f"B/{self.group_size} prompts"


def _paper_ablation(name: str, label: str, change: dict[str, Any], summary: str) -> Contender:
    """POISE (paper) with one change: the difference against POISE (paper) is that change's effect."""
    return Contender(name, label, "poise", 2, summary, {"probe_preset": "paper", **change}, rate_of="poise_paper")


CGRPO_AT_SCALE = {"budget_grid": [2, 4, 8], "num_calibration_samples": 32}

CONTENDERS = {
    c.name: c
    for c in (
        # The references, each paired with every headline row: GRPO-8 (the paper's baseline) and GRPO-8 without
        # reward scaling (POISE does not scale either), DAPO-DS (behind the paper's wall-clock claim) and
        # DAPO-DS-carry (the strongest dynamic sampling), and RLOO-2 (the same prompts per step as POISE, with the
        # plain leave-one-out baseline).
        Contender("grpo8", "GRPO G=8", "grpo", 8, "trl.GRPOTrainer", reference=True, gradient="group"),
        Contender(
            "grpo8_noscale",
            "GRPO G=8 no-scale",
            "grpo",
            8,
            'the same with scale_rewards="none" (POISE does not scale either)',
            {"scale_rewards": "none"},
            reference=True,
            gradient="group",
        ),
        Contender(
            "dapo_ds",
            "DAPO-DS G=8",
            "dapo_ds",
            8,
            "GRPOTrainer + dynamic sampling (DAPO §3.2, in the benchmark): groups whose rewards all tie are dropped "
            "and fresh prompts generated until B/8 groups are informative (at most --dapo-max-rounds generation "
            "batches per step); it generates more than B",
            reference=True,
        ),
        Contender(
            "dapo_ds_carry",
            "DAPO-DS-carry G=8",
            "dapo_ds_carry",
            8,
            "the same, but the last round's surplus informative groups are trained on at the next step: only tied "
            "groups are discarded",
            reference=True,
            gradient="informative_groups",
        ),
        Contender("rloo2", "RLOO k=2", "rloo", 2, "trl.RLOOTrainer", reference=True, gradient="leave_one_out"),
        Contender("grpo2", "GRPO G=2", "grpo", 2, "trl.GRPOTrainer"),
        Contender(
            "poise_paper",
            "POISE (paper) G=2",
            "poise",
            2,
            "POISETrainer, the paper's algorithm (probe_preset='paper': its probe, RLOO bootstrap, no partner-aware "
            "probe)",
            {"probe_preset": "paper"},
            headline=True,
            gradient="probe",
        ),
        Contender(
            "poise",
            "POISE (default) G=2",
            "poise",
            2,
            "POISETrainer with the library's defaults",
            headline=True,
            gradient="probe",
        ),
        _paper_ablation(
            "poise_partner",
            "POISE +partner G=2",
            {"probe_partner_reward": True},
            "POISE (paper) with the partner-aware probe",
        ),
        _paper_ablation(
            "poise_shrunk",
            "POISE +shrunk G=2",
            {"probe_bootstrap": "shrunk"},
            "POISE (paper) with the shrunk bootstrap",
        ),
        _paper_ablation(
            "poise_select",
            "POISE +selection G=2",
            {"prompt_selection": "value"},
            "POISE (paper) with value-guided prompt selection",
        ),
        Contender(
            "poise_importance",
            "POISE +importance G=2",
            "poise",
            2,
            'POISE (default) with prompt_selection="importance" at floor 0.5',
            {"prompt_selection": "importance", "prompt_selection_floor": 0.5},
            headline=True,
            paired_with=("poise",),
        ),
        Contender(
            "poise_prefix",
            "POISE per-prefix G=2",
            "poise",
            2,
            'POISE (default) with probe_granularity="prefix": A_t = r - V(x, y_<t) per token',
            {"probe_granularity": "prefix"},
            headline=True,
            paired_with=("poise",),
            gradient="prefix",
        ),
        # Each prompt's own history as probe input: it only knows prompts drawn before, so it is measured where
        # prompts repeat (`--train-limit`).
        Contender(
            "poise_history",
            "POISE +history G=2",
            "poise",
            2,
            "POISE (default) with each prompt's own history as probe input (probe_history=True); measured where "
            "prompts repeat (--train-limit)",
            {"probe_history": True},
            headline=True,
            paired_with=("poise",),
            rate_of="poise",
        ),
        # The peers a TRL user would pick instead, each its own trainer unmodified (bench.trainers), at its defaults
        # but where the study's scale needs otherwise: A*-PO's 8 value samples per prompt, beta1 = 0.5, beta2 = 1e-3;
        # C-GRPO's APS score, automatic delta and recalibration every 50 steps, with the grid capped at GRPO's G = 8
        # (its default [2, 4, 8, 16, 32] would make a step of 32 completions one prompt) and 32 held-out calibration
        # prompts (256 completions a calibration).
        Contender(
            "a2po",
            "A*-PO",
            "a2po",
            1,
            "trl.experimental.a2po.A2POTrainer, unmodified: V*(x) from 8 reference samples per training prompt before "
            "the first step (charged: budget / 16 prompts, half the budget offline), then one completion per prompt",
            headline=True,
            paired_with=("poise",),
        ),
        Contender(
            "cgrpo",
            "C-GRPO G=2-8",
            "cgrpo",
            8,
            "trl_cgrpo.CGRPOTrainer (PyPI trl-cgrpo 0.2.0, installed --no-deps), unmodified: each prompt sampled 2, "
            "4, 8 until its conformal answer set is one answer; calibration on 32 held-out training prompts every 50 "
            "steps (charged)",
            CGRPO_AT_SCALE,
            headline=True,
            paired_with=("poise",),
        ),
        # Calibrated once, before the first step: its one change, the calibration's share of the budget (a quarter to
        # a third of 3,200 completions when recalibrated every 50 steps).
        Contender(
            "cgrpo_once",
            "C-GRPO G=2-8 calibrated once",
            "cgrpo",
            8,
            "C-GRPO G=2-8 calibrated once, before the first step",
            {**CGRPO_AT_SCALE, "recalibrate_every": 0},
            headline=True,
            paired_with=("poise",),
            rate_of="cgrpo",
        ),
    )
}

REFERENCES = tuple(name for name, c in CONTENDERS.items() if c.reference)
HEADLINE_CONTENDERS = tuple(name for name, c in CONTENDERS.items() if c.headline)
# `bench gradient`'s rows: by default every contender it measures in one gradient pass; the per-prefix rows (a second
# pass) when named, with POISE per-prefix's mix with the partner's value, a row of `bench gradient` only.
GRADIENT_CONTENDERS = tuple(name for name, c in CONTENDERS.items() if c.gradient not in (None, "prefix"))
GRADIENT_PREFIX_ROWS = {
    **{name: c.label for name, c in CONTENDERS.items() if c.gradient == "prefix"},
    "poise_prefix_mix": "POISE per-prefix ½ + partner ½ G=2",
}
PREFIX_SAMPLED_ROW = ("poise_prefix_probe_sampler", "POISE per-prefix + probe sampler G=2")  # with poise_prefix


def paired_references(name: str) -> tuple[str, ...]:
    """The contenders a headline row's paired statistics are taken against."""
    return REFERENCES + CONTENDERS[name].paired_with


def contenders_help() -> str:
    """The contenders as `--help` lists them: name, label, prompts a step of B completions covers, role in the study
    and what it runs."""
    lines = ["contenders (--contenders NAME ...):"]
    for c in CONTENDERS.values():
        roles = ["a reference"] if c.reference else []
        if c.headline:
            roles.append("paired with " + ", ".join(("the references", *c.paired_with)))
        if c.rate_of is not None:
            roles.append(f"at {c.rate_of}'s tuned rate")
        lines.append(f"  {c.name:<17}{c.label}, {c.prompts_per_step}" + "".join(f"; {role}" for role in roles))
        lines += textwrap.wrap(c.summary, 119, initial_indent=" " * 19, subsequent_indent=" " * 19)
    return "\n".join(lines)

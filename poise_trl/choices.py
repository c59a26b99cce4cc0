"""The entries of every registry, by name and with what each does, light to import (no torch): the command lines
offer them as choices and `POISEConfig`'s help texts list them from here.

The registries themselves live with what they do: the value heads (`heads.HEADS`), the baseline's granularities
(`granularity.GRANULARITIES`), the prompt-sampling rules (`sampling.RULES`), the bootstraps (`baselines.BOOTSTRAPS`),
the reward scalings (`baselines.REWARD_SCALINGS`), the probes' schedules (`schedule.SCHEDULES`) and the domain
routings (`domains.ROUTINGS`). Each holds exactly the names below, in the same order, which tests/test_registries.py
checks, with its conformance checks over every entry. The probe presets are data and live here whole
(`PROBE_PRESETS`; presets.py fills a config from them); the rollout scalars' table imports no torch and is its own
list (`columns.SCALARS`).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .features.columns import DEFAULT_SCALARS, REFERENCE_SCALARS

HEADS = {
    "ridge": "StandardScaler, optional PCA, closed-form ridge regression (the paper's)",
    "logistic": "the same front end, then a logistic (sigmoid-BCE) regression fitted by Newton's method, as the "
    "official code's sigmoid_bce",
    "mlp": "the same front end, then one hidden ReLU layer trained by Adam, as the official code's mlp",
    "ensemble": "heads fitted side by side (its `children`), combined by their mean or a ridge stacked on their "
    "out-of-fold predictions, as the official code's multi-estimator",
    "pca_ridge": "scikit-learn's seeded randomized PCA of each raw hidden-state block, then StandardScaler and "
    "scikit-learn's ridge with intercept, as the POISE authors' reference probe (verl-recipe); needs scikit-learn",
}
"""`probe_head` -> what the value head fits (heads.py)."""

GRANULARITIES = {
    "sequence": "one baseline per rollout (the paper's)",
    "prefix": "once its own probe is trusted (after `probe_warmup_steps`), every generated token t gets A_t = "
    "r - V(x, y_<t), a value of the prefix from the states before t (unbiased: it never reads token t or later), "
    "learned from 4 sampled tokens per rollout; the sequence-level baseline serves until then. Needs a fixed "
    "`probe_layer` and a head with an affine map of the features",
}
"""`probe_granularity` -> what baseline each token gets (granularity.py)."""

RULES = {
    "value": "keep the candidates of highest v(1 - v), unweighted (biased)",
    "importance": "draw with replacement with probability proportional to sqrt(v(1 - v)), mixed with uniform at "
    "`prompt_selection_floor`, and multiply each prompt's advantages by its importance weight 1 / (n q), so the "
    "expected gradient is the uniform one (exactly under loss_type grpo, dr_grpo, sapo, luspo; under dapo, cispo, "
    "vespo the token-count normaliser is weighted too, up to a finite-batch difference; bnpo, beta != 0, the entropy "
    "bonus and top_entropy_quantile < 1 are refused)",
}
"""`prompt_selection` -> how the kept prompts are drawn from the candidates' predicted values (sampling.py)."""

BOOTSTRAPS = {
    "rloo": "the other rollouts' mean reward m_i (the paper's)",
    "shrunk": "a + w * m_i, m_i shrunk towards the mean reward of earlier steps' rollouts (a = (1 - w) * that "
    "mean, w in [0, 1] their least-squares fit), so it stays within the rewards seen (a=0, w=1, plain RLOO, before "
    "any history)",
}
"""`probe_bootstrap` -> the baseline before the probe is trusted (baselines.py)."""

REWARD_SCALINGS = {
    "none": "advantage = reward - baseline (the paper's)",
    "batch": "divide by the std of the rewards of all earlier training steps (+1e-4; 1 until they show any spread), "
    "never by a std that contains the rollout's own reward",
}
"""`scale_rewards` -> what divides the advantages (baselines.py)."""

SCHEDULES = {
    "domain": "each domain on its own: its probe is refitted after every step whose batch held it and trusted once "
    "the domain has `probe_warmup_steps` observed steps; a domain first seen late has its own bootstrap",
    "global": "the POISE authors' reference's: one bootstrap of `probe_warmup_steps` training steps for every domain, "
    "no probe fitted during it; at its end every domain's probe is fitted at once (each domain named in "
    "`probe_domain_buffer_sizes` must have rows by then, and no other domain is accepted); after it a domain's probe "
    "is refitted after each step whose batch held it once the domain has `probe_domain_warmup_steps` observed steps "
    "(its count is set to the training step at the end of the bootstrap)",
}
"""`probe_schedule` -> when each domain's probe is fitted and trusted (schedule.py)."""

ROUTINGS = {
    "identity": "each row's domain is its domain column's value",
    "reference": "the POISE authors' reference's `domain_for`: a data source whose name starts with 'math' or is "
    "openai/gsm8k, lighteval/math or huggingfaceh4/math-500 is 'math'; one that starts with 'codegen' or is "
    "codecontests, apps, codeforces or taco is 'code'; any other is 'other' (names compared lower-cased, without "
    "surrounding spaces)",
}
"""`probe_domain_routing` -> how a row's domain column value (a data source's name) becomes its domain (domains.py)."""


@dataclass(frozen=True)
class Preset:
    """A `probe_preset`: what it reproduces (`summary`), the value it gives each of its settings (POISEConfig fields:
    a field left at None takes the preset's value) and, for the settings it cannot do without, why (`required`: an
    explicit other value is refused with that reason; any other explicit value is taken and recorded as a change from
    the preset). `domain_settings` apply only with a `probe_domain_column`."""

    summary: str
    settings: Mapping[str, Any]
    required: Mapping[str, str] = field(default_factory=dict)
    domain_settings: Mapping[str, Any] = field(default_factory=dict)


_PIPELINE = {  # every preset's: the paper's G, features and pooling (§3, Table 4), one baseline per rollout
    "num_generations": 2,
    "scale_rewards": "none",
    "probe_features": ["prompt", "reasoning", "entropy"],
    "probe_pool_tokens": 10,
    "reasoning_end_marker": "</think>",
    "probe_granularity": "sequence",
    "probe_history": False,
    "prompt_selection": None,
}
_RECIPE = {"probe_buffer_size": 4096, "probe_warmup_steps": 16}  # the authors' buffer rows and bootstrap steps

PROBE_PRESETS: dict[str, Preset] = {
    "paper": Preset(
        "the paper's algorithm (Algorithm 1, §3 and Table 4): ridge on standardized features without PCA, "
        "alpha 0.01, clipped to the reward range, the partner's reward as target, G = 2, no std scaling; before the "
        "probe is trusted, RLOO (the paper fixes neither the buffer's rows nor a bootstrap length: those stay the "
        "fields' own)",
        {
            **_PIPELINE,
            "probe_head": "ridge",
            "probe_alpha": 0.01,
            "probe_pca_dims": [0, 0],
            "probe_clip_range": None,
            "probe_scalars": list(DEFAULT_SCALARS),
            "probe_partner_reward": False,
            "probe_bootstrap": "rloo",
            "probe_schedule": "domain",
            "probe_buffer_whole_groups": False,
            "probe_domain_routing": "identity",
            "probe_same_domain_groups": False,
            "probe_reward_range": None,
        },
    ),
    "reference": Preset(
        "the POISE authors' reference implementation (verl-project/verl-recipe, poise/), step by step: its probe "
        "(pca_ridge: seeded randomized PCA 32/64 of the raw blocks, StandardScaler, scikit-learn's Ridge(100), "
        "clipped to [0, 1]), its entropy statistics, RLOO for one global bootstrap of 16 steps, per-domain FIFOs of "
        "whole pairs, its domain routing and its refusals",
        {
            **_PIPELINE,
            **_RECIPE,
            "probe_head": "pca_ridge",
            "probe_alpha": 100.0,
            "probe_pca_dims": [32, 64],
            "probe_clip_range": [0.0, 1.0],
            "probe_scalars": list(REFERENCE_SCALARS),
            "probe_partner_reward": False,
            "probe_bootstrap": "rloo",
            "probe_schedule": "global",
            "probe_domain_warmup_steps": 8,
            "probe_buffer_whole_groups": True,
            "probe_domain_routing": "reference",
            "probe_same_domain_groups": True,
            "probe_reward_range": [0.0, 1.0],
        },
        required={
            "num_generations": "the reference draws exactly two rollouts per prompt: its buffers hold pairs and its "
            "baseline is the partner's value",
        },
        domain_settings={"probe_domain_buffer_sizes": {"math": 4096, "code": 3072, "other": 3072}},
    ),
    "release": Preset(
        "the holi-lab release's probe hyper-parameters (alpha 100, PCA 32/64) on poise-trl's own pipeline and "
        "defaults (StandardScaler before an exact PCA, the partner-aware probe, the shrunk bootstrap): not the "
        "authors' code",
        {
            **_PIPELINE,
            **_RECIPE,
            "probe_head": "ridge",
            "probe_alpha": 100.0,
            "probe_pca_dims": [32, 64],
            "probe_clip_range": None,
            "probe_scalars": list(DEFAULT_SCALARS),
            "probe_partner_reward": True,
            "probe_bootstrap": "shrunk",
            "probe_schedule": "domain",
            "probe_buffer_whole_groups": False,
            "probe_domain_routing": "identity",
            "probe_same_domain_groups": False,
            "probe_reward_range": None,
        },
    ),
}
"""`probe_preset` -> its whole settings, the one table of them (the Configuration page and the help read it)."""

DEFAULT_PRESET = "release"
"""`POISEConfig.probe_preset`'s default."""


def described(table: dict[str, str]) -> str:
    """A registry's entries as help text: "'name': what it does." for each, in order."""
    return " ".join(f"{name!r}: {text}." for name, text in table.items())

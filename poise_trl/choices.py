"""The entries of every registry, by name and with what each does, light to import (no torch): the command lines
offer them as choices and `POISEConfig`'s help texts list them from here.

The registries themselves import torch: the value heads (`heads.HEADS`), the baseline's granularities
(`granularity.GRANULARITIES`), the prompt-sampling rules (`sampling.RULES`), the bootstraps (`baselines.BOOTSTRAPS`)
and the reward scalings (`baselines.REWARD_SCALINGS`). Each holds exactly the names below, in the same order, which
tests/test_registries.py checks, with its conformance checks over every entry. The probe presets are data and live
here whole; the rollout scalars' table imports no torch and is its own list (`columns.SCALARS`).
"""

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

PROBE_PRESETS: dict[str, tuple[float, list[int]]] = {
    "release": (100.0, [32, 64]),  # holi-lab/POISE release, Qwen3-4B
    "paper": (0.01, [0, 0]),  # paper §3 / Table 4
}
"""`probe_preset` -> (ridge alpha, [prompt PCA dims, reasoning PCA dims]); 0 dims means no PCA on that block."""


def described(table: dict[str, str]) -> str:
    """A registry's entries as help text: "'name': what it does." for each, in order."""
    return " ".join(f"{name!r}: {text}." for name, text in table.items())

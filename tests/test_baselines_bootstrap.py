"""The shrunk bootstrap (`baselines.shrunk_rloo_line`, the default warm-up baseline): its weight against scipy's
bounded least squares, and the warm-up baselines of the estimator the default config builds, driven through small,
noisy steps, which must stay within the rewards seen (issue 58: an unclamped line fitted on one group of G has
w = 1 - G, and sent a baseline of 3 to 0/1 rewards)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import lsq_linear

from poise_trl import POISEConfig
from poise_trl.estimator.baselines import leave_one_out_targets, shrunk_rloo_line
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.features.features import FeatureLayout

from .conftest import CPU_ARGS

HIDDEN = 16


def default_estimator(num_generations: int, prompts: int) -> tuple[POISEEstimator, int]:
    """The estimator `POISEConfig`'s defaults build for a 4-layer model of width 16, and its feature width."""
    config = POISEConfig(
        output_dir="unused",
        num_generations=num_generations,
        per_device_train_batch_size=num_generations * prompts,
        **CPU_ARGS,
    )
    width = sum(FeatureLayout.from_config(config).sizes(HIDDEN).values())
    return POISEEstimator.from_config(config, num_layers=4, hidden_size=HIDDEN), width


def _step(estimator: POISEEstimator, width: int, rewards: list[float], seed: int = 0):
    """One step's advantages on noise features, then `observe`: (result, its host metrics)."""
    features = torch.randn(len(rewards), width, generator=torch.Generator().manual_seed(seed))
    result = estimator.advantages(features, Rollouts(torch.tensor(rewards)))
    metrics = result.metrics()
    estimator.observe(result)
    return result, metrics


# ---------------------------------------------------------------------------------------------- the two
def test_one_group_of_eight_no_longer_sends_a_baseline_of_three_to_an_all_zero_step():
    """`POISEConfig(num_generations=8, per_device_train_batch_size=8)`: the first step's single group (3 of 8
    succeed) fitted w = -7, a = 3 and gave the next, all-zero step a baseline of 3. Its one group says nothing about
    how partners' rewards predict across prompts: w = 0, and the baseline is the first step's mean reward."""
    estimator, width = default_estimator(8, 1)
    _step(estimator, width, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    result, metrics = _step(estimator, width, [0.0] * 8, seed=1)
    assert (metrics["bootstrap_weight"], metrics["bootstrap_intercept"]) == (0.0, 0.375)
    assert result.baselines.tolist() == [0.375] * 8 and metrics["baseline_mean"] == 0.375


def test_g2_all_zero_step_gets_the_earlier_mean_reward_not_minus_one():
    """G = 2, one prompt a step: (1, 0) then (0, 0) fitted w = -1 and gave every all-zero completion advantage -1."""
    estimator, width = default_estimator(2, 1)
    first, _ = _step(estimator, width, [1.0, 0.0])
    assert first.baselines.tolist() == [0.0, 1.0]  # no history: plain RLOO
    result, metrics = _step(estimator, width, [0.0, 0.0], seed=1)
    assert metrics["bootstrap_weight"] == 0.0 and result.advantages.tolist() == [-0.5, -0.5]


# ------------------------------------------------------------------------------------- small, noisy warm-up runs
def _rewards(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    """One step's rewards: 0/1 with a success rate drawn per prompt, or real-valued on a random scale and offset with
    about one row in eight unscored (NaN), which leaves partial groups whose partners' mean is not the mean reward."""
    if kind == "binary":
        return (torch.rand(n, generator=g) < torch.rand(1, generator=g)).float()
    scale, offset = 10 ** (4 * torch.rand(1, generator=g) - 2), 20 * torch.randn(1, generator=g)
    rewards = offset + scale * torch.randn(n, generator=g) * torch.rand(1, generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.125, torch.nan, rewards)


def _partner_range(rewards: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (min, max) over the finite rewards of its partners (±inf where none)."""
    grouped = rewards.view(-1, 1, num_generations).expand(-1, num_generations, -1)
    others = ~torch.eye(num_generations, dtype=torch.bool) & grouped.isfinite()
    low = torch.where(others, grouped, torch.inf).amin(-1).reshape(-1)
    return low, torch.where(others, grouped, -torch.inf).amax(-1).reshape(-1)


@pytest.mark.parametrize("kind", ["binary", "real"])
@pytest.mark.parametrize("num_generations", [2, 3, 4, 8])
def test_every_warm_up_baseline_lies_within_the_rewards_seen(num_generations, kind):
    """Runs of 6 steps of 1-2 prompts, 40 seeds each, on the default estimator (16 warm-up steps: every baseline is
    the bootstrap's). Each row's baseline lies within [min, max] of the finite rewards of the earlier steps and of
    the row's partners in this step (never its own reward). Exactly: the baseline is a convex mix of the earlier
    pairs' mean reward and the partners' mean, so it lies between those two."""
    checked = fitted = 0
    for prompts in (1, 2):
        for seed in range(40):
            g = torch.Generator().manual_seed(seed)
            estimator, width = default_estimator(num_generations, prompts)
            low, high = math.inf, -math.inf  # the earlier steps' finite rewards
            for step in range(6):
                rewards = _rewards(kind, num_generations * prompts, g)
                features = torch.randn(rewards.numel(), width, generator=g)
                result = estimator.advantages(features, Rollouts(rewards))
                metrics = result.metrics()
                partner_low, partner_high = _partner_range(rewards, num_generations)
                rows = result.receives
                baselines = result.baselines[rows]
                assert (baselines >= partner_low[rows].clamp(max=low)).all(), (seed, step, baselines)
                assert (baselines <= partner_high[rows].clamp(min=high)).all(), (seed, step, baselines)
                assert metrics["bootstrap"] == float(rows.any()) and 0 <= metrics["bootstrap_weight"] <= 1
                checked += int(rows.sum())
                fitted += step > 0 and metrics["bootstrap_weight"] < 1
                estimator.observe(result)
                finite = rewards[rewards.isfinite()]
                if finite.numel():
                    low, high = min(low, finite.min().item()), max(high, finite.max().item())
    assert checked > 40 * 6 * num_generations and fitted > 100  # the rule ran, and shrank, on most steps


# ------------------------------------------------------------------------------------------------- the line itself
def _scipy_line(partners: np.ndarray, rewards: np.ndarray) -> tuple[float, float]:
    """(a, w) by scipy's bounded least squares: min over w in [0, 1] of |(r - r̄) - w (m - r̄)|², a = (1 - w) r̄."""
    keep = np.isfinite(partners) & np.isfinite(rewards)
    mean = rewards[keep].mean()
    deviation = (partners[keep] - mean)[:, None]
    if not deviation.any():
        return mean, 0.0
    (weight,) = lsq_linear(deviation, rewards[keep] - mean, bounds=(0.0, 1.0), method="bvls").x
    return (1 - weight) * mean, weight


@pytest.mark.parametrize("seed", range(20))
def test_the_line_is_the_bounded_least_squares_shrinkage(seed):
    """Against scipy on grouped rewards with unscored rows (partial groups), on unrelated pairs and on partner means
    that move half as far from the mean as the rewards (unbounded w = 2): weights on either bound and between."""
    g = torch.Generator().manual_seed(seed)
    group, prompts = 2 + seed % 4, 2 + seed % 5
    rewards = torch.randn(group * prompts, generator=g) + torch.randn(prompts, generator=g).repeat_interleave(group)
    rewards[seed % 3 :: 5] = torch.nan  # unscored rows: partial groups
    partners = leave_one_out_targets(rewards, group)
    halfway = (rewards + rewards.nanmean()) / 2
    for m, r in ((partners, rewards), (torch.randn(rewards.numel(), generator=g), rewards), (halfway, rewards)):
        line = shrunk_rloo_line(m, r)
        assert line.dtype == torch.float64
        reference = _scipy_line(m.double().numpy(), r.double().numpy())
        torch.testing.assert_close(line, torch.tensor(reference, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_the_line_without_pairs_is_rloo_and_on_constant_rewards_is_their_value():
    nan = torch.full((4,), torch.nan)
    assert shrunk_rloo_line(nan, nan).tolist() == [0.0, 1.0]
    assert shrunk_rloo_line(torch.full((4,), 0.25), torch.full((4,), 0.25)).tolist() == [0.25, 0.0]


finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=24), finite)
def test_the_baseline_lies_between_the_mean_reward_and_the_partners_mean_for_any_pairs(pairs, partner_mean):
    m, r = torch.tensor(pairs).T
    a, w = shrunk_rloo_line(m, r).tolist()
    mean = r.double().mean().item()
    baseline, tolerance = a + w * partner_mean, 1e-9 * (abs(mean) + abs(partner_mean) + 1)
    assert 0 <= w <= 1
    assert min(mean, partner_mean) - tolerance <= baseline <= max(mean, partner_mean) + tolerance

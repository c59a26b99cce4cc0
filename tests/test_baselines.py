"""Cross-rollout baselines, leave-one-out targets and diagnostics, by hand."""

import math

import pytest
import torch

from poise_trl.estimator.baselines import (
    DIAGNOSTICS,
    RunningStd,
    cross_rollout_baselines,
    diagnostic_tensors,
    leave_one_out_targets,
)


def diagnostics(*args, **kwargs) -> dict[str, float]:
    """`diagnostic_tensors` by name, as the trainer logs them."""
    return dict(zip(DIAGNOSTICS, diagnostic_tensors(*args, **kwargs).tolist(), strict=True))


def test_g2_is_the_swap():
    values = torch.tensor([0.1, 0.7, 0.4, 0.2])
    assert cross_rollout_baselines(values, 2).tolist() == pytest.approx([0.7, 0.1, 0.2, 0.4])


def test_g3_mean_of_others_and_invalid_partners_are_skipped():
    values = torch.tensor([1.0, 2.0, 6.0, 3.0, float("nan"), 5.0])
    valid = torch.tensor([True, True, True, True, True, False])
    out = cross_rollout_baselines(values, 3, valid)
    assert out[:3].tolist() == pytest.approx([4.0, 3.5, 1.5])
    # Row 3's partners are NaN and invalid: no baseline. Rows 4 and 5 only have row 3.
    assert math.isnan(out[3]) and out[4:].tolist() == [3.0, 3.0]


def test_leave_one_out_targets_never_use_own_reward():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    targets = leave_one_out_targets(rewards, 4)
    assert targets.tolist() == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 1.0, 2 / 3])
    perturbed = rewards.clone()
    perturbed[0] = 100.0
    assert leave_one_out_targets(perturbed, 4)[0] == targets[0]


def test_partial_groups_are_rejected():
    with pytest.raises(ValueError, match="whole groups of 2"):
        cross_rollout_baselines(torch.ones(5), 2)
    with pytest.raises(ValueError, match="at least 2"):
        leave_one_out_targets(torch.ones(4), 1)


def test_diagnostics_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    values = torch.tensor([0.8, 0.4, 0.5, 0.5])
    baselines = cross_rollout_baselines(values, 2)  # [0.4, 0.8, 0.5, 0.5]
    d = diagnostics(rewards, baselines, values, 2, unclipped_values=torch.tensor([0.8, 0.4, 0.5, 0.7]))
    advantages = rewards - baselines  # [0.6, -0.8, 0.5, 0.5]
    var_r = rewards.var(unbiased=False)
    assert d["mae"] == pytest.approx(advantages.abs().mean().item())
    assert d["value_mean"] == pytest.approx(0.55)
    assert d["variance_reduction"] == pytest.approx(1 - (advantages.var(unbiased=False) / var_r).item())
    assert d["brier_skill"] == pytest.approx(1 - (advantages.pow(2).mean() / var_r).item())
    assert d["group_mae"] == pytest.approx((abs(0.6 - 0.5) + abs(0.5 - 1.0)) / 2)
    assert d["sign_accuracy"] == 1.0  # only group 0 is decided, and 0.8 > 0.4 like 1 > 0
    assert d["clip_fraction"] == 0.25
    assert d["pearson_r"] == pytest.approx(torch.corrcoef(torch.stack([baselines, rewards]))[0, 1].item(), abs=1e-6)
    # One pair per prompt: within-group sample variances 0.5 and 0; Var(r) = 3/16.
    assert d["variance_reduction_bound"] == pytest.approx(1 - 0.25 / (3 / 16))


def test_variance_reduction_bound_is_what_the_true_value_baseline_reaches():
    """Rollouts drawn with known per-prompt success rates p: the bound estimates 1 - mean p(1-p) / Var(r), the
    variance reduction of the baseline b = p, and no feasible baseline (here: the true p) exceeds it."""
    generator = torch.Generator().manual_seed(0)
    p = torch.rand(4000, generator=generator).repeat_interleave(2)
    rewards = torch.bernoulli(p, generator=generator)
    d = diagnostics(rewards, p, p, 2)
    expected = 1 - (p * (1 - p)).mean() / rewards.var(unbiased=False)
    assert d["variance_reduction_bound"] == pytest.approx(expected.item(), abs=0.02)
    assert d["variance_reduction"] == pytest.approx(d["variance_reduction_bound"], abs=0.03)
    noisy = (p + 0.3 * torch.randn(p.shape, generator=generator)).clamp(0, 1)
    assert diagnostics(rewards, noisy, noisy, 2)["variance_reduction"] < d["variance_reduction_bound"] - 0.05


def test_diagnostics_with_constant_rewards_are_nan_not_errors():
    d = diagnostics(torch.ones(4), torch.full((4,), 0.5), torch.full((4,), 0.5), 2)
    assert d["mae"] == 0.5 and math.isnan(d["variance_reduction"]) and math.isnan(d["pearson_r"])


def test_own_value_never_touches_own_baseline_even_when_huge():
    assert cross_rollout_baselines(torch.tensor([1e8, 1.0, 0.5]), 3)[0] == 0.75


def test_running_std_merges_batches_exactly_and_starts_at_divisor_one():
    """The batch-scaling divisor: 1 before any spread, then the sample std of every finite value seen, + 1e-4."""
    running = RunningStd()
    assert running.divisor() == 1.0
    running.update(torch.tensor([0.5, 0.5, float("nan")]))
    assert running.count == 2 and running.divisor() == 1.0  # no spread yet: never 1 / 1e-4
    g = torch.Generator().manual_seed(0)
    batches = [torch.rand(n, generator=g, dtype=torch.float64) * 3 for n in (1, 7, 16)]
    for batch in batches:
        running.update(batch)
    everything = torch.cat([torch.tensor([0.5, 0.5], dtype=torch.float64), *batches])
    assert running.std == pytest.approx(everything.std().item(), rel=1e-12)
    assert running.divisor() == pytest.approx(everything.std().item() + 1e-4, rel=1e-12)
    restored = RunningStd()
    restored.load_state_dict(running.state_dict())
    assert restored.divisor() == running.divisor()

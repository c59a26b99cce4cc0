"""`poise-trl bench gradient`: the reference, the rules' batch weights and the measured errors, on known gradients and
end to end on the tiny model."""

import json

import numpy as np
import pytest
import torch

from poise_trl import cli
from poise_trl.bench.gradient import (
    batch_errors,
    draw_batches,
    gram,
    loo_advantages,
    needed_completions,
    reference_weights,
)

K = 8  # rollouts per prompt in the synthetic pools


def _pool(num_prompts: int = 40, dim: int = 30, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards with per-prompt success rates, and per-rollout 'gradients' whose mean depends on the reward, so the
    reward-weighted mean is a non-zero signal among noise."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(num_prompts, generator=g).repeat_interleave(K)
    rewards = torch.bernoulli(p, generator=g)
    direction = torch.randn(dim, generator=g)
    gradients = torch.randn(num_prompts * K, dim, generator=g) + rewards[:, None] * direction
    return rewards, gradients


def test_reference_is_the_mean_of_the_per_rollout_leave_one_out_estimates():
    rewards, gradients = _pool()
    per_rollout = loo_advantages(rewards, K)[:, None].double() * gradients.double()
    reference = gradients.double().T @ torch.from_numpy(reference_weights(rewards, K))
    assert torch.allclose(reference, per_rollout.mean(0), atol=1e-12)
    counts = np.zeros(40)
    counts[3], counts[7] = 2, 1  # a bootstrap resample that holds prompt 3 twice and prompt 7 once
    weighted = gradients.double().T @ torch.from_numpy(reference_weights(rewards, K, counts))
    expected = (2 * per_rollout[3 * K : 4 * K].sum(0) + per_rollout[7 * K : 8 * K].sum(0)) / (3 * K)
    assert torch.allclose(weighted, expected, atol=1e-12)


def test_rloo_batches_are_unbiased_for_the_reference_and_their_error_falls_with_the_budget():
    rewards, gradients = _pool()
    k_matrix, w_ref = gram(gradients), reference_weights(rewards, K)
    r, pool = rewards.double().numpy(), np.arange(40)
    errors = {}
    for budget in (8, 32):
        batches = draw_batches("rloo2", budget, r, K, pool, 4000, np.random.default_rng(0))
        errors[budget] = batch_errors(batches, k_matrix, w_ref)
    assert errors[32]["relative_mse"] < errors[8]["relative_mse"] / 2  # about 1/4 for an unbiased rule
    assert errors[32]["bias"] < 0.05 * errors[32]["relative_mse"]  # the bias part is Monte Carlo noise only
    scaled = draw_batches("grpo8", 32, r, K, pool, 4000, np.random.default_rng(0))
    assert batch_errors(scaled, k_matrix, w_ref)["bias"] > 5 * errors[32]["bias"]  # std scaling changes the mean


def test_centring_charges_a_probe_baseline_no_bias_and_leaves_group_baselines_as_they_were():
    """A constant baseline is unbiased for the true gradient (E[g] = 0), but not for a pool whose mean score is not 0:
    centred gradients give it no bias beyond the pool's 1/K scale; RLOO's advantages sum to 0, so it is unchanged."""
    rewards, gradients = _pool()
    w_ref, r, pool = reference_weights(rewards, K), rewards.double().numpy(), np.arange(40)
    constant = draw_batches("poise", 32, r, K, pool, 4000, np.random.default_rng(0), {"poise": np.full(r.size, 0.5)})
    raw, centred = batch_errors(constant, gram(gradients), w_ref), batch_errors(constant, gram(gradients, K), w_ref)
    # centred, the expectation is (K-1)/K of the reference (the pool's covariance, not its unbiased estimate)
    assert centred["bias"] == pytest.approx(1 / K**2, abs=0.004) and raw["bias"] > 5 * centred["bias"]
    rloo = draw_batches("rloo2", 32, r, K, pool, 200, np.random.default_rng(0))
    assert batch_errors(rloo, gram(gradients), w_ref) == pytest.approx(batch_errors(rloo, gram(gradients, K), w_ref))


def test_batch_error_matches_the_explicit_gradients():
    """The Gram-matrix error of one batch equals ||ĝ - g_ref||² / ||g_ref||² computed from the gradients."""
    rewards, gradients = _pool(num_prompts=10)
    w_ref = reference_weights(rewards, K)
    batches = draw_batches(
        "grpo8_noscale", 16, rewards.double().numpy(), K, np.arange(10), 1, np.random.default_rng(1)
    )
    g = gradients.double()
    estimate = g[torch.from_numpy(batches.index[0])].T @ torch.from_numpy(batches.weight[0])
    reference = g.T @ torch.from_numpy(w_ref)
    error = batch_errors(batches, gram(gradients), w_ref)
    expected = ((estimate - reference).norm() ** 2 / reference.norm() ** 2).item()
    assert error["relative_mse"] == pytest.approx(expected, rel=1e-9)
    assert error["cosine"] == pytest.approx(torch.nn.functional.cosine_similarity(estimate, reference, 0).item())


def test_poise_weights_use_the_partners_value_and_dapo_counts_dropped_groups():
    r = np.array([1.0, 0.0, 1.0, 1.0] * 2 + [0.0] * 8)  # prompt 0 mixed, prompt 1 all wrong (k=8)
    values = {"poise": np.linspace(0.1, 0.8, 16)}
    batches = draw_batches("poise", 4, r, 8, np.array([0]), 1, np.random.default_rng(0), values)
    i = batches.index[0].reshape(2, 2)
    expected = (r[i] - values["poise"][i][:, ::-1]) / 4
    assert np.allclose(batches.weight[0], expected.ravel())
    dapo = draw_batches("dapo_ds_carry", 16, r, 8, np.array([0, 1]), 200, np.random.default_rng(0))
    both = dapo.index.reshape(200, 2, 8)[:, :, 0] // 8
    mixed_once = (both == [0, 1]).all(1) | (both == [1, 0]).all(1)
    kept = np.abs(dapo.weight.reshape(200, 2, 8)).sum(-1) > 0
    assert kept.sum(1)[mixed_once].max() == 1  # the all-wrong group is generated, counted, and dropped


def test_needed_completions_reads_the_measured_curve():
    assert needed_completions([32, 64, 128], [1.0, 0.5, 0.25], 0.5) == pytest.approx(64)
    assert needed_completions([32, 64, 128], [1.0, 0.5, 0.25], 0.35) == pytest.approx(64 * 2 ** np.log2(0.5 / 0.35))
    assert needed_completions([32, 64], [1.0, 0.9], 0.5) == float("inf")
    assert needed_completions([32, 64], [0.4, 0.2], 0.5) == 32


def test_command_end_to_end_on_the_tiny_model(tiny_model_path, tmp_path):
    out = tmp_path / "gradient"
    argv = ["bench", "gradient", str(tiny_model_path), "--dataset", "sort", "--num-prompts", "16", "--k", "8"]
    argv += ["--reward-fn", "tests.bench.test_probe_bench:toy_reward", "--max-new-tokens", "6", "--device", "cpu"]
    argv += ["--pool-tokens", "3", "--budgets", "16", "32", "--batches", "100", "--bootstrap", "10"]
    argv += ["--bootstrap-batches", "20", "--folds", "2", "--output-dir", str(out)]
    assert cli.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["pool"]["prompts"] == 16 and results["pool"]["k"] == 8
    for subspace in ("lora", "norms"):
        table = results["subspaces"][subspace]["table"]
        assert set(table) == {"grpo8", "grpo8_noscale", "dapo_ds_carry", "rloo2", "poise_paper", "poise"}
        for cells in table.values():
            for cell in cells.values():
                assert cell["relative_mse"] == pytest.approx(cell["bias"] + cell["variance"])
                assert 0 <= cell["best_scale_mse"] <= 1 and -1 <= cell["cosine"] <= 1
        assert results["subspaces"][subspace]["needed"]["poise"]["poise_share"] == 1.0
    assert results["dimensions"]["lora"] > 0 and (out / "gradient.png").stat().st_size > 0
    assert "Completions needed to reach POISE (default)" in (out / "results.md").read_text()


def test_the_batch_must_hold_whole_groups():
    with pytest.raises(ValueError, match="whole groups of 8"):
        draw_batches("grpo8", 12, np.zeros(16), 8, np.arange(2), 1, np.random.default_rng(0))

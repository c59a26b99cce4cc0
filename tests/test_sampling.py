"""`poise_trl.sampling`: the prompt-sampling rules as pure functions of (seed, rank, step), and the importance rule's
unbiasedness: its weighted estimate has the uniform draw's expectation, the top-k "value" rule's does not."""

from types import SimpleNamespace

import pytest
import torch

from poise_trl import sampling
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.specs import BufferSpec, EstimatorSpec

UNIT = (torch.tensor(0.0), torch.tensor(1.0))
VALUE, IMPORTANCE = sampling.HighestVariance(), sampling.Importance(floor=0.2)
NEVER_TRUSTED = EstimatorSpec(buffer=BufferSpec(warmup_steps=100))  # the bootstrap baseline throughout


def test_the_value_rule_keeps_the_highest_predicted_variance_or_draws_uniformly_without_a_prediction():
    values = torch.tensor([0.0, 0.9, 0.5, 1.0, 0.4, 0.2])  # q(1-q): 0, .09, .25, 0, .24, .16
    drawn = sampling.draw(VALUE, 6, 2, values, (torch.tensor(0.0), torch.tensor(1.0)), seed=0, rank=0, step=3)
    assert drawn.indices == [2, 4] and drawn.weights is None and drawn.scores[2] == pytest.approx(0.25)
    blind = [sampling.draw(VALUE, 6, 3, seed=0, rank=rank, step=step) for rank in (0, 1) for step in range(20)]
    assert all(len(d.indices) == 3 == len(set(d.indices)) and d.scores is None for d in blind)
    assert len({tuple(d.indices) for d in blind}) > 5  # ranks and steps draw differently
    again = sampling.draw(VALUE, 6, 3, seed=0, rank=1, step=7)
    assert again == blind[20 + 7]  # a pure function of (seed, rank, step): a resumed run draws the same


def test_importance_probabilities_mix_the_predicted_spread_with_uniform_and_weigh_uniform_as_one():
    values = torch.tensor([0.0, 0.9, 0.5, 1.0, 0.4, 0.2])
    q = sampling.importance_probabilities(values, 0.0, 1.0, 0.2)
    spread = (values.double() * (1 - values.double())).sqrt()
    assert torch.allclose(q, 0.8 * spread / spread.sum() + 0.2 / 6) and q.sum().item() == pytest.approx(1)
    weights = sampling.importance_weights(q)
    assert weights.max().item() == pytest.approx(1 / 0.2 * 1)  # a zero-spread candidate: the floor bounds it
    assert torch.allclose(sampling.importance_weights(sampling.importance_probabilities(values, 0, 1, 1.0)), 1 + 0 * q)
    flat = sampling.importance_probabilities(torch.tensor([0.5] * 4), 0.0, 1.0, 0.2)
    assert torch.allclose(sampling.importance_weights(flat), torch.ones(4, dtype=torch.float64))
    saturated = sampling.importance_probabilities(torch.tensor([1.0, 0.0, 1.0]), 0.0, 1.0, 0.2)
    assert torch.allclose(saturated, torch.full((3,), 1 / 3, dtype=torch.float64))  # no spread anywhere: uniform
    ranged = sampling.importance_probabilities(2 * values - 1, -1.0, 1.0, 0.2)  # ±1 rewards: read on their range
    assert torch.allclose(ranged, q)


def test_the_importance_rule_draws_with_replacement_by_seed_rank_and_step_and_uniformly_without_a_prediction():
    values = torch.tensor([0.0, 0.9, 0.5, 1.0, 0.4, 0.2])
    drawn = sampling.draw(IMPORTANCE, 6, 5, values, UNIT, seed=0, rank=0, step=3)
    q = sampling.importance_probabilities(values, 0.0, 1.0, 0.2)
    assert drawn.indices == sorted(drawn.indices) and len(drawn.indices) == 5
    assert drawn.weights == [(1 / (6 * q[i])).item() for i in drawn.indices]
    assert drawn == sampling.draw(IMPORTANCE, 6, 5, values, UNIT, seed=0, rank=0, step=3)
    assert drawn != sampling.draw(IMPORTANCE, 6, 5, values, UNIT, seed=0, rank=1, step=3)
    blind = sampling.draw(IMPORTANCE, 6, 3, seed=0, rank=0, step=3)
    assert blind == sampling.draw(VALUE, 6, 3, seed=0, rank=0, step=3)  # before the probe: uniform, weights 1


@pytest.mark.parametrize(
    ("values", "floor", "message"),
    [
        (torch.tensor([0.5, float("nan")]), 0.2, "non-empty finite 1-d"),
        (torch.tensor([0.5, 0.2]), 0.0, r"must be in \(0, 1\]"),
        (torch.tensor([0.5, 0.2]), 1.5, r"must be in \(0, 1\]"),
    ],
)
def test_bad_importance_inputs_are_refused(values, floor, message):
    with pytest.raises(ValueError, match=message):
        sampling.draw(sampling.Importance(floor=floor), 2, 2, values, UNIT, seed=0, rank=0, step=0)


def _draws(rule: sampling.Rule, values: torch.Tensor, keep: int, trials: int) -> list[sampling.Draw]:
    return [sampling.draw(rule, values.numel(), keep, values, UNIT, seed=3, rank=0, step=t) for t in range(trials)]


def test_the_weighted_importance_estimate_of_a_known_per_prompt_mean_is_unbiased_and_the_top_k_one_is_not():
    """Each prompt has a known mean m(x), here its gradient scale sqrt(v(1 - v)) plus noise; the estimator
    (1/k) sum_draws w m has the uniform mean E_x m(x) as its expectation (Monte Carlo, within 4 standard errors)."""
    g = torch.Generator().manual_seed(0)
    values = torch.rand(12, generator=g)
    means = (values * (1 - values)).sqrt().double() + 0.05 * torch.randn(12, generator=g, dtype=torch.float64)
    estimates = torch.tensor(
        [
            sum(w * means[i] for i, w in zip(d.indices, d.weights, strict=True)) / 4
            for d in _draws(sampling.Importance(), values, 4, 4000)
        ]
    )
    error = (estimates.mean() - means.mean()) / (estimates.std() / len(estimates) ** 0.5)
    assert abs(error) < 4, f"{estimates.mean():.4f} against the uniform mean {means.mean():.4f}"
    unweighted = torch.tensor([means[d.indices].mean() for d in _draws(sampling.Importance(), values, 4, 4000)])
    assert unweighted.mean() - means.mean() > 10 * estimates.std() / len(estimates) ** 0.5  # the weights matter
    top = means[_draws(VALUE, values, 4, 1)[0].indices].mean()
    assert abs(top - means.mean()) > 0.05  # the "value" rule trains on the high-variance prompts' mean


@pytest.mark.parametrize("group", [2, 8])  # POISE's G = 2 and the G = 8 comparator
def test_weighted_advantages_give_the_uniform_prompt_gradient_in_expectation(group):
    """Bernoulli rollouts (leave-one-out bootstrap baseline) on prompts drawn by the importance rule: the per-prompt
    policy gradient sum_rows w A (y - p) / (k G) of a logit per prompt has the uniform draw's expectation p(1 - p) / n,
    with the weights `POISEEstimator.advantages` applies, and misses it without them."""
    g, keep, trials = torch.Generator().manual_seed(1), 4, 3000
    p = torch.tensor([0.01, 0.03, 0.1, 0.3, 0.5, 0.7, 0.95, 0.99]).double()
    values = (p + 0.05 * torch.randn(8, generator=g, dtype=torch.float64)).clamp(0, 1)  # an imperfect prediction
    estimator = POISEEstimator(group, NEVER_TRUSTED)

    def gradients(draws: list[sampling.Draw], weighted: bool) -> torch.Tensor:
        prompts = torch.tensor([i for d in draws for i in d.indices]).repeat_interleave(group)
        weights = torch.tensor([w for d in draws for w in (d.weights or [1.0] * keep)]).repeat_interleave(group)
        y = (torch.rand(len(prompts), generator=g, dtype=torch.float64) < p[prompts]).double()
        record = Rollouts(y, weights=weights.double() if weighted else None)
        result = estimator.advantages(torch.randn(len(y), 3), record)
        score = result.advantages.double() * (y - p[prompts]) / (keep * group)
        per_trial = torch.zeros(trials, 8, dtype=torch.float64)
        per_trial.index_put_((torch.arange(len(y)) // (keep * group), prompts), score, accumulate=True)
        return per_trial

    def z(estimates: torch.Tensor) -> torch.Tensor:
        return (estimates.mean(0) - p * (1 - p) / 8) / (estimates.std(0) / trials**0.5)

    importance = _draws(sampling.Importance(), values.float(), keep, trials)
    assert max(max(d.weights) for d in importance) > 1.5  # the draws are far from uniform
    no_probe_yet = [sampling.draw(sampling.Importance(), 8, keep, seed=3, rank=0, step=t) for t in range(trials)]
    assert z(gradients(importance, weighted=True)).abs().max() < 4.5
    assert z(gradients(no_probe_yet, weighted=True)).abs().max() < 4.5
    assert z(gradients(importance, weighted=False)).abs().max() > 6  # unweighted, the draw's tilt shows


def test_each_rule_takes_only_its_own_settings():
    """A rule's settings are its fields: the value rule has none, the importance rule its floor (set by
    `prompt_selection_floor`); a setting no rule has is refused."""
    config = SimpleNamespace(prompt_selection="value", prompt_selection_floor=0.2)
    assert sampling.rule_from_config(config) == sampling.HighestVariance()
    config.prompt_selection = "importance"
    assert sampling.rule_from_config(config) == sampling.Importance(floor=0.2)
    assert sampling.Importance().floor == sampling.DEFAULT_FLOOR
    with pytest.raises(ValueError, match=r"prompt_selection_floor=0 must be in \(0, 1\]"):
        sampling.Importance(floor=0)

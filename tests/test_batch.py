"""batch.py: the batch record's checks, which rows a step's prepared batch may use (the partner-reward column,
non-finite rows) and what its diagnostics count (the rows that really got the bootstrap, unscorable rows, dropped
features)."""

import pytest
import torch

from poise_trl.estimator.estimator import POISEEstimator, Rollouts

from .test_estimator import SPEC, G, _batch, _trained, spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(rewards=torch.ones(4, 1)), r"rewards must be an \(N,\) tensor, one per rollout, got \(4, 1\)"),
        (dict(rewards=[1.0, 0.0]), "rewards must be an .* got list"),
        (dict(num_generations=1), "at least 2 rollouts per prompt"),
        (dict(domains=["a"] * 3), "Got 3 domain names for 4 rows"),
        (dict(has_completion=torch.ones(3, dtype=torch.bool)), r"has_completion must be an \(4,\) tensor"),
        (dict(weights=torch.ones(3)), r"weights must be an \(4,\) tensor, one per row as the rewards, got \(3,\)"),
        (dict(weights=torch.tensor([1.0, float("nan"), 1.0, 1.0])), r"weights must be \(4,\) finite and positive"),
        (dict(weights=torch.tensor([1.0, 0.0, 1.0, 1.0])), r"weights must be \(4,\) finite and positive"),
        (dict(prompt_ids=torch.arange(8).view(4, 2)), r"prompt_ids must be an \(4,\) tensor"),
    ],
)
def test_the_record_refuses_what_does_not_fit_its_rows_when_it_is_made(fields, message):
    with pytest.raises(ValueError, match=message):
        Rollouts(**{"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]), **fields})


def test_a_records_rows_are_taken_with_every_per_row_field():
    record = Rollouts(torch.arange(8.0), 2, list("abcdefgh"), torch.ones(8, dtype=torch.bool), None, torch.arange(8))
    part = record.take(torch.tensor([6, 7]))
    assert part.rewards.tolist() == [6.0, 7.0] and part.domains == ["g", "h"] and part.prompt_ids.tolist() == [6, 7]
    assert part.weights is None and part.num_generations == 2 and part.has_completion.shape == (2,)
    with pytest.raises(ValueError, match="Got 16 rewards for 8 feature rows"):
        POISEEstimator(G, SPEC).advantages(torch.zeros(8, 3), Rollouts(torch.zeros(16)))


def test_bootstrap_counts_the_rows_that_really_got_the_fallback():
    """A trusted probe, but one row without usable features: its partner's baseline falls back, its own does not."""
    estimator = _trained(3)
    x, r, _, _ = _batch(20)
    x[5] = float("nan")
    result = estimator.advantages(x, Rollouts(r))
    metrics = result.metrics()
    assert metrics["bootstrap"] == pytest.approx(1 / 16)
    assert metrics["feature_rows_dropped"] == 1.0 and metrics["unscorable_rows"] == 0.0
    intercept, weight = estimator.bootstrap_lines_["default"]  # row 4's only partner, row 5, has no usable features
    torch.testing.assert_close(result.baselines[4].double(), intercept + weight * r[5].double())
    values = estimator.probes_["default"].predict(torch.cat([x, r[:, None]], 1)[:, None])
    assert result.baselines[5] == values[4]  # row 5's own baseline still comes from its partner's probe value


def test_unscorable_rows_are_counted_apart_from_dropped_features():
    estimator = _trained(2)
    x, r, _, _ = _batch(30)
    r[:3] = float("nan")
    metrics = estimator.advantages(x, Rollouts(r)).metrics()
    assert metrics["unscorable_rows"] == 3.0 and metrics["feature_rows_dropped"] == 0.0


def test_the_partner_reward_column_stays_outside_an_integer_pca():
    """pca_dims=4 is the PCA of the 6 feature columns; the reward (column 7) passes through it untouched."""
    estimator = _trained(steps=2, settings=spec(head={"pca_dims": 4}))
    probe = estimator.probes_["default"].probe
    assert probe._fit.blocks == ((0, 6),) and probe.fitted_pca_dims == [4]
    with pytest.raises(ValueError, match=r"covers column 6, the partner-reward column"):
        _trained(steps=1, settings=spec(head={"pca_dims": [(0, 7, 4)]}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_reward_column_keeps_fp32_whatever_the_features_dtype(dtype):
    x, r, groups, _ = _batch(0)
    r = torch.where(r > 0, 70_000.3, 0.3)  # 0.3 reads 0.30078125 in bf16; 70,000 overflows fp16
    estimator = POISEEstimator(G, SPEC)
    result = estimator.advantages(x.to(dtype), Rollouts(r))
    estimator.observe(features=x.to(dtype), rollouts=Rollouts(r, prompt_ids=groups))
    buffered = estimator.probes_["default"].buffer.features[:, 0, -1]
    assert buffered.dtype == torch.float32 and set(buffered.tolist()) == set(r.float().tolist())
    assert result.metrics()["feature_rows_dropped"] == 0.0


def test_rows_whose_reward_overflows_the_column_are_dropped_and_counted():
    x, r, groups, _ = _batch(0)
    r = r.double()
    r[0] = 1e39  # finite in float64, inf in the fp32 column
    estimator = POISEEstimator(G, SPEC)
    metrics = estimator.advantages(x, Rollouts(r)).metrics()
    estimator.observe(features=x, rollouts=Rollouts(r, prompt_ids=groups))
    assert metrics["feature_rows_dropped"] == 1.0
    assert torch.isfinite(estimator.probes_["default"].buffer.features).all()

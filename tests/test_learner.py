"""OnlineLearner: a value (every update returns a new learner), trust after the bootstrap, refits on earlier steps'
rows, warm start, and exact persistence; the same class learns the sequence value and the per-prefix value."""

import torch

from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.learner import OnlineLearner
from poise_trl.estimator.specs import EstimatorSpec, GranularitySpec
from poise_trl.heads.probe import ValueProbe


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 4, generator=g)
    return x, (x[:, 0, 0] > 0).float()


def test_trusted_only_once_fitted_and_past_the_bootstrap():
    learner = OnlineLearner(ValueProbe(alpha=1.0), capacity=64, warmup_steps=2)
    assert not learner.trusted and not learner.can_fit
    x, y = _rows(8, 0)
    added = learner.added(x, y)
    assert not learner.can_fit and learner.steps == 0  # a value: `added` built a new learner
    learner = added
    assert learner.can_fit and not learner.probe.is_fitted
    fitted = learner.fitted()
    assert not learner.probe.is_fitted and fitted.probe.is_fitted
    assert not fitted.trusted  # fitted, but one step of data < warmup_steps
    learner = fitted.added(*_rows(8, 1)).fitted()
    assert learner.trusted and learner.steps == 2
    expected = ValueProbe(alpha=1.0).fit(learner.buffer.features[:, 0], learner.buffer.targets)
    assert torch.equal(learner.predict(x), expected.predict(x[:, 0]))


def test_masked_rows_never_enter_and_a_step_with_none_still_counts():
    learner = OnlineLearner(ValueProbe(alpha=1.0), capacity=64)
    x, y = _rows(6, 2)
    learner = learner.added(x, y, keep=torch.tensor([True, False, True, False, False, False]))
    learner = learner.added(x, y, keep=torch.zeros(6, dtype=torch.bool))
    assert len(learner.buffer) == 2 and learner.steps == 2
    assert torch.equal(learner.buffer.targets, y[[0, 2]])


def test_state_round_trips_and_a_warm_start_is_trusted_with_fresh_counters():
    learner = OnlineLearner(ValueProbe(alpha=1.0, clip=(0.0, 1.0)), capacity=64, warmup_steps=3)
    for seed in range(3):
        learner = learner.added(*_rows(8, seed), groups=torch.arange(8))
    learner = learner.fitted()
    state, info = learner.state_dict(), learner.info()
    assert info["head"] == "ridge" and info["steps"] == 3
    resumed = OnlineLearner(ValueProbe(alpha=1.0, clip=(0.0, 1.0)), capacity=64, warmup_steps=3)
    resumed = resumed.loaded(state, info)
    assert resumed.steps == 3 and resumed.trusted
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), state.values(), strict=True))
    x, _ = _rows(5, 9)
    assert torch.equal(resumed.predict(x), learner.predict(x))
    warm = OnlineLearner(ValueProbe(alpha=1.0, clip=(0.0, 1.0)), capacity=64, warmup_steps=3)
    warm = warm.loaded(learner.state_dict(include_buffer=False), learner.info(include_buffer=False), warm_start=True)
    assert warm.trusted and warm.steps == 0 and len(warm.buffer) == 0
    assert not warm.added(
        *_rows(8, 5)
    ).can_fit  # without a buffer the loaded fit is kept until warmup_steps steps of new rows


def test_a_buffer_saved_as_n_by_d_loads_as_one_slice():
    learner = OnlineLearner(ValueProbe(alpha=1.0), capacity=16)
    x, y = _rows(4, 3)
    learner = learner.loaded({"buffer.features": x[:, 0], "buffer.targets": y}, {"steps": 1})
    assert learner.buffer.features.shape == (4, 1, 4) and torch.equal(learner.buffer.features, x)


def test_one_learner_class_serves_both_granularities():
    estimator = POISEEstimator(2, EstimatorSpec(granularity=GranularitySpec("prefix")))
    estimator.observe(features=torch.randn(4, 3), rollouts=Rollouts(torch.rand(4)))
    assert all(type(online) is OnlineLearner for online in estimator.probes_.values())
    assert [type(learner) for learner in estimator.token_baseline_.learners] == [OnlineLearner]
    assert POISEEstimator(2).token_baseline_.learners == ()

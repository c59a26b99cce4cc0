"""`POISEEstimator` with plain tensors: its contract (advantages from earlier observations only, observe the one
learner), the sampler's prompt values and draws on resume, and one device->host transfer per step."""

import json
import shutil
from dataclasses import is_dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from poise_trl import sampling
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.specs import BufferSpec, EstimatorSpec, HeadSpec, LayerSpec, PromptSpec
from poise_trl.features.columns import DEFAULT_SCALARS

from .host_sync import HostSyncCounter

LEGACY = Path(__file__).parent / "fixtures" / "legacy"
G = 2
SPEC = EstimatorSpec(head=HeadSpec(alpha=1.0), buffer=BufferSpec(warmup_steps=1))
"""The tests' estimator: ridge alpha 1, trusted after one observed step."""


def spec(base: EstimatorSpec = SPEC, **changes) -> EstimatorSpec:
    """`base` with `changes`: a field, or a part's fields as a dict (`head={"name": "mlp"}`)."""
    parts = {
        key: replace(getattr(base, key), **value)
        if isinstance(value, dict) and is_dataclass(getattr(base, key))
        else value
        for key, value in changes.items()
    }
    return replace(base, **parts)


def _batch(step: int, n: int = 16, width: int = 6, domains: bool = False, rewards: tuple = (0.0, 1.0)):
    """Features whose first column predicts the reward, binary rewards, prompt ids and (optionally) two domains."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, width, generator=g)
    low, high = rewards
    r = torch.where(torch.rand(n, generator=g) < torch.sigmoid(2 * x[:, 0]), high, low)
    groups = torch.arange(n) // G + 100 * step
    names = [["math", "code"][(i // G) % 2] for i in range(n)] if domains else None
    return x, r, groups, names


def _observe(estimator: POISEEstimator, step: int, domains: bool = False, **batch) -> None:
    """`estimator` learns from `_batch(step)` handed as features and record (no advantages taken)."""
    x, r, groups, names = _batch(step, domains=domains, **batch)
    estimator.observe(features=x, rollouts=Rollouts(r, domains=names, prompt_ids=groups))


def _trained(steps: int = 4, settings: EstimatorSpec = SPEC, domains: bool = False) -> POISEEstimator:
    estimator = POISEEstimator(G, settings)
    for step in range(steps):
        x, r, _, names = _batch(step, domains=domains)
        estimator.advantages(x, Rollouts(r, domains=names))
        _observe(estimator, step, domains)
    return estimator


def test_advantages_use_only_earlier_observations():
    estimator = _trained()
    x, r, _, _ = _batch(10)
    first = estimator.advantages(x, Rollouts(r))
    again = estimator.advantages(x, Rollouts(r))
    assert torch.equal(first.advantages, again.advantages)  # advantages learn nothing
    assert first.metrics()["bootstrap"] == 0.0 and torch.isfinite(first.baselines).all()
    estimator.observe(features=x, rollouts=Rollouts(r))
    assert not torch.equal(estimator.advantages(x, Rollouts(r)).advantages, first.advantages)  # observe does


def test_predict_and_advantages_change_nothing_and_observe_reuses_the_handed_batch():
    estimator = _trained()
    before = estimator.state_dict()
    x, r, groups, _ = _batch(11)
    values = estimator.predict(x, Rollouts(r))
    result = estimator.advantages(x, Rollouts(r))
    assert torch.equal(values, result.values) and values.isfinite().all()
    after = estimator.state_dict()
    assert before["info"] == after["info"]
    assert all(torch.equal(tensor, after["tensors"][key]) for key, tensor in before["tensors"].items())
    handed, fresh = _trained(), _trained()
    handed.observe(handed.advantages(x, Rollouts(r, prompt_ids=groups)))
    fresh.observe(features=x, rollouts=Rollouts(r, prompt_ids=groups))  # the same learning, the batch prepared again
    assert torch.equal(
        handed.probes_["default"].probe.state_dict()["coef"], fresh.probes_["default"].probe.state_dict()["coef"]
    )
    with pytest.raises(ValueError, match="not both"):
        handed.observe(result, features=x, rollouts=Rollouts(r))
    with pytest.raises(ValueError, match="observe needs `result`"):
        handed.observe(features=x)


def test_the_random_selection_stream_resumes_where_the_checkpoint_left_it(tmp_path):
    """Random draws are seeded by (seed, rank, observed steps), and the step count travels in the estimator's file."""

    def choice(estimator: POISEEstimator) -> list[int]:
        drawn = sampling.draw(sampling.HighestVariance(), 10, 4, seed=7, rank=0, step=estimator.steps_).indices
        _observe(estimator, estimator.steps_)
        return drawn

    never_trusted = spec(EstimatorSpec(), buffer={"warmup_steps": 100})
    estimator = POISEEstimator(G, never_trusted)
    uninterrupted = [choice(estimator) for _ in range(5)]
    first = POISEEstimator(G, never_trusted)
    [choice(first) for _ in range(2)]
    first.save(tmp_path / "e.safetensors")
    resumed = POISEEstimator(G, never_trusted)
    resumed.load(tmp_path / "e.safetensors")
    assert [choice(resumed) for _ in range(3)] == uninterrupted[2:]
    assert len({tuple(c) for c in uninterrupted}) > 1


def test_a_resumed_estimator_draws_the_importance_samplers_prompts_and_weights_exactly(tmp_path):
    """Once the probe is trusted the importance rule draws from the estimator's prompt values; a resumed estimator
    predicts the same values bit for bit and sits at the same step, so it draws the same prompts and weights."""
    candidates = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))

    def choice(estimator: POISEEstimator) -> sampling.Draw:
        values = estimator.prompt_values(candidates)
        reward_range = None if values is None else estimator.target_range()
        rule = sampling.Importance()
        drawn = sampling.draw(rule, 10, 4, values, reward_range, seed=7, rank=0, step=estimator.steps_)
        _observe(estimator, estimator.steps_)
        return drawn

    def estimator() -> POISEEstimator:
        return POISEEstimator(G, spec(buffer={"warmup_steps": 2}, prompt=PromptSpec((0, 6))))

    full = estimator()
    uninterrupted = [choice(full) for _ in range(6)]
    assert uninterrupted[0].weights is None and all(d.weights for d in uninterrupted[3:])  # uniform, then weighted
    first = estimator()
    [choice(first) for _ in range(3)]
    first.save(tmp_path / "e.safetensors")
    resumed = estimator()
    resumed.load(tmp_path / "e.safetensors")
    assert [choice(resumed) for _ in range(3)] == uninterrupted[3:]


@pytest.mark.parametrize(("low", "high"), [(0.0, 1.0), (-1.0, 1.0), (0.5, 1.5)])
def test_selection_scores_the_reward_variance_on_the_observed_reward_range(low, high):
    """q(1 - q) with q the predicted value mapped from the observed [low, high] to [0, 1]: with ±1 rewards a
    prompt predicted at 0 (50% success) scores highest, not one at 0.5 (75% success) as p(1 - p) would say."""
    estimator = POISEEstimator(G, spec(prompt=PromptSpec((0, 6))))
    for step in range(3):
        _observe(estimator, step, rewards=(low, high))
    values = torch.tensor([low, low + 0.5 * (high - low), low + 0.75 * (high - low), high])
    scores = sampling.reward_variance(values, *estimator.target_range())
    torch.testing.assert_close(scores, torch.tensor([0.0, 0.25, 0.1875, 0.0], dtype=torch.float64))


def test_selection_waits_for_a_trusted_probe_and_a_warm_start_is_trusted(tmp_path):
    slow = spec(buffer={"warmup_steps": 5}, prompt=PromptSpec((0, 6)))
    cold = POISEEstimator(G, slow)
    _observe(cold, 0)
    assert not cold.trusted_ and cold.prompt_values(torch.zeros(3, 6)) is None
    _trained(3, spec(prompt=PromptSpec((0, 6)))).save(tmp_path / "e.safetensors")
    warm = POISEEstimator(G, slow)
    warm.load(tmp_path / "e.safetensors", warm_start=True)
    assert warm.trusted_ and warm.prompt_values(torch.zeros(3, 6)).shape == (3,)


def test_one_host_transfer_per_step():
    """`advantages`, `observe` and reading the metrics and logged rows cost one device->host transfer together."""
    estimator = POISEEstimator(G, spec(scale_rewards="batch"))
    counter = HostSyncCounter()
    for step in range(5):
        x, r, groups, _ = _batch(step)
        r[0] = float("nan")
        x[3] = float("inf")
        counter.count, counter.calls = 0, []
        with counter:
            result = estimator.advantages(x, Rollouts(r, prompt_ids=groups))
            estimator.observe(result)
            result.metrics()
            result.logged_rows()
        assert counter.count == 1, (step, counter.calls)


# ------------------------------------------------------------------------------------------------ poise-trl 0.1
def _legacy_estimator() -> POISEEstimator:
    """Configured as tests/fixtures/legacy/make_legacy.py's run (its probe file's settings)."""
    info = json.loads((LEGACY / "probe.safetensors.json").read_text())
    settings = spec(head={"alpha": 100.0, "pca_dims": [(0, 16, 16), (16, 32, 16)]}, layers=LayerSpec(ids=(1,)))
    features = {**info["feature_config"], "probe_domain_column": None, "probe_scalars": list(DEFAULT_SCALARS)}
    return POISEEstimator(G, settings, feature_config=features)


def test_the_trainer_resumes_a_0_1_checkpoint_and_warns_without_one(tmp_path):
    from poise_trl import POISETrainer
    from poise_trl.tiny import save_tiny

    from .conftest import digit_dataset, digit_reward, short_args

    model = save_tiny(tmp_path / "model", num_layers=2, hidden_size=16, seed=0)
    trainer = POISETrainer(str(model), digit_reward, args=short_args(tmp_path), train_dataset=digit_dataset())
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(LEGACY / "checkpoint", checkpoint)
    trainer._load_optimizer_and_scheduler(str(checkpoint))
    expected = load_file(str(LEGACY / "expected.safetensors"))
    assert torch.equal(trainer.estimator.probes_["default"].predict(expected["inputs"]), expected["predictions"])
    assert trainer.estimator.steps_ == 3 and len(trainer.estimator.bootstrap_pairs_["default"]) == 12

    empty = tmp_path / "checkpoint-9"
    empty.mkdir()
    with pytest.warns(UserWarning, match="checkpoint-9.*holds no POISE state"):
        trainer._load_optimizer_and_scheduler(str(empty))

"""The POISE authors' reference tests (verl-project/verl-recipe, `poise/tests/test_probe.py`), restated through this
project's API: `POISEEstimator.from_config(POISEConfig(probe_preset="reference", ...))` in the place of the reference's
`ProbeBank(ProbeConfig(...))`, `advantages` + `observe` in the place of `advantages` + `commit`.

Two differences of API, not of behaviour: a batch's rollouts of one prompt are consecutive rows here (the reference
finds them by prompt id), and `advantages` changes nothing, so a second call without `observe` is the same call (the
reference refuses it); the reference's "steps differ" check on resume is the trainer's, whose checkpoint holds the
estimator's file with its own step count."""

import copy

import numpy as np
import pytest
import torch

from poise_trl.estimator.domains import ROUTINGS
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.heads.heads import make_head

from .test_probe_steps import reference_config

WIDTH = 6  # the reference tests' feature width: prompt 6, reasoning 6, 3 scalars
PAIRS = ((0, 2), (1, 3))  # the reference's rows of one prompt (uids 0, 1, 0, 1): consecutive rows here


def _estimator(**overrides) -> POISEEstimator:
    """The reference tests' bank: PCA 2 and 3, a math buffer of 12 rows (routed from the data source names)."""
    settings = {"probe_pca_dims": [2, 3], "probe_domain_column": "source", "probe_domain_buffer_sizes": {"math": 12}}
    return POISEEstimator.from_config(reference_config(**{**settings, **overrides}), num_layers=2, hidden_size=WIDTH)


def _batch(step: int = 0, domains: tuple[str, ...] = ("math",) * 4) -> tuple[torch.Tensor, Rollouts]:
    """The reference's `batch(step)`, its rows in prompt order: features from the step's seed, rewards [1, 0, 0, 1]
    as the reference's pairs (0, 2) and (1, 3) hold them; `domains` in the reference's row order."""
    rng = np.random.default_rng(step)
    prompt, response, scalars = rng.normal(size=(4, 6)), rng.normal(size=(4, 6)), rng.random((4, 3))
    order = [row for pair in PAIRS for row in pair]
    rows = torch.from_numpy(np.concatenate([prompt, response, scalars], axis=1)[order]).float()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])[order]
    return rows, Rollouts(rewards, domains=[domains[i] for i in order])


def _step(estimator: POISEEstimator, step: int, **batch) -> tuple[torch.Tensor, dict[str, float]]:
    result = estimator.advantages(*_batch(step, **batch))
    metrics = result.metrics()
    learned = estimator.observe(result)
    learned.pop("probe_fit_seconds")  # a time
    return result.advantages, {**metrics, **learned}


def test_bootstrap_transition_and_sibling_baseline():
    estimator = _estimator()
    for step in range(16):
        rows, rollouts = _batch(step)
        result = estimator.advantages(rows, rollouts)
        assert torch.equal(result.advantages, torch.tensor([1.0, -1.0, -1.0, 1.0]))  # r_i - r_partner, exactly
        assert result.metrics()["bootstrap"] == 1
        assert not estimator.probes_ or not estimator.probes_["math"].probe.is_fitted  # no probe before the end
        estimator.observe(result)
        assert len(estimator.probes_["math"].buffer) <= 12
    rows, rollouts = _batch(16)
    predictions = estimator.predict(rows, rollouts)  # the math probe fitted at the end of the bootstrap
    result = estimator.advantages(rows, rollouts)
    torch.testing.assert_close(result.advantages, rollouts.rewards - predictions[[1, 0, 3, 2]], atol=1e-6, rtol=0)
    assert result.metrics()["bootstrap"] == 0
    old_probe = estimator.probes_["math"].probe
    assert estimator.steps_ == 16
    estimator.observe(result)
    assert estimator.probes_["math"].probe is not old_probe  # refitted after the step that held math
    assert estimator.steps_ == 17


@pytest.mark.parametrize("checkpoint_step", [8, 15, 16, 17])
def test_resume_matches_uninterrupted(tmp_path, checkpoint_step):
    original = _estimator()
    for step in range(checkpoint_step):
        _step(original, step)
    path = tmp_path / "poise.safetensors"
    original.save(path)
    restored = POISEEstimator.from_file(path)
    for step in range(checkpoint_step, 19):
        a, ma = _step(original, step)
        b, mb = _step(restored, step)
        assert torch.equal(a, b)
        np.testing.assert_equal(ma, mb)  # NaN where undefined, as in both
    with pytest.raises(ValueError, match="probe_warmup_steps=16, but this run sets probe_warmup_steps=8"):
        _estimator(probe_warmup_steps=8).load(path)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"probe_schedule": "domain"}, "probe_schedule='global', but this run sets probe_schedule='domain'"),
        ({"probe_buffer_whole_groups": False, "probe_same_domain_groups": False}, "probe_buffer_whole_groups=True"),
        ({"probe_domain_warmup_steps": 4}, "probe_domain_warmup_steps=8, but this run sets probe_domain_warmup_steps"),
        ({"probe_domain_routing": "identity"}, "probe_domain_routing='reference', but"),
        ({"probe_reward_range": [0.0, 2.0]}, r"probe_reward_range=\(0.0, 1.0\), but this run sets"),
    ],
)
def test_a_file_written_with_other_settings_is_refused_on_resume_and_taken_by_a_warm_start(tmp_path, setting, named):
    saved = _estimator(probe_warmup_steps=2)
    for step in range(3):
        _step(saved, step)
    saved.save(tmp_path / "poise.safetensors")
    other = _estimator(probe_warmup_steps=2, **setting)
    with pytest.raises(ValueError, match=named):
        other.load(tmp_path / "poise.safetensors")
    other.load(tmp_path / "poise.safetensors", warm_start=True)  # a new run may start from its fitted probe
    assert other.trusted_


def test_advantages_change_nothing_before_observe():
    estimator = _estimator()
    first = estimator.advantages(*_batch())
    assert estimator.steps_ == 0 and not estimator.probes_
    assert torch.equal(estimator.advantages(*_batch()).advantages, first.advantages)


def test_pair_targets_and_independent_domain_fifo():
    """Buffers of whole pairs per domain (math 5 rows: 2 pairs; code 4 rows: 2 pairs), the oldest pair leaving
    first; each domain's observed-step count set to the training step at the end of a 2-step bootstrap."""
    estimator = _estimator(probe_warmup_steps=2, probe_domain_buffer_sizes={"math": 5, "code": 4})
    _step(estimator, 0, domains=("math", "codegen__taco", "math", "codegen__taco"))
    assert estimator.probes_["math"].buffer.targets.tolist() == [0, 1]  # the partner's reward
    for step in [1, 2, 3]:
        _step(estimator, step)
    math, code = estimator.probes_["math"], estimator.probes_["code"]
    assert len(math.buffer) == 4 and len(code.buffer) == 2
    newest, _ = _batch(3)  # math holds step 3's two pairs, whole: the older pairs left together
    assert torch.equal(math.buffer.features[:, 0], newest)
    assert {name: online.steps for name, online in estimator.probes_.items()} == {"math": 4, "code": 2}


def test_reordering_and_own_rollout_independence():
    estimator = _estimator(probe_warmup_steps=1)
    _step(estimator, 0)
    rows, rollouts = _batch(1)
    first = estimator.advantages(rows, rollouts).advantages
    moved = rows.clone()
    moved[0, WIDTH : 2 * WIDTH] += 100  # rollout 0's own reasoning block
    second = estimator.advantages(moved, rollouts).advantages
    assert first[0] == second[0]  # rollout 0's own features cannot affect its baseline
    assert first[1] != second[1]  # they are its partner's


@pytest.mark.parametrize("rows", [1, 3])
def test_invalid_pairs(rows):
    estimator = _estimator()
    with pytest.raises(ValueError, match="whole groups of 2"):
        estimator.advantages(torch.zeros(rows, 2 * WIDTH + 3), Rollouts(torch.zeros(rows), domains=["math"] * rows))


def test_two_rollouts_per_prompt_and_siblings_of_one_domain():
    with pytest.raises(ValueError, match="num_generations=4 with probe_preset='reference', which needs"):
        reference_config(num_generations=4)
    estimator = _estimator(probe_domain_buffer_sizes={"math": 12, "code": 12})
    with pytest.raises(ValueError, match=r"fall in the domains \['math', 'code'\]"):
        estimator.advantages(*_batch(domains=("math", "math", "codegen", "codegen")))  # pairs (0, 2), (1, 3)


def test_unseen_domain_fails_at_bootstrap_transition():
    estimator = _estimator(probe_warmup_steps=1, probe_domain_buffer_sizes={"math": 12, "code": 12})
    result = estimator.advantages(*_batch())
    with pytest.raises(ValueError, match=r"fewer than two rows to the domains \['code'\]"):
        estimator.observe(result)
    assert estimator.steps_ == 0 and not estimator.probes_  # nothing learned from the refused step


def test_a_domain_outside_the_configured_ones_is_refused():
    with pytest.raises(ValueError, match=r"holds the domains \['other'\], which domain_sizes"):
        _estimator().advantages(*_batch(domains=("stem_web",) * 4))


def test_rewards_outside_0_1_are_refused():
    rows, rollouts = _batch()
    with pytest.raises(ValueError, match=r"lie outside reward_range \[0, 1\]"):
        _estimator().advantages(rows, Rollouts(rollouts.rewards * 2, domains=rollouts.domains))


@pytest.mark.parametrize(
    ("source", "expected"),
    [("math__aime", "math"), ("codegen__taco", "code"), ("stem_web", "other"), ("openai/gsm8k", "math")],
)
def test_domain_routing(source, expected):
    assert ROUTINGS["reference"](source) == expected
    estimator = _estimator(probe_domain_buffer_sizes={expected: 12})
    _step(estimator, 0, domains=(source,) * 4)
    assert list(estimator.probes_) == [expected]


def test_probe_learns_signal_and_refits():
    rng = np.random.default_rng(5)
    prompt, response = (rng.normal(size=(192, 2)).astype(np.float32) for _ in range(2))
    scalars = rng.random((192, 3), dtype=np.float32)
    targets = 0.2 + 0.6 * scalars[:, 0]
    x, y = torch.from_numpy(np.concatenate([prompt, response, scalars], axis=1)), torch.from_numpy(targets)
    probe = make_head("pca_ridge", alpha=0.01, pca_dims=[(0, 2, 2), (2, 4, 2)], clip=(0.0, 1.0))
    probe.fit(x[:128], y[:128])
    constant_mse = ((y[:128].mean() - y[128:]) ** 2).mean()
    assert ((probe.predict(x[128:]) - y[128:]) ** 2).mean() < 0.01 * constant_mse
    weights = probe.affine()[0].clone()
    refitted = copy.deepcopy(probe).fit(x[:128], 1.0 - y[:128])
    assert ((refitted.predict(x[128:]) - (1.0 - y[128:])) ** 2).mean() < 0.01 * constant_mse
    assert not torch.allclose(weights, refitted.affine()[0])


def test_the_file_names_the_preset_and_the_settings_changed_from_it(tmp_path):
    estimator = _estimator(probe_alpha=10.0)
    _step(estimator, 0)
    estimator.save(tmp_path / "poise.safetensors")
    changed = {"probe_alpha": 10.0, "probe_pca_dims": [2, 3], "probe_domain_buffer_sizes": {"math": 12}}
    assert estimator.state_dict()["info"]["preset"] == {"name": "reference", "changed": changed}
    assert POISEEstimator.from_file(tmp_path / "poise.safetensors").preset == {"name": "reference", "changed": changed}

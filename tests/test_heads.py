"""The value-head table: every entry satisfies the head interface, is built from a run's probe settings and its own
(read from its constructor), survives settled buffers, round-trips exactly through its state and a learner's, and a
saved head is rebuilt by name."""

import re

import pytest
import torch

from poise_trl.estimator.learner import OnlineLearner
from poise_trl.estimator.specs import HeadSpec
from poise_trl.heads.heads import HEADS, head_from_config, make_head, own_settings
from poise_trl.heads.interface import ValueHead
from poise_trl.heads.probe import ValueProbe

SETTINGS = {"alpha": 3.0, "pca_dims": [(0, 4, 2)], "clip": "observed"}  # what the estimator builds every head with


def _rows(n: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + torch.randn(n, generator=g) > 0).float()


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_has_the_interface_its_name_and_saves_its_own_settings(name):
    """Its own settings (its constructor's keywords beside the shared ones) are in its config, so a file rebuilds
    them; a setting it does not take is refused, naming its own; the estimator's spec takes it by name."""
    head = HEADS[name]
    assert head.name == name and isinstance(head(), ValueHead) and isinstance(head(**SETTINGS), ValueHead)
    own = own_settings(name)
    assert set(own) <= set(make_head(name, **SETTINGS).config())
    with pytest.raises(ValueError, match=f"The value head {name!r} has no setting bogus: its own settings are"):
        make_head(name, bogus=7)
    assert HeadSpec(name).build(None).name == name


def test_the_mlps_own_settings_reach_it_and_the_ridge_has_none():
    assert own_settings("mlp") == ["hidden", "iterations", "learning_rate", "seed"] and own_settings("ridge") == []
    assert make_head("mlp", **SETTINGS, hidden=7).hidden == 7
    with pytest.raises(ValueError, match="The value head 'ridge' has no setting hidden: its own settings are none"):
        make_head("ridge", hidden=7)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_head_is_rebuilt_from_its_name_and_config_and_predicts_as_saved(name):
    x, y = _rows()
    head = HEADS[name](**SETTINGS).fit(x, y)
    rebuilt = head_from_config(head.config(), name)
    assert not rebuilt.is_fitted and rebuilt.config() == head.config()
    rebuilt.load_state_dict(head.state_dict())
    assert torch.equal(rebuilt.predict(x), head.predict(x))
    assert all(isinstance(v, torch.Tensor) for v in head.state_dict().values())
    assert not head.clone().is_fitted and head.clone().config() == head.config()


@pytest.mark.parametrize("name", sorted(HEADS))
def test_map_state_replaces_every_fitted_tensor(name):
    """The broadcast from rank 0: every tensor passes through the function, and the head predicts from the result."""
    x, y = _rows()
    head, other = HEADS[name](**SETTINGS).fit(x, y), HEADS[name](**SETTINGS).fit(*_rows(seed=1))
    source = iter([other.state_dict()[key] for key in sorted(other.state_dict())] if name != "ensemble" else [])
    if name == "ensemble":  # part by part: children, then its own clip range
        parts = [child.state_dict() for child in other.children]
        source = iter([part[key] for part in parts for key in sorted(part)] + [other.state_dict()["clip"]])
    head.map_state(lambda tensor: next(source))
    assert torch.equal(head.predict(x), other.predict(x))


@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize("value", [0.0, 1.0])
def test_a_settled_buffer_gives_finite_values_at_its_reward(name, value):
    """Every prompt failed (or solved): no divergence, no NaN, and the clipped value is exactly the reward."""
    x, _ = _rows()
    head = HEADS[name](**SETTINGS).fit(x, torch.full((40,), value))
    clipped, raw = head.predict(torch.cat([x, 10 * x]), return_unclipped=True)
    assert raw.isfinite().all() and torch.equal(clipped, torch.full((80,), value))


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_learner_persists_its_head_exactly(name):
    """OnlineLearner's state and info hold the head's name and settings: a learner rebuilt from them resumes exactly,
    and its next refit is the uninterrupted learner's."""
    learner = OnlineLearner(HEADS[name](**SETTINGS), capacity=64, warmup_steps=1)
    for seed in range(2):
        x, y = _rows(16, seed)
        learner = learner.added(x.unsqueeze(1), y)
    learner = learner.fitted()
    state, info = learner.state_dict(), learner.info()
    assert info["head"] == name
    resumed = OnlineLearner(head_from_config(info["probe"], info["head"]), capacity=64, warmup_steps=1)
    resumed = resumed.loaded(state, info)
    x, y = _rows(16, 5)
    assert resumed.trusted and torch.equal(resumed.predict(x.unsqueeze(1)), learner.predict(x.unsqueeze(1)))
    learner, resumed = (online.added(x.unsqueeze(1), y).fitted() for online in (learner, resumed))
    assert torch.equal(resumed.predict(x.unsqueeze(1)), learner.predict(x.unsqueeze(1)))


def test_files_without_a_head_name_hold_ridge_and_unknown_names_are_refused():
    assert isinstance(head_from_config(ValueProbe(alpha=3.0).config()), ValueProbe)
    with pytest.raises(ValueError, match=re.escape(f"Unknown value head 'forest': choose one of {sorted(HEADS)}")):
        head_from_config({}, "forest")

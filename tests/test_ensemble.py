"""EnsembleProbe: the mean of its children, a ridge stacker on out-of-fold predictions, its config and refusals."""

import pytest
import torch

from poise_trl.heads.ensemble import EnsembleProbe
from poise_trl.heads.heads import HEADS, head_from_config, make_head
from poise_trl.heads.logistic import LogisticProbe
from poise_trl.heads.mlp import MLPProbe
from poise_trl.heads.probe import ValueProbe


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + x[:, 1] ** 2 + torch.randn(n, generator=g) > 1).float()


def test_mean_is_the_mean_of_the_children_fitted_alone():
    x, y = _data(120)
    ensemble = make_head("ensemble", alpha=2.0, pca_dims=3, children=("ridge", "logistic", "mlp")).fit(x, y)
    alone = [HEADS[name](alpha=2.0, pca_dims=3).fit(x, y) for name in ("ridge", "logistic", "mlp")]
    expected = torch.stack([head.predict(x) for head in alone]).double().mean(0).float()
    torch.testing.assert_close(ensemble.predict(x), expected, atol=1e-7, rtol=0)


def test_stack_is_a_ridge_on_out_of_fold_predictions_of_contiguous_folds():
    x, y = _data(30)
    ensemble = EnsembleProbe(combine="stack", folds=3, stack_alpha=0.5).fit(x, y)  # ridge and logistic
    held_out = torch.empty(30, 2, dtype=torch.float64)
    for fold in range(3):
        test = torch.arange(10 * fold, 10 * fold + 10)
        train = torch.tensor([i for i in range(30) if not 10 * fold <= i < 10 * fold + 10])
        for c, name in enumerate(("ridge", "logistic")):
            held_out[test, c] = HEADS[name]().fit(x[train], y[train]).predict(x[test]).double()
    stacker = ValueProbe(alpha=0.5, clip=None).fit(held_out, y)
    children = torch.stack([ensemble.children[c].predict(x) for c in range(2)], 1).double()
    assert torch.equal(ensemble.stacker.state_dict()["coef"], stacker.state_dict()["coef"])
    torch.testing.assert_close(ensemble.predict(x), stacker.predict(children).clamp(0, 1), atol=1e-7, rtol=0)


def test_too_few_rows_to_hold_out_stack_in_sample():
    x, y = _data(3)
    y[0], y[1] = 0.0, 1.0
    assert EnsembleProbe(combine="stack").fit(x, y).predict(x).isfinite().all()


def test_children_given_as_heads_keep_their_settings_through_the_config():
    ensemble = make_head("ensemble", alpha=5.0, children=["ridge", MLPProbe(alpha=0.1, hidden=8)], combine="stack")
    rebuilt = head_from_config(ensemble.config(), "ensemble")
    assert rebuilt.config() == ensemble.config() and ensemble.clone().config() == ensemble.config()
    assert [(c.name, c.alpha) for c in rebuilt.children] == [("ridge", 5.0), ("mlp", 0.1)]
    assert rebuilt.children[1].hidden == 8
    default = EnsembleProbe(alpha=5.0)
    assert [(type(c), c.alpha) for c in default.children] == [(ValueProbe, 5.0), (LogisticProbe, 5.0)]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"children": ()}, "at least one child"),
        ({"children": ("ridge", "forest")}, r"Unknown child heads \['forest'\]"),
        ({"width": 3}, r"The value head 'ensemble' has no setting width: its own settings are children, combine"),
        ({"combine": "vote"}, r"combine='vote': choose one of \['mean', 'stack'\]"),
        ({"folds": 1}, "folds=1 must be"),
        ({"stack_alpha": 0.0}, "alpha=0.0 must be > 0"),
        ({"clip": "seen"}, "clip='seen'"),
    ],
)
def test_bad_settings_are_refused(setting, message):
    with pytest.raises(ValueError, match=message):
        make_head("ensemble", **setting)

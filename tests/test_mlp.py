"""MLPProbe against scikit-learn's MLPRegressor (same loss, initialisation and Adam), deterministic fits and its
settings."""

import pytest
import torch
from sklearn.metrics import r2_score
from sklearn.neural_network import MLPRegressor
from sklearn.preprocessing import StandardScaler

from poise_trl.heads.mlp import MLPProbe
from poise_trl.heads.probe import ValueProbe


def _curve(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth function a linear head cannot fit (ridge's held-out R^2 is about 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    return x, torch.sin(2 * x[:, 0]) + x[:, 1] ** 2 / 2 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)


def test_learns_what_sklearn_mlp_regressor_learns_on_held_out_rows():
    """Same architecture, loss, alpha and 1000 full-batch Adam steps; the weights differ (another random draw), so
    the held-out R^2 is compared: both above 0.85, within 0.03 of each other (measured: 0.936 and 0.933)."""
    x, y = _curve(800)
    x_test, y_test = _curve(400, seed=1)
    ours = r2_score(y_test, MLPProbe(alpha=1.0, clip=None).fit(x, y).predict(x_test).double())
    scaler = StandardScaler().fit(x.numpy())
    reference = MLPRegressor(
        hidden_layer_sizes=(64,),
        alpha=1.0,
        batch_size=800,
        learning_rate_init=1e-3,
        max_iter=1000,
        tol=0.0,
        n_iter_no_change=10**9,
        shuffle=False,
        random_state=0,
    ).fit(scaler.transform(x.numpy()), y.numpy())
    theirs = r2_score(y_test, reference.predict(scaler.transform(x_test.numpy())))
    linear = r2_score(y_test, ValueProbe(alpha=1.0, clip=None).fit(x, y).predict(x_test).double())
    assert ours > 0.85 and theirs > 0.85 and abs(ours - theirs) < 0.03 and linear < 0.2


def test_fits_are_deterministic_and_the_seed_is_a_setting():
    x, y = _curve(100)
    first, second = MLPProbe(iterations=50).fit(x, y), MLPProbe(iterations=50).fit(x, y)
    assert all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )
    assert not torch.equal(first.predict(x), MLPProbe(iterations=50, seed=1).fit(x, y).predict(x))
    assert MLPProbe.from_config(MLPProbe(hidden=8, seed=3).config()).config() == MLPProbe(hidden=8, seed=3).config()


def test_fits_on_inference_tensors_under_inference_mode():
    x, y = _curve(40)
    with torch.inference_mode():
        values = MLPProbe(iterations=20).fit(x.clone(), y.clone()).predict(x.clone())
    assert values.isfinite().all()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"hidden": 0}, "hidden=0 must be an int >= 1"),
        ({"iterations": 2.5}, "iterations=2.5 must be an int"),
        ({"learning_rate": 0.0}, "learning_rate=0.0 must be > 0"),
        ({"alpha": -1.0}, "alpha=-1.0 must be > 0"),
    ],
)
def test_bad_settings_are_refused(setting, message):
    with pytest.raises(ValueError, match=message):
        MLPProbe(**setting)

"""LogisticProbe (sigmoid-BCE) against scikit-learn's LogisticRegression, its link on other reward ranges, and its
Newton solver in the primal and the dual."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from poise_trl.heads import logistic
from poise_trl.heads.logistic import LogisticProbe


def _data(n: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.5, 3.0, d, dtype=torch.float64) + 1
    y = (x[:, 0] + 0.5 * x[:, 1] + torch.randn(n, generator=g, dtype=torch.float64) > 1.5).double()
    return x, y


@pytest.mark.parametrize(
    ("n", "d", "alpha"),
    [(300, 8, 1.0), (500, 30, 100.0), (300, 8, 0.01), (60, 200, 1.0), (120, 400, 0.01)],  # last two: the dual
)
def test_matches_sklearn_logistic_regression_with_c_one_over_alpha(n, d, alpha, monkeypatch):
    """Same standardized design, 0/1 targets. With the target clamp made negligible the solver lands on sklearn's
    optimum: probabilities within 1e-5, coefficients within 1e-5 of the largest. The default clamp to
    [1e-6, 1 - 1e-6] moves held-out probabilities by up to 2e-3 (the separable 120 x 400 case at alpha 0.01)."""
    x, y = _data(n, d)
    x_new, _ = _data(80, d, seed=1)
    scaler = StandardScaler().fit(x.numpy())
    reference = LogisticRegression(C=1 / alpha, tol=1e-12, max_iter=100_000).fit(scaler.transform(x.numpy()), y)
    theirs = [reference.predict_proba(scaler.transform(points.numpy()))[:, 1] for points in (x, x_new)]
    default = LogisticProbe(alpha=alpha, clip=None).fit(x, y)
    for points, expected in zip((x, x_new), theirs, strict=True):
        assert np.abs(default.predict(points).double().numpy() - expected).max() < 2e-3
    monkeypatch.setattr(logistic, "EPS", 1e-12)
    head = LogisticProbe(alpha=alpha, clip=None).fit(x, y)
    for points, expected in zip((x, x_new), theirs, strict=True):
        assert np.abs(head.predict(points).double().numpy() - expected).max() < 1e-5
    coef = head.state_dict()["coef"].numpy()
    assert np.abs(coef - reference.coef_[0]).max() < 1e-5 * max(1.0, np.abs(reference.coef_[0]).max())


def test_the_link_spans_the_reward_range_observed_or_given():
    """Rewards in [-1, 1] fit as the same logistic problem on (y + 1) / 2; a fixed clip range is the link's range."""
    x, y = _data(200, 6)
    y = torch.where(torch.arange(200) % 7 == 0, 0.5, y)  # fractional targets: soft labels
    unit = LogisticProbe(alpha=1.0).fit(x, y).predict(x).double()
    signed = LogisticProbe(alpha=1.0).fit(x, 2 * y - 1).predict(x).double()
    torch.testing.assert_close(signed, 2 * unit - 1, atol=1e-6, rtol=0)
    wide = LogisticProbe(alpha=1.0, clip=(0.0, 2.0)).fit(x, 2 * y).predict(x, return_unclipped=True)[1].double()
    torch.testing.assert_close(wide, 2 * unit, atol=1e-6, rtol=0)


def test_settled_buffers_reach_the_ends_with_a_bounded_intercept():
    x, _ = _data(50, 4)
    for value in (0.0, 1.0):
        head = LogisticProbe(alpha=0.01).fit(x, torch.full((50,), value))
        assert torch.equal(head.predict(x), torch.full((50,), value))
        assert head.state_dict()["intercept"].abs().item() < 14  # logit(1e-6) = -13.8, not a divergent one


def test_fits_on_inference_tensors_under_inference_mode():
    x, y = _data(40, 5)
    with torch.inference_mode():
        values = LogisticProbe(alpha=1.0).fit(x.clone(), y.clone()).predict(x.clone())
    assert values.isfinite().all()

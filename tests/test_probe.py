"""ValueProbe (the ridge head) against sklearn, clipping and safe files."""

import numpy as np
import pytest
import torch
from sklearn.compose import ColumnTransformer
from sklearn.decomposition import PCA
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from poise_trl.heads.probe import ValueProbe, _principal_axes


def _data(n: int, d: int, rank: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        x = torch.randn(n, d, generator=g) * torch.rand(d, generator=g) * 4 + 2
    else:  # low rank, like hidden states that live in a small subspace
        x = torch.randn(n, rank, generator=g) @ torch.randn(rank, d, generator=g)
    x[:, 1] = 3.0  # a constant column: StandardScaler must not divide by zero
    y = (x[:, :4].sum(1) + torch.randn(n, generator=g) > x[:, :4].sum(1).median()).float()
    return x, y


def _relative_error(ours: torch.Tensor, reference: np.ndarray) -> float:
    return float(np.abs(ours.numpy() - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize(
    ("n", "d", "rank", "alpha"),
    [(300, 40, None, 1.0), (120, 400, None, 0.01), (200, 300, 8, 0.01), (500, 64, 5, 100.0)],
)
def test_matches_sklearn_scaler_ridge(n, d, rank, alpha):
    x, y = _data(n, d, rank)
    probe = ValueProbe(alpha=alpha, pca_dims=None, clip=None).fit(x, y)
    # sklearn in float64: in float32 it is itself off by ~2% on the ill-conditioned low-rank case (DESIGN §4).
    reference = make_pipeline(StandardScaler(), Ridge(alpha=alpha)).fit(x.double().numpy(), y.double().numpy())
    x_new, _ = _data(50, d, rank, seed=1)
    for points in (x, x_new):
        assert _relative_error(probe.predict(points), reference.predict(points.double().numpy())) < 1e-4


def test_per_block_pca_matches_sklearn_column_transformer():
    x, y = _data(250, 90, None)
    blocks = [(0, 40, 6), (40, 80, 10)]
    ours = ValueProbe(alpha=100.0, pca_dims=blocks, clip=None).fit(x, y)
    pca = ColumnTransformer(
        [("p", PCA(6, svd_solver="full"), list(range(40))), ("r", PCA(10, svd_solver="full"), list(range(40, 80)))],
        remainder="passthrough",
    )
    reference = make_pipeline(StandardScaler(), pca, Ridge(alpha=100.0)).fit(x.numpy(), y.numpy())
    assert _relative_error(ours.predict(x), reference.predict(x.numpy())) < 1e-4
    assert ours.fitted_pca_dims == [6, 10]


def _spectrum_block(rows: int, cols: int, decay: float) -> torch.Tensor:
    """A centred block whose singular values fall as i^-decay (0.1: nearly flat, 1.0: a power law)."""
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(rows, min(rows, cols), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(cols, min(rows, cols), generator=g, dtype=torch.float64))[0]
    x = (u * torch.arange(1, min(rows, cols) + 1, dtype=torch.float64) ** -decay) @ v.T
    return x - x.mean(0)


@pytest.mark.parametrize(
    ("rows", "cols", "k", "decay"),
    [(400, 800, 24, 0.1), (400, 800, 24, 1.0), (400, 800, 64, 0.1), (300, 200, 16, 0.1)],
    ids=["7-iterations-flat", "7-iterations-power-law", "4-iterations-flat", "exact"],
)
def test_pca_captures_the_subspace_sklearn_pca_does(rows, cols, k, decay):
    """Wide blocks (every real model) take sklearn's randomized solver with its power iterations: on a nearly flat
    spectrum (600 x 1024, k = 32) 4 iterations captured 0.67 of the top-k subspace where sklearn's 7 capture 0.83."""
    x = _spectrum_block(rows, cols, decay)
    exact = torch.linalg.svd(x, full_matrices=False)[2][:k]

    def captured(axes: torch.Tensor) -> float:
        return float((axes @ exact.T).pow(2).sum() / k)

    reference = captured(torch.from_numpy(PCA(k, random_state=0).fit(x.numpy()).components_))
    assert captured(_principal_axes(x, k)) == pytest.approx(reference, abs=0.02)


def test_pca_dims_are_capped_by_rows():
    x, y = _data(5, 30, None)
    probe = ValueProbe(alpha=1.0, pca_dims=[(0, 30, 20)]).fit(x, y)
    assert probe.fitted_pca_dims == [5]
    assert torch.isfinite(probe.predict(x)).all()


def test_clip_observed_follows_reward_range_and_explicit_clip():
    x, _ = _data(200, 10)
    y = x[:, 0] * 10  # far outside [0, 1]
    probe = ValueProbe(alpha=1e-3, clip="observed").fit(x, y)
    clipped, raw = probe.predict(x * 3, return_unclipped=True)
    assert clipped.min() >= y.min() - 1e-5 and clipped.max() <= y.max() + 1e-5
    assert (raw != clipped).any()
    fixed = ValueProbe(alpha=1e-3, clip=(0.0, 1.0)).fit(x, y).predict(x)
    assert fixed.min() >= 0 and fixed.max() <= 1


def test_constant_targets_and_constant_features_stay_finite():
    x = torch.ones(40, 6)
    y = torch.ones(40)
    probe = ValueProbe(alpha=0.01, pca_dims=[(0, 3, 2)]).fit(x, y)
    assert torch.allclose(probe.predict(torch.randn(4, 6)), torch.ones(4))


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="non-finite"):
        ValueProbe().fit(torch.tensor([[1.0], [float("nan")]]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="at least 2"):
        ValueProbe().fit(torch.ones(1, 3), torch.ones(1))
    with pytest.raises(RuntimeError, match="before fit"):
        ValueProbe().predict(torch.ones(1, 3))
    with pytest.raises(ValueError, match="alpha"):
        ValueProbe(alpha=0)

"""The value head `pca_ridge` is the POISE authors' reference probe: fitted on every row the reference's probe bank
fitted on, it predicts what the reference predicted (within 1e-5), at each of its refits and on a held-out batch; it
predicts as scikit-learn's pipeline predicts, folds into one affine map, keeps its previous fit when a fit is
interrupted, and says how to install scikit-learn where it is missing. The release head's distance from the
reference is measured here too."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.decomposition import PCA
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from poise_trl.estimator.specs import HeadSpec
from poise_trl.features.features import FeatureLayout
from poise_trl.heads.heads import make_head
from poise_trl.heads.pca_ridge import PCARidgeProbe
from poise_trl.presets import preset_value

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "reference"
FILES = ("plain", "massive")
WIDTH, STEPS, BOOTSTRAP = 72, 24, 16  # the reference's hidden width, training steps and bootstrap steps
BLOCKS = FeatureLayout().pca_blocks(WIDTH, [32, 64])  # [prompt | reasoning | 3 scalars]: PCA 32 and 64, as there


def _steps(name: str) -> dict[str, torch.Tensor]:
    """One file's steps as feature rows [prompt | reasoning | scalars] (steps, 96, 147), their rewards, each rollout's
    partner's reward (the probe's target: rows of one prompt are consecutive pairs), and the held-out batch."""
    data = np.load(FIXTURES / f"probe_steps_{name}.npz")
    rewards = torch.from_numpy(data["rewards"])
    return {
        "rows": torch.from_numpy(np.concatenate([data["prompt"], data["response"], data["scalars"]], axis=-1)),
        "rewards": rewards,
        "partners": rewards.view(STEPS, -1, 2).flip(-1).reshape(STEPS, -1),
        "advantages": torch.from_numpy(data["advantages"]),
        "heldout": torch.from_numpy(
            np.concatenate([data["heldout_prompt"], data["heldout_response"], data["heldout_scalars"]], axis=-1)
        ),
        "heldout_prediction": torch.from_numpy(data["heldout_prediction"]),
    }


def _reference_head() -> PCARidgeProbe:
    return PCARidgeProbe(alpha=100.0, pca_dims=BLOCKS, clip=(0.0, 1.0), seed=42)


@pytest.mark.parametrize("name", FILES)
def test_the_head_fitted_on_every_step_predicts_the_reference_probes_held_out_values(name):
    """The final probe saw all 24 x 96 rows (fewer than its 4096-row buffer): so does the head."""
    steps = _steps(name)
    head = _reference_head().fit(steps["rows"].flatten(0, 1), steps["partners"].flatten())
    predicted = head.predict(steps["heldout"])
    assert predicted.dtype == torch.float32 and predicted.shape == (96,)
    torch.testing.assert_close(predicted, steps["heldout_prediction"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", FILES)
def test_the_head_is_the_reference_probe_at_every_refit(name):
    """From step 16 on, each step's advantages are r_i minus the partner's value from the probe fitted on every
    earlier step's rows (the reference refits after each step once 8 have been observed)."""
    steps = _steps(name)
    for step in range(BOOTSTRAP, STEPS):
        head = _reference_head().fit(steps["rows"][:step].flatten(0, 1), steps["partners"][:step].flatten())
        baselines = head.predict(steps["rows"][step]).view(-1, 2).flip(-1).flatten()
        advantages = steps["rewards"][step] - baselines
        torch.testing.assert_close(advantages, steps["advantages"][step], atol=1e-5, rtol=0)


RELEASE_DISTANCE = {  # measured: max |difference|, mean |difference|, Pearson r of the held-out predictions
    "plain": (0.0841, 0.0227, 0.9946),
    "massive": (0.0976, 0.0233, 0.9945),
}


@pytest.mark.parametrize("name", FILES)
def test_the_release_heads_held_out_values_are_this_far_from_the_reference(name):
    """The ridge head with probe_preset="release"'s settings (StandardScaler before an exact PCA, alpha 100, PCA
    [32, 64], the observed clip) on the same rows: how far its held-out predictions are from the reference's."""
    steps = _steps(name)
    alpha, dims = preset_value("probe_alpha", "release"), preset_value("probe_pca_dims", "release")
    head = make_head("ridge", alpha=alpha, pca_dims=FeatureLayout().pca_blocks(WIDTH, dims), clip="observed")
    predicted = head.fit(steps["rows"].flatten(0, 1), steps["partners"].flatten()).predict(steps["heldout"])
    difference = (predicted.double() - steps["heldout_prediction"].double()).abs()
    r = torch.corrcoef(torch.stack([predicted, steps["heldout_prediction"]]).double())[0, 1]
    measured = (difference.max().item(), difference.mean().item(), r.item())
    assert measured == pytest.approx(RELEASE_DISTANCE[name], abs=1e-4)


def _sklearn_prediction(x: np.ndarray, y: np.ndarray, points: np.ndarray, blocks, alpha: float) -> np.ndarray:
    """scikit-learn's own pipeline on float32 rows, as the reference fits it: each block's seeded randomized PCA, the
    other columns after them, StandardScaler, Ridge; unclipped."""
    inside = {c for start, stop, _ in blocks for c in range(start, stop)}
    rest = [c for c in range(x.shape[1]) if c not in inside]
    pcas = [
        PCA(n_components=min(k, x.shape[0], stop - start), svd_solver="randomized", random_state=42).fit(
            x[:, start:stop]
        )
        for start, stop, k in blocks
    ]

    def design(rows: np.ndarray) -> np.ndarray:
        parts = [pca.transform(rows[:, start:stop]) for pca, (start, stop, _) in zip(pcas, blocks, strict=True)]
        return np.concatenate([*parts, rows[:, rest]], axis=1).astype(np.float32)

    return make_pipeline(StandardScaler(), Ridge(alpha=alpha)).fit(design(x), y).predict(design(points))


@pytest.mark.parametrize(
    ("pca_dims", "blocks"),
    [
        ([(2, 9, 3), (12, -1, 20)], [(2, 9, 3), (12, 19, 7)]),  # columns between and after, negative stop, k capped
        (4, [(0, 20, 4)]),  # PCA of every column
        (None, []),  # StandardScaler and Ridge alone
    ],
)
def test_predict_is_scikit_learns_pipeline_and_its_affine_map(pca_dims, blocks):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(60, 20, generator=g) * (torch.rand(20, generator=g) * 5 + 0.2) + 3
    y = x[:, 0] - 0.5 * x[:, 15] + 0.3 * torch.randn(60, generator=g)
    points = torch.randn(25, 20, generator=g) * 2
    head = PCARidgeProbe(alpha=3.0, pca_dims=pca_dims, clip=None).fit(x, y)
    expected = _sklearn_prediction(x.numpy(), y.numpy(), points.numpy(), blocks, 3.0)
    clipped, raw = head.predict(points, return_unclipped=True)
    np.testing.assert_allclose(raw.numpy(), expected, atol=1e-5, rtol=1e-5)
    weight, bias = head.affine()
    assert weight.dtype == torch.float64 and weight.shape == (20,) and bias.ndim == 0
    torch.testing.assert_close(points.double() @ weight + bias, raw.double(), atol=1e-6, rtol=1e-6)
    assert torch.equal(clipped, raw)  # clip=None
    kept = [min(k, 7) if stop == -1 else k for _, stop, k in pca_dims] if isinstance(pca_dims, list) else []
    assert [head.state_dict()[f"pca_components_{i}"].size(0) for i in range(len(kept))] == kept


def test_an_interrupted_fit_leaves_the_previous_fit(monkeypatch):
    """The state is built whole and assigned once: a KeyboardInterrupt in scikit-learn's solve changes nothing."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g), (torch.rand(40, generator=g) > 0.5).float()
    head = PCARidgeProbe(pca_dims=[(0, 4, 2)]).fit(x, y)
    before, predicted = head.state_dict(), head.predict(x)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Ridge, "fit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        head.fit(x + 1, 1 - y)
    after = head.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(head.predict(x), predicted)


def test_without_scikit_learn_the_head_names_the_install(monkeypatch):
    """Built (by name, through the estimator's spec, or directly) where scikit-learn cannot be imported: one error
    that says what to install."""
    for module in [name for name in sys.modules if name == "sklearn" or name.startswith("sklearn.")] + ["sklearn"]:
        monkeypatch.setitem(sys.modules, module, None)
    message = r"'pca_ridge' fits with scikit-learn, which is not installed: pip install scikit-learn \(or pip install "
    for build in (PCARidgeProbe, lambda: make_head("pca_ridge"), lambda: HeadSpec("pca_ridge")):
        with pytest.raises(ImportError, match=message + r"'poise-trl\[reference\]'\)"):
            build()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="random_state"):
        PCARidgeProbe(seed=-1)
    with pytest.raises(ValueError, match="alpha"):
        PCARidgeProbe(alpha=0.0)
    with pytest.raises(ValueError, match="fit expects X"):
        PCARidgeProbe().fit(torch.zeros(4, 3), torch.zeros(3))
    with pytest.raises(RuntimeError, match="before fit"):
        PCARidgeProbe().predict(torch.zeros(2, 3))
    head = PCARidgeProbe().fit(torch.randn(8, 3), torch.rand(8))
    with pytest.raises(ValueError, match="fitted on rows of 3 columns, got 4"):
        head.predict(torch.zeros(2, 4))

"""`PCARidgeProbe`: the POISE authors' reference probe (verl-project/verl-recipe, `poise/probe.py`, `RidgeProbe`) as
a value head. PCA of each raw hidden-state block (scikit-learn's randomized PCA, seeded), then a StandardScaler over
[the blocks' components, the other columns], then scikit-learn's `Ridge(alpha)` with intercept, clipped.

It differs from the `ridge` head (probe.py) in every step before the solve: that head standardizes every column
before an exact PCA and does not rescale the components. The reference's components come from scikit-learn's seeded
random draw, so only scikit-learn's own fit, on float32 rows as the reference fits, gives its probe (within 1e-5 on
the reference's outputs, tests/reference). The fit runs on the host; what it learned is then kept as float64 tensors
on the inputs' device, and predicts in torch as one affine map (PCA, scaling and ridge are each affine), the map the
per-prefix value folds (`affine`).

scikit-learn is an optional dependency: `pip install scikit-learn`, or the `reference` extra of poise-trl.
"""

from collections.abc import Sequence
from typing import Any

import torch

from .probe import (
    PCABlock,
    ScaledHead,
    clip_range,
    clipped_output,
    pca_blocks,
    pca_clip_from_json,
    pca_clip_to_json,
)

INSTALL = "pip install scikit-learn (or pip install 'poise-trl[reference]')"


def _sklearn() -> tuple[Any, Any, Any, Any]:
    """scikit-learn's PCA, StandardScaler, Ridge and make_pipeline; a missing install is one error saying how."""
    try:
        from sklearn.decomposition import PCA
        from sklearn.linear_model import Ridge
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler
    except ImportError:
        raise ImportError(
            f"The value head {PCARidgeProbe.name!r} fits with scikit-learn, which is not installed: {INSTALL}."
        ) from None
    return PCA, StandardScaler, Ridge, make_pipeline


def _passthrough(blocks: Sequence[PCABlock], n_features: int) -> list[int]:
    """The columns in no PCA block, in order: they enter the scaler as they are."""
    inside = {column for start, stop, _ in blocks for column in range(start, stop)}
    return [column for column in range(n_features) if column not in inside]


class PCARidgeProbe:
    """The reference's probe (module docstring).

    Args:
        alpha: the ridge penalty (> 0), scikit-learn's `Ridge(alpha)`; the reference's is 100.
        pca_dims: None (no PCA), an int (PCA of all columns), or (start, stop, k) blocks of the raw columns (`probe.
            pca_blocks`); k is capped at the block's rows and columns at fit time, as the reference caps it.
        clip: None, a (low, high) pair, or "observed" (the range of the targets seen in `fit`); the reference's is
            (0, 1).
        seed: `random_state` of the randomized PCA; the reference's is 42.

    The shared settings (alpha, pca_dims, clip) default as every head's do; the estimator sets them.
    """

    name = "pca_ridge"  # its key in heads.HEADS

    def __init__(
        self,
        alpha: float = 1.0,
        pca_dims: int | Sequence[PCABlock] | None = None,
        clip: tuple[float, float] | str | None = "observed",
        seed: int = 42,
    ):
        ScaledHead(alpha, pca_dims, clip)  # the shared settings' checks, as every head makes them
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed={seed!r} must be an int in [0, 2**32): the randomized PCA's random_state.")
        _sklearn()
        self.alpha = float(alpha)
        self.pca_dims = pca_dims
        self.clip = clip
        self.seed = seed
        self._state: dict[str, torch.Tensor] = {}

    @property
    def is_fitted(self) -> bool:
        return "coef" in self._state

    def fit(self, x: torch.Tensor, y: torch.Tensor, check_finite: bool = True) -> "PCARidgeProbe":
        """Fit on (N, D) rows and (N,) targets as the reference fits (float32 on the host); the state is built whole
        and assigned once, so an interrupted fit leaves the previous one."""
        if x.ndim != 2 or y.shape != (x.size(0),):
            raise ValueError(f"fit expects X (N, D) and y (N,), got {tuple(x.shape)} and {tuple(y.shape)}.")
        if x.size(0) < 2:
            raise ValueError(f"fit needs at least 2 examples, got {x.size(0)}.")
        if check_finite and not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise ValueError("fit got non-finite features or targets; drop those rows first.")
        PCA, StandardScaler, Ridge, make_pipeline = _sklearn()
        rows = x.detach().float().cpu()
        blocks = pca_blocks(self.pca_dims, rows.size(1))
        projections = [
            PCA(n_components=min(k, rows.size(0), stop - start), svd_solver="randomized", random_state=self.seed).fit(
                rows[:, start:stop].numpy()
            )
            for start, stop, k in blocks
        ]
        design = torch.cat(
            [
                *(
                    torch.from_numpy(projection.transform(rows[:, start:stop].numpy()))
                    for projection, (start, stop, _) in zip(projections, blocks, strict=True)
                ),
                rows[:, _passthrough(blocks, rows.size(1))],
            ],
            dim=1,
        )
        regressor = make_pipeline(StandardScaler(), Ridge(alpha=self.alpha))
        regressor.fit(design.numpy(), y.detach().float().cpu().numpy())
        fitted_scaler, fitted_ridge = regressor[0], regressor[-1]

        def tensor(values: Any) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.float64, device=x.device)

        state = {}
        for i, projection in enumerate(projections):
            state[f"pca_mean_{i}"] = tensor(projection.mean_)
            state[f"pca_components_{i}"] = tensor(projection.components_)
        state.update(
            scaler_mean=tensor(fitted_scaler.mean_),
            scaler_scale=tensor(fitted_scaler.scale_),
            coef=tensor(fitted_ridge.coef_),
            intercept=tensor(fitted_ridge.intercept_).reshape(1),
            clip=clip_range(self.clip, y.to(device=x.device, dtype=torch.float64)),
        )
        self._state = state
        return self

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight (D,), bias 0-d), float64: PCA, scaler and ridge folded into one map of the raw row, predict(x) =
        clip(x @ weight + bias); the value of a mean of states is then the mean of their values (prefix.py)."""
        if not self.is_fitted:
            raise RuntimeError("PCARidgeProbe.affine called before fit.")
        s = self._state
        components = [s[f"pca_components_{i}"] for i in range(sum(key.startswith("pca_mean_") for key in s))]
        width = s["coef"].numel() + sum(c.size(1) - c.size(0) for c in components)  # read from shapes: no sync
        blocks = pca_blocks(self.pca_dims, width)
        if [stop - start for start, stop, _ in blocks] != [c.size(1) for c in components]:
            raise ValueError(f"The fitted PCA blocks do not match pca_dims={self.pca_dims} on {width} columns.")
        scaled = s["coef"] / s["scaler_scale"]  # the weight of each design column before its standardization
        bias = s["intercept"][0] - scaled @ s["scaler_mean"]
        weight = torch.empty(width, dtype=torch.float64, device=scaled.device)
        used = 0
        for i, ((start, stop, _), block) in enumerate(zip(blocks, components, strict=True)):
            weight[start:stop] = block.T @ scaled[used : used + block.size(0)]
            bias = bias - weight[start:stop] @ s[f"pca_mean_{i}"]
            used += block.size(0)
        weight[_passthrough(blocks, width)] = scaled[used:]
        return weight, bias

    def predict(self, x: torch.Tensor, return_unclipped: bool = False) -> Any:
        """(N,) float32 predictions, clipped; `return_unclipped` also returns the raw values."""
        if not self.is_fitted:
            raise RuntimeError("PCARidgeProbe.predict called before fit.")
        self._state = {key: value.to(x.device) for key, value in self._state.items()}
        weight, bias = self.affine()
        if weight.numel() != x.size(-1):
            raise ValueError(f"The probe was fitted on rows of {weight.numel()} columns, got {x.size(-1)}.")
        return clipped_output(x.to(torch.float64) @ weight + bias, self._state["clip"], return_unclipped)

    def config(self) -> dict[str, Any]:
        return {"alpha": self.alpha, **pca_clip_to_json(self.pca_dims, self.clip), "seed": self.seed}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PCARidgeProbe":
        """Inverse of `config()`."""
        return cls(**pca_clip_from_json(config))

    def clone(self) -> "PCARidgeProbe":
        """An unfitted head with the same settings."""
        return type(self).from_config(self.config())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().cpu().contiguous() for key, value in self._state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._state = {key: value.to(torch.float64) for key, value in state.items()}

    def map_state(self, function) -> None:
        """Replace every fitted tensor by `function(tensor)` where it lives (a broadcast from rank 0)."""
        self._state = {key: function(self._state[key]) for key in sorted(self._state)}

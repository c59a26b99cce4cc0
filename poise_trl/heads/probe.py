"""The value probe g_f: StandardScaler -> optional per-block PCA -> closed-form ridge, in torch.

`ScaledHead` is the front end (scaler, PCA, clip) every value head shares; `ValueProbe` adds the ridge solve.

It runs on whatever device its inputs live on (the GPU in real use) and solves in float64: DESIGN §4 measured a
float32 primal solve with alpha=0.01 to be numerically wrong when there are more features than examples.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..settings import Refused

PCABlock = tuple[int, int, int]  # (start column, stop column, n_components)


def pca_blocks(pca_dims: int | Sequence[PCABlock] | None, n_features: int) -> list[PCABlock]:
    """A head's `pca_dims` as sorted (start, stop, k) blocks of `n_features` columns, k > 0: None gives none, an int k
    one block of every column; negative columns count from the end, as in a slice ((0, -1, k) leaves the last column
    out). Overlapping blocks, or blocks beyond the columns, raise."""
    if pca_dims is None:
        return []
    if isinstance(pca_dims, int):
        return [(0, n_features, pca_dims)] if pca_dims > 0 else []

    def column(c) -> int:
        return int(c) + n_features if int(c) < 0 else int(c)

    blocks = sorted((column(a), column(b), int(k)) for a, b, k in pca_dims if k > 0)
    for (_, stop, _), (start, _, _) in zip(blocks, blocks[1:], strict=False):
        if start < stop:
            raise ValueError(f"PCA blocks overlap: {blocks}")
    if blocks and (blocks[0][0] < 0 or blocks[-1][1] > n_features):
        raise ValueError(f"PCA blocks {blocks} exceed the {n_features} feature columns.")
    return blocks


def _principal_axes(block: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k principal axes (k, D) of a centred (N, D) block, with scikit-learn's PCA `svd_solver="auto"` choice, so
    the probe captures the subspace its reference would: for tall-and-narrow blocks the eigenvectors of the (D, D)
    covariance, as scikit-learn's "covariance_eigh" (exact; about 5x faster than an SVD of a full 4,096-row buffer's
    128-wide block, the toy's prompt-only refit each step under `prompt_selection`); an exact SVD for other small
    blocks; otherwise (every real model's width) a seeded randomized SVD with 10 oversamples and 7 power iterations
    when k is under 10% of the smaller side (4 otherwise); about 7x faster than the exact SVD at the Qwen3-4B size on
    CPU."""
    rows, cols = block.shape
    if cols <= 1000 and rows >= 10 * cols and 1 <= k <= cols:  # sklearn: "covariance_eigh", exact
        _, vectors = torch.linalg.eigh(block.T @ block)  # ascending eigenvalues: the top k are the last columns
        return vectors[:, -k:].flip(1).T
    if max(rows, cols) <= 500 or not 1 <= k < 0.8 * min(rows, cols):
        return torch.linalg.svd(block, full_matrices=False)[2][:k]
    with torch.random.fork_rng(devices=[block.device] if block.is_cuda else []):
        torch.manual_seed(0)
        niter = 7 if k < 0.1 * min(rows, cols) else 4
        _, _, v = torch.svd_lowrank(block, q=min(k + 10, rows, cols), niter=niter)
    return v[:, :k].T


def _solve_spd(gram: torch.Tensor, alpha: float | torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(gram + diag(alpha))^-1 rhs for a Gram matrix by Cholesky (positive definite for alpha > 0); alpha a number or
    one per row (the logistic head leaves its intercept's 0), rhs (P,) or (P, K).

    The factorisation's status is never read on the host (that would stall the device every refit): should rounding
    make it fail, the solution is NaN, so the probe predicts NaN and its rows fall back to the bootstrap baseline."""
    gram.diagonal().add_(alpha)  # in place: the Gram matrix is a temporary of the caller
    factor, info = torch.linalg.cholesky_ex(gram)
    solution = torch.cholesky_solve(rhs.reshape(rhs.size(0), -1), factor).reshape(rhs.shape)
    return torch.where(info == 0, solution, torch.full_like(solution, float("nan")))


def clip_range(clip: tuple[float, float] | str | None, y64: torch.Tensor) -> torch.Tensor:
    """[low, high] float64 on the targets' device: the observed target range ("observed"), the given pair, or
    (-inf, inf) for None."""
    if clip == "observed":
        return torch.stack([y64.min(), y64.max()])
    low, high = clip or (-torch.inf, torch.inf)
    return torch.tensor([float(low), float(high)], dtype=torch.float64, device=y64.device)


def strip_prefix(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose key starts with `prefix`, keyed without it: one nested part's state dict (an ensemble's
    child, a learner's head or buffer, an estimator's domain)."""
    return {key[len(prefix) :]: value for key, value in tensors.items() if key.startswith(prefix)}


def clipped_output(raw: torch.Tensor, clip: torch.Tensor, return_unclipped: bool) -> Any:
    """What a head's `predict` returns: the float32 values clipped to `clip`, and with `return_unclipped` the raw."""
    clipped = raw.clamp(min=clip[0], max=clip[1]).float()
    return (clipped, raw.float()) if return_unclipped else clipped


def pca_clip_to_json(pca_dims: int | Sequence[PCABlock] | None, clip: Any) -> dict[str, Any]:
    """A head's `pca_dims` and `clip` as its JSON config keeps them (tuples as lists)."""
    pca = pca_dims if pca_dims is None or isinstance(pca_dims, int) else [list(block) for block in pca_dims]
    return {"pca_dims": pca, "clip": list(clip) if isinstance(clip, tuple) else clip}


def pca_clip_from_json(config: dict[str, Any]) -> dict[str, Any]:
    """A head's JSON config with `pca_dims` and `clip` back as tuples (the inverse of `pca_clip_to_json`)."""
    pca, clip = config["pca_dims"], config["clip"]
    pca = pca if pca is None or isinstance(pca, int) else [tuple(block) for block in pca]
    return {**config, "pca_dims": pca, "clip": tuple(clip) if isinstance(clip, list) else clip}


@dataclass(frozen=True)
class HeadFit:
    """What a head learned in one `fit`: its float64 tensors (front end and head's own, on the device they were
    fitted on) and its PCA blocks' columns, kept on the host so that reading them never waits for the device. A fit
    is replaced whole, never changed in place: a stop inside `fit` leaves the previous one."""

    tensors: Mapping[str, torch.Tensor]
    blocks: tuple[tuple[int, int], ...] = ()

    def to(self, device: torch.device | str) -> "HeadFit":
        return HeadFit({key: value.to(device) for key, value in self.tensors.items()}, self.blocks)


class ScaledHead:
    """The front end every value head shares: StandardScaler -> optional per-block PCA, fitted in float64 on the
    inputs' device, then the clip to the reward range. A head subclasses it with its own `_solve` (its tensors,
    fitted on the design matrix) and `_raw` (unclipped values of a design matrix), so the heads differ only in what
    they fit. `fit` builds the whole `HeadFit` and assigns it in one statement.

    Args:
        alpha: L2 penalty (> 0), the weight of (alpha / 2) ||w||^2 beside the negative log-likelihood of the head's
            loss (half the squared error for ridge and the MLP, the cross-entropy for the logistic head).
        pca_dims: None (no PCA), an int (PCA of all columns), or (start, stop, k) blocks: columns [start, stop)
            (negative: counted from the end) are replaced by their top-k principal components; others pass through.
            k is capped by the number of rows and columns available at fit time (`fitted_pca_dims` records it).
        clip: None, a (low, high) pair, or "observed" to clip to the range of targets seen in `fit`.
    """

    name = ""  # its key in heads.HEADS

    def __init__(
        self,
        alpha: float = 1.0,
        pca_dims: int | Sequence[PCABlock] | None = None,
        clip: tuple[float, float] | str | None = "observed",
    ):
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise Refused("alpha", alpha, "must be > 0: the L2 penalty (ridge needs a positive one).")
        if isinstance(clip, str) and clip != "observed":
            raise Refused("clip", clip, "is not a clip: use None, (low, high) or 'observed'.")
        self.alpha = float(alpha)
        self.pca_dims = pca_dims
        self.clip = clip
        self._fit: HeadFit | None = None  # what `fit` (or `load_state_dict`) learned, replaced whole

    @property
    def is_fitted(self) -> bool:
        return self._fit is not None

    def _blocks(self, n_features: int) -> list[PCABlock]:
        return pca_blocks(self.pca_dims, n_features)

    @staticmethod
    def _design(x: torch.Tensor, fit: HeadFit) -> torch.Tensor:
        """Standardize, then project each PCA block onto its components; other columns pass through."""
        return ScaledHead._project((x.to(torch.float64) - fit.tensors["mean"]) / fit.tensors["scale"], fit)

    @staticmethod
    def _project(z: torch.Tensor, fit: HeadFit) -> torch.Tensor:
        """The design of standardized rows `z`: each PCA block onto its components, other columns as they are."""
        parts, cursor = [], 0
        for i, (start, stop) in enumerate(fit.blocks):
            parts += [z[:, cursor:start], z[:, start:stop] @ fit.tensors[f"pca_components_{i}"].T]
            cursor = stop
        parts.append(z[:, cursor:])
        return torch.cat(parts, dim=1)

    def _fit_front(self, x64: torch.Tensor) -> tuple[HeadFit, torch.Tensor]:
        """The scaler and the PCA blocks fitted on (N, D) float64 rows, and the rows' design."""
        n, d = x64.shape
        mean = x64.mean(0)
        scale = x64.std(0, unbiased=False)
        # sklearn's StandardScaler leaves constant columns unscaled instead of dividing by zero.
        scale = torch.where(scale > 1e-12 * mean.abs().clamp(min=1.0), scale, torch.ones_like(scale))
        blocks = self._blocks(d)
        tensors = {
            "mean": mean,
            "scale": scale,
            "pca_start": torch.tensor([b[0] for b in blocks], dtype=torch.long),
            "pca_stop": torch.tensor([b[1] for b in blocks], dtype=torch.long),
        }
        z = (x64 - mean) / scale
        for i, (start, stop, k) in enumerate(blocks):
            block = z[:, start:stop]
            block = block - block.mean(0)
            tensors[f"pca_components_{i}"] = _principal_axes(block, min(k, n, stop - start))
        front = HeadFit(tensors, tuple((start, stop) for start, stop, _ in blocks))
        return front, self._project(z, front)  # the rows' design, from the standardized rows already at hand

    def fit(self, x: torch.Tensor, y: torch.Tensor, check_finite: bool = True) -> "ScaledHead":
        """Fit on (N, D) features and (N,) targets; rows must be finite. `check_finite=False` skips the check, which
        reads a flag on the host, for callers that filtered the rows already (the estimator's buffer)."""
        if x.ndim != 2 or y.shape != (x.size(0),):
            raise ValueError(f"fit expects X (N, D) and y (N,), got {tuple(x.shape)} and {tuple(y.shape)}.")
        if x.size(0) < 2:
            raise ValueError(f"fit needs at least 2 examples, got {x.size(0)}.")
        if check_finite and not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise ValueError("fit got non-finite features or targets; drop those rows first.")
        y64 = y.to(torch.float64)
        front, design = self._fit_front(x.to(torch.float64))
        clip = clip_range(self.clip, y64)
        own = self._solve(design, y64, clip)
        self._fit = HeadFit({**front.tensors, "clip": clip, **own}, front.blocks)
        return self

    def _solve(self, design: torch.Tensor, y64: torch.Tensor, clip: torch.Tensor) -> dict[str, torch.Tensor]:
        """The head's own tensors, fitted on the (N, P) float64 design matrix; `clip` is the fit's [low, high]."""
        raise NotImplementedError

    def _raw(self, design: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(N,) float64 unclipped values of a design matrix under the fitted `tensors`."""
        raise NotImplementedError

    def _placed(self, device: torch.device) -> HeadFit:
        """The fit on `device`: moved there once (a fit loaded onto the CPU, rows on the accelerator), a placement
        that leaves what was learned as it is."""
        fit = self._fit
        if fit.tensors["mean"].device != device:
            fit = self._fit = fit.to(device)
        return fit

    def predict(self, x: torch.Tensor, return_unclipped: bool = False) -> Any:
        """(N,) float32 predictions, clipped to the reward range; `return_unclipped` also returns the raw values."""
        if not self.is_fitted:
            raise RuntimeError(f"{type(self).__name__}.predict called before fit.")
        fit = self._placed(x.device)
        return clipped_output(self._raw(self._design(x, fit), fit.tensors), fit.tensors["clip"], return_unclipped)

    @property
    def fitted_pca_dims(self) -> list[int]:
        if self._fit is None:
            return []
        return [int(self._fit.tensors[f"pca_components_{i}"].size(0)) for i in range(len(self._fit.blocks))]

    def config(self) -> dict[str, Any]:
        return {"alpha": self.alpha, **pca_clip_to_json(self.pca_dims, self.clip)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ScaledHead":
        """Inverse of `config()`."""
        return cls(**pca_clip_from_json(config))

    def clone(self) -> "ScaledHead":
        """An unfitted head with the same settings."""
        return type(self).from_config(self.config())

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self._fit is None:
            return {}
        return {k: v.detach().cpu().contiguous() for k, v in self._fit.tensors.items()}

    def map_state(self, function) -> None:
        """Replace every fitted tensor by `function(tensor)` where it lives (e.g. a broadcast from rank 0), without
        the round trip through the host that `state_dict` makes; in sorted key order, the same on every rank."""
        fit = self._fit
        if fit is not None:
            self._fit = HeadFit({key: function(fit.tensors[key]) for key in sorted(fit.tensors)}, fit.blocks)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state_dict()` (empty: unfitted), in one assignment."""
        if not state:
            self._fit = None
            return
        tensors = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state.items()}
        starts, stops = state.get("pca_start", torch.zeros(0)).tolist(), state.get("pca_stop", torch.zeros(0)).tolist()
        self._fit = HeadFit(tensors, tuple((int(a), int(b)) for a, b in zip(starts, stops, strict=True)))


class ValueProbe(ScaledHead):
    """A sklearn-like ridge probe on torch tensors: `ScaledHead`'s front end and settings (alpha, pca_dims, clip), then
    closed-form ridge. With `pca_dims=None, clip=None` it reproduces `make_pipeline(StandardScaler(), Ridge(alpha))`.
    """

    name = "ridge"  # its key in heads.HEADS

    def _solve(self, design: torch.Tensor, y64: torch.Tensor, clip: torch.Tensor) -> dict[str, torch.Tensor]:
        n = design.size(0)
        design_mean = design.mean(0)
        centered = design - design_mean
        target_mean = y64.mean()
        yc = y64 - target_mean
        if centered.size(1) <= n:  # primal: (F'F + aI) w = F'y
            coef = _solve_spd(centered.T @ centered, self.alpha, centered.T @ yc)
        else:  # dual: w = F'(FF' + aI)^-1 y, the cheaper solve when D > N
            coef = centered.T @ _solve_spd(centered @ centered.T, self.alpha, yc)
        return {"coef": coef, "intercept": (target_mean - design_mean @ coef).reshape(1)}

    def _raw(self, design: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return design @ tensors["coef"] + tensors["intercept"]

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight (D,), bias 0-d), float64: scaler, PCA and ridge folded into one map, predict(x) = clip(x @ weight +
        bias). Linear in x, so the value of a mean of states is the mean of their projections (prefix.py)."""
        if not self.is_fitted:
            raise RuntimeError("ValueProbe.affine called before fit.")
        s, blocks = self._fit.tensors, self._fit.blocks
        weight, j, cursor = torch.empty_like(s["mean"]), 0, 0
        for i, (start, stop) in enumerate(blocks):
            components = s[f"pca_components_{i}"]  # (k, stop - start): design column j + m is z_block @ row m
            weight[cursor:start] = s["coef"][j : j + start - cursor]
            j += start - cursor
            weight[start:stop] = components.T @ s["coef"][j : j + components.size(0)]
            j, cursor = j + components.size(0), stop
        weight[cursor:] = s["coef"][j:]
        weight = weight / s["scale"]
        return weight, s["intercept"][0] - weight @ s["mean"]

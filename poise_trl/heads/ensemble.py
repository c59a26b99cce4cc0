"""`EnsembleProbe`: several value heads fitted on the same rows and combined, as holi-lab/POISE's multi-estimator
(`mean`, or `ridge_stacker`). Pure torch.

"mean" averages the children's clipped predictions. "stack" fits a ridge probe (standardized, `stack_alpha`) on the
children's predictions, as the official stacker, but on out-of-fold predictions: each child is refitted K times
without one fold of rows and predicts that fold, so the stacker learns how far to trust each child on rows it did
not see (fitted on in-sample predictions, a flexible child would win for fitting its own noise). Folds are
contiguous runs of rows, so the G rollouts of one prompt, adjacent in the estimator's buffer, stay in one fold (a
prompt seen at two steps may still straddle two folds). With fewer than 4 rows no fold can be held out and the
stacker is fitted on in-sample predictions. The children are then fitted on every row.
"""

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .logistic import LogisticProbe
from .probe import PCABlock, ValueProbe, clip_range, clipped_output, strip_prefix

COMBINES = ("mean", "stack")


@dataclass(frozen=True)
class EnsembleFit:
    """What an ensemble learned in one `fit`: its fitted children, its fitted stacker ("stack"; None for "mean") and
    the clip range, replaced whole (a stop inside `fit` leaves the previous fit)."""

    children: tuple[Any, ...]
    stacker: ValueProbe | None
    clip: torch.Tensor


class EnsembleProbe:
    """Children heads combined by `combine` (module docstring).

    Args:
        alpha, pca_dims: the default children's settings (ridge and logistic); children given keep their own.
        clip: None, a (low, high) pair, or "observed": the range the combined prediction is clipped to (and the
            default children's).
        children: unfitted heads, cloned (`heads.make_head` builds them from names); None: ridge and logistic.
        combine: "mean" or "stack".
        folds: K of the stacker's out-of-fold predictions (capped at half the rows).
        stack_alpha: the stacker's ridge penalty.
    """

    name = "ensemble"

    def __init__(
        self,
        alpha: float = 1.0,
        pca_dims: int | Sequence[PCABlock] | None = None,
        clip: tuple[float, float] | str | None = "observed",
        children: Sequence[Any] | None = None,
        combine: str = "mean",
        folds: int = 5,
        stack_alpha: float = 1.0,
    ):
        if children is None:
            children = [head(alpha=alpha, pca_dims=pca_dims, clip=clip) for head in (ValueProbe, LogisticProbe)]
        if not children:
            raise ValueError("An ensemble needs at least one child head.")
        if combine not in COMBINES:
            raise ValueError(f"combine={combine!r}: choose one of {list(COMBINES)}.")
        if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
            raise ValueError(f"folds={folds!r} must be an int >= 2.")
        if isinstance(clip, str) and clip != "observed":
            raise ValueError(f"clip={clip!r}: use None, (low, high) or 'observed'.")
        self._children = tuple(child.clone() for child in children)  # unfitted: the children's settings
        self.clip, self.combine, self.folds = clip, combine, folds
        self._stacker = ValueProbe(alpha=stack_alpha, clip=None)  # validates stack_alpha
        self._fit: EnsembleFit | None = None

    @property
    def is_fitted(self) -> bool:
        return self._fit is not None

    @property
    def children(self) -> tuple[Any, ...]:
        """The children heads: fitted once the ensemble is, unfitted (their settings) before."""
        return self._children if self._fit is None else self._fit.children

    @property
    def stacker(self) -> ValueProbe:
        """The ridge stacker ("stack"): fitted once the ensemble is, unfitted before."""
        return self._stacker if self._fit is None or self._fit.stacker is None else self._fit.stacker

    @staticmethod
    def _children_predictions(x: torch.Tensor, children: Sequence[Any]) -> torch.Tensor:
        """(N, children) float64 clipped predictions of fitted `children`."""
        return torch.stack([child.predict(x) for child in children], dim=1).double()

    def _out_of_fold(self, x: torch.Tensor, y: torch.Tensor, fitted: Sequence[Any]) -> torch.Tensor:
        """(N, children) predictions of each row by children fitted without its fold (index tensors, chosen on the
        host from the row count: no device read); with too few rows, those of the `fitted` children."""
        n = x.size(0)
        k = min(self.folds, n // 2)
        if k < 2:
            return self._children_predictions(x, fitted)
        fold = [i * k // n for i in range(n)]
        out = torch.empty(n, len(self._children), dtype=torch.float64, device=x.device)
        for f in range(k):
            train = torch.tensor([i for i in range(n) if fold[i] != f], device=x.device)
            test = torch.tensor([i for i in range(n) if fold[i] == f], device=x.device)
            for c, child in enumerate(self._children):
                fitted_without = child.clone().fit(x[train], y[train], check_finite=False)
                out[test, c] = fitted_without.predict(x[test]).double()
        return out

    def fit(self, x: torch.Tensor, y: torch.Tensor, check_finite: bool = True) -> "EnsembleProbe":
        """Fit every child on (N, D) rows and (N,) targets, then the stacker ("stack"); the new fit is assigned
        whole."""
        children = []
        for child in self._children:
            children.append(child.clone().fit(x, y, check_finite))
            check_finite = False  # checked by the first child
        stacker = None
        if self.combine == "stack":
            stacker = self._stacker.clone().fit(self._out_of_fold(x, y, children), y, check_finite=False)
        self._fit = EnsembleFit(tuple(children), stacker, clip_range(self.clip, y.to(torch.float64)))
        return self

    def predict(self, x: torch.Tensor, return_unclipped: bool = False) -> Any:
        """(N,) float32 combined predictions, clipped; `return_unclipped` also returns the raw combination."""
        fit = self._fit
        if fit is None:
            raise RuntimeError("EnsembleProbe.predict called before fit.")
        children = self._children_predictions(x, fit.children)
        if fit.stacker is None:
            raw = children.mean(1)
        else:
            raw = fit.stacker.predict(children, return_unclipped=True)[1].double()
        return clipped_output(raw, fit.clip.to(x.device), return_unclipped)

    def config(self) -> dict[str, Any]:
        return {
            "clip": list(self.clip) if isinstance(self.clip, tuple) else self.clip,
            "children": [{"name": child.name, "config": child.config()} for child in self._children],
            "combine": self.combine,
            "folds": self.folds,
            "stack_alpha": self._stacker.alpha,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "EnsembleProbe":
        """Inverse of `config()` once its children are heads again (`heads.head_from_config` rebuilds them by name:
        this module knows no table of heads)."""
        clip = config["clip"]
        return cls(
            clip=tuple(clip) if isinstance(clip, list) else clip,
            children=config["children"],
            combine=config["combine"],
            folds=config["folds"],
            stack_alpha=config["stack_alpha"],
        )

    def clone(self) -> "EnsembleProbe":
        """An unfitted ensemble with the same settings."""
        return EnsembleProbe(
            clip=self.clip,
            children=self._children,
            combine=self.combine,
            folds=self.folds,
            stack_alpha=self._stacker.alpha,
        )

    @staticmethod
    def _parts(fit: EnsembleFit) -> list[tuple[str, Any]]:
        """(key prefix, head) of every fitted part: the children in order, then the stacker when it is used."""
        parts = [(f"child.{i}.", child) for i, child in enumerate(fit.children)]
        return parts + ([("stacker.", fit.stacker)] if fit.stacker is not None else [])

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self._fit is None:
            return {}
        state = {f"{prefix}{k}": v for prefix, part in self._parts(self._fit) for k, v in part.state_dict().items()}
        return {**state, "clip": self._fit.clip.detach().cpu().contiguous()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state_dict()` (without a clip: unfitted), in one assignment."""
        if "clip" not in state:
            self._fit = None
            return
        children = tuple(child.clone() for child in self._children)
        stacker = self._stacker.clone() if self.combine == "stack" else None
        fit = EnsembleFit(children, stacker, state["clip"].to(torch.float64))
        for prefix, part in self._parts(fit):
            part.load_state_dict(strip_prefix(state, prefix))
        self._fit = fit

    def map_state(self, function) -> None:
        """Replace every fitted tensor by `function(tensor)` (a broadcast from rank 0), part by part in order, on
        copies of the parts: the new fit is assigned whole."""
        fit = self._fit
        if fit is None:
            return
        copies = EnsembleFit(
            tuple(copy.copy(child) for child in fit.children), copy.copy(fit.stacker), fit.clip
        )  # shallow: a part's map_state assigns a new fit to the copy alone
        for _, part in self._parts(copies):
            part.map_state(function)
        self._fit = EnsembleFit(copies.children, copies.stacker, function(fit.clip))

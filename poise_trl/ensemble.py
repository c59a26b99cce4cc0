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

from collections.abc import Sequence
from typing import Any

import torch

from .logistic import LogisticProbe
from .probe import PCABlock, ValueProbe, clip_range, clipped_output

COMBINES = ("mean", "stack")


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
        self.children = [child.clone() for child in children]
        self.clip, self.combine, self.folds = clip, combine, folds
        self.stacker = ValueProbe(alpha=stack_alpha, clip=None)  # validates stack_alpha
        self._clip: torch.Tensor | None = None

    @property
    def is_fitted(self) -> bool:
        return self._clip is not None and all(child.is_fitted for child in self.children)

    def _children_predictions(self, x: torch.Tensor) -> torch.Tensor:
        """(N, children) float64 clipped predictions of the fitted children."""
        return torch.stack([child.predict(x) for child in self.children], dim=1).double()

    def _out_of_fold(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(N, children) predictions of each row by children fitted without its fold (index tensors, chosen on the
        host from the row count: no device read)."""
        n = x.size(0)
        k = min(self.folds, n // 2)
        if k < 2:
            return self._children_predictions(x)
        fold = [i * k // n for i in range(n)]
        out = torch.empty(n, len(self.children), dtype=torch.float64, device=x.device)
        for f in range(k):
            train = torch.tensor([i for i in range(n) if fold[i] != f], device=x.device)
            test = torch.tensor([i for i in range(n) if fold[i] == f], device=x.device)
            for c, child in enumerate(self.children):
                fitted = child.clone().fit(x[train], y[train], check_finite=False)
                out[test, c] = fitted.predict(x[test]).double()
        return out

    def fit(self, x: torch.Tensor, y: torch.Tensor, check_finite: bool = True) -> "EnsembleProbe":
        """Fit every child on (N, D) rows and (N,) targets, then the stacker ("stack")."""
        for child in self.children:
            child.fit(x, y, check_finite)
            check_finite = False  # checked by the first child
        if self.combine == "stack":
            self.stacker.fit(self._out_of_fold(x, y), y, check_finite=False)
        self._clip = clip_range(self.clip, y.to(torch.float64))
        return self

    def predict(self, x: torch.Tensor, return_unclipped: bool = False) -> Any:
        """(N,) float32 combined predictions, clipped; `return_unclipped` also returns the raw combination."""
        if not self.is_fitted:
            raise RuntimeError("EnsembleProbe.predict called before fit.")
        children = self._children_predictions(x)
        if self.combine == "mean":
            raw = children.mean(1)
        else:
            raw = self.stacker.predict(children, return_unclipped=True)[1].double()
        self._clip = self._clip.to(x.device)
        return clipped_output(raw, self._clip, return_unclipped)

    def config(self) -> dict[str, Any]:
        return {
            "clip": list(self.clip) if isinstance(self.clip, tuple) else self.clip,
            "children": [{"name": child.name, "config": child.config()} for child in self.children],
            "combine": self.combine,
            "folds": self.folds,
            "stack_alpha": self.stacker.alpha,
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
            children=self.children,
            combine=self.combine,
            folds=self.folds,
            stack_alpha=self.stacker.alpha,
        )

    def _parts(self) -> list[tuple[str, Any]]:
        """(key prefix, head) of every fitted part: the children in order, then the stacker when it is used."""
        parts = [(f"child.{i}.", child) for i, child in enumerate(self.children)]
        return parts + ([("stacker.", self.stacker)] if self.combine == "stack" else [])

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"{prefix}{k}": v for prefix, part in self._parts() for k, v in part.state_dict().items()}
        return state if self._clip is None else {**state, "clip": self._clip.detach().cpu().contiguous()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for prefix, part in self._parts():
            part.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        self._clip = state["clip"].to(torch.float64) if "clip" in state else None

    def map_state(self, function) -> None:
        """Replace every fitted tensor by `function(tensor)` (a broadcast from rank 0), part by part in order."""
        for _, part in self._parts():
            part.map_state(function)
        self._clip = function(self._clip)

"""`ValueHead`: the interface every value head has, whichever it is. Its own module so that what takes any head (the
online learner, the layer choice, the estimator) imports the interface, not the table of every head (heads.py)."""

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ValueHead(Protocol):
    """A value head: settings in the constructor, what it learned in `state_dict` (tensors only, no pickle)."""

    name: str  # its key in `HEADS`

    @property
    def is_fitted(self) -> bool: ...

    def fit(self, x: torch.Tensor, y: torch.Tensor, check_finite: bool = True) -> "ValueHead":
        """Fit on (N, D) rows and (N,) targets; returns the head."""

    def predict(self, x: torch.Tensor, return_unclipped: bool = False) -> Any:
        """(N,) float32 values clipped to the reward range (with `return_unclipped`, also the raw values)."""

    def clone(self) -> "ValueHead":
        """An unfitted head with the same settings."""

    def config(self) -> dict[str, Any]:
        """The settings as JSON; `from_config` (a classmethod) inverts it."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def map_state(self, function) -> None:
        """Replace every fitted tensor by `function(tensor)` in place (a broadcast from rank 0)."""

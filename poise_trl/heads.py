"""Value heads: what maps a feature row to a predicted reward, behind one small interface, in a name -> head table
(as `sampling.RULES` holds the prompt-sampling rules). Pure torch.

The online learner (learner.py) takes a head and does not care which: it clones the unfitted head's settings,
fits on its buffer, predicts, and round-trips the fit through `state_dict`. A new head is one class with this
interface and one entry in `HEADS`; `head_from_config` rebuilds a saved head from its name and `config()`. The
heads other than the ensemble share `probe.ScaledHead`'s front end (scaler, per-block PCA, clip) and differ in what
they fit on it.
"""

from typing import Any, Protocol, runtime_checkable

import torch

from .ensemble import EnsembleProbe
from .logistic import LogisticProbe
from .mlp import MLPProbe
from .probe import ValueProbe


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


HEADS: dict[str, type] = {head.name: head for head in (ValueProbe, LogisticProbe, MLPProbe, EnsembleProbe)}
"""Every head is built as `HEADS[name](alpha=, pca_dims=, clip=)` with a run's probe settings: ridge (probe.py),
sigmoid-BCE (logistic.py), one hidden layer (mlp.py), and an ensemble of heads (ensemble.py)."""


def head_from_config(config: dict[str, Any], name: str = ValueProbe.name) -> ValueHead:
    """The unfitted head `name` with the settings a `config()` gave (files written before heads had names hold a
    ridge probe)."""
    if name not in HEADS:
        raise ValueError(f"Unknown value head {name!r}: choose one of {sorted(HEADS)}.")
    return HEADS[name].from_config(config)

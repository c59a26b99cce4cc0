"""Value heads: what maps a feature row to a predicted reward, behind one small interface, in a name -> head table
(as `sampling.RULES` holds the prompt-sampling rules). Pure torch.

The online learner (learner.py) takes a head and does not care which: it clones the unfitted head's settings,
fits on its buffer, predicts, and round-trips the fit through `state_dict`. A new head is one class with this
interface and one entry in `HEADS`: its own settings are its constructor's keywords beside the shared front end's
(`SHARED_SETTINGS`), read from its signature as scikit-learn's `get_params` reads an estimator's, so the estimator's
spec (specs.py) and `POISEConfig.probe_head_kwargs` reach them with no list kept by hand. A head made of heads names
them in its `children` setting (the ensemble's): `make_head` builds named children with the shared settings, and
`head_from_config` rebuilds saved ones by name, so such a head never needs this table. What a head can do is asked
of the head itself: the per-prefix value needs one with an `affine` map (granularity.py).
"""

import inspect
from typing import Any

from .ensemble import EnsembleProbe
from .interface import ValueHead
from .logistic import LogisticProbe
from .mlp import MLPProbe
from .pca_ridge import PCARidgeProbe
from .probe import ValueProbe

HEADS: dict[str, type] = {
    head.name: head for head in (ValueProbe, LogisticProbe, MLPProbe, EnsembleProbe, PCARidgeProbe)
}
"""Ridge (probe.py), sigmoid-BCE (logistic.py), one hidden layer (mlp.py), an ensemble of heads (ensemble.py), and
the POISE authors' reference probe, fitted by scikit-learn (pca_ridge.py)."""

SHARED_SETTINGS = ("alpha", "pca_dims", "clip")
"""The front end's settings every head takes (`probe.ScaledHead`): the estimator sets them from its own."""


def _known(name: str) -> type:
    if name not in HEADS:
        raise ValueError(f"Unknown value head {name!r}: choose one of {sorted(HEADS)}.")
    return HEADS[name]


def own_settings(name: str) -> list[str]:
    """The settings head `name` takes besides `SHARED_SETTINGS`: its constructor's keywords."""
    return [key for key in inspect.signature(_known(name)).parameters if key not in SHARED_SETTINGS]


def make_head(
    name: str,
    alpha: float = 1.0,
    pca_dims: Any = None,
    clip: tuple[float, float] | str | None = "observed",
    **settings: Any,
) -> ValueHead:
    """The unfitted head `name` with the shared settings and its own `settings` (an unknown key is refused, naming
    the head's own keys); `children` given by name are built with the same shared settings."""
    head = _known(name)
    unknown = sorted(set(settings) - set(own_settings(name)))
    if unknown:
        own = ", ".join(own_settings(name)) or "none"
        raise ValueError(f"The value head {name!r} has no setting {', '.join(unknown)}: its own settings are {own}.")
    if "children" in settings:
        unknown = [child for child in settings["children"] if isinstance(child, str) and child not in HEADS]
        if unknown:
            raise ValueError(f"Unknown child heads {unknown}: choose from {sorted(HEADS)}.")
        shared = dict(alpha=alpha, pca_dims=pca_dims, clip=clip)
        settings["children"] = [
            make_head(child, **shared) if isinstance(child, str) else child for child in settings["children"]
        ]
    return head(alpha=alpha, pca_dims=pca_dims, clip=clip, **settings)


def head_from_config(config: dict[str, Any], name: str = ValueProbe.name) -> ValueHead:
    """The unfitted head `name` with the settings a `config()` gave, its `children` rebuilt by name (files written
    before heads had names hold a ridge probe)."""
    head = _known(name)
    if "children" in config:
        config = {**config, "children": [head_from_config(c["config"], c["name"]) for c in config["children"]]}
    return head.from_config(config)

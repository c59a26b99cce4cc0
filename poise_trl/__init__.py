"""POISE for TRL: value baselines predicted from the policy's own internal states (arXiv 2605.07579).

Every public name loads on first access: `POISEConfig` and `POISETrainer` import TRL (several seconds) and the math
modules import torch (about 2 s), so `import poise_trl` and the `poise-trl` command line stay light.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batch import Rollouts
    from .choices import PROBE_PRESETS
    from .config import POISEConfig
    from .estimator import AdvantageResult, POISEEstimator
    from .probe import ValueProbe
    from .specs import EstimatorSpec
    from .trainer import POISETrainer

__version__ = "0.2.0.dev0"

_LAZY = {
    "POISEConfig": ".config",
    "PROBE_PRESETS": ".choices",
    **dict.fromkeys(("AdvantageResult", "POISEEstimator"), ".estimator"),
    "Rollouts": ".batch",
    "ValueProbe": ".probe",
    "EstimatorSpec": ".specs",
    "POISETrainer": ".trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The public API, short on purpose: the trainer and its config, the estimator for loops outside TRL, what they take
# and what they hand back. Everything else is imported from its module (docs/api-internals.md).
__all__ = [
    "POISEConfig",
    "POISETrainer",
    "POISEEstimator",
    "EstimatorSpec",
    "Rollouts",
    "AdvantageResult",
    "ValueProbe",
    "PROBE_PRESETS",
]

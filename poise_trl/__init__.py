"""POISE for TRL: value baselines predicted from the policy's own internal states (arXiv 2605.07579).

Every public name loads on first access: `POISEConfig` and `POISETrainer` import TRL (several seconds) and the math
modules import torch (about 2 s), so `import poise_trl` and the `poise-trl` command line stay light.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .choices import PROBE_PRESETS
    from .estimator.batch import Rollouts
    from .estimator.estimator import AdvantageResult, POISEEstimator
    from .estimator.specs import EstimatorSpec
    from .grpo.config import POISEConfig
    from .grpo.trainer import POISETrainer
    from .heads.probe import ValueProbe

__version__ = "0.2.0.dev0"

_LAZY = {
    "POISEConfig": ".grpo.config",
    "PROBE_PRESETS": ".choices",
    **dict.fromkeys(("AdvantageResult", "POISEEstimator"), ".estimator.estimator"),
    "Rollouts": ".estimator.batch",
    "ValueProbe": ".heads.probe",
    "EstimatorSpec": ".estimator.specs",
    "POISETrainer": ".grpo.trainer",
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

"""POISE for TRL: value baselines predicted from the policy's own internal states (arXiv 2605.07579).

Every public name loads on first access: `POISEConfig` and `POISETrainer` import TRL (several seconds) and the math
modules import torch (about 2 s), so `import poise_trl` and the `poise-trl` command line stay light.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .baselines import baseline_diagnostics, cross_rollout_baselines, leave_one_out_targets, poise_advantages
    from .config import PROBE_PRESETS, POISEConfig
    from .estimator import AdvantageResult, POISEEstimator
    from .features import (
        assemble_features,
        capture_layer,
        entropy_statistics,
        feature_spans,
        find_decoder_layers,
        find_last_subsequence,
        resolve_layer_index,
    )
    from .files import load_probe_file, save_probe_file
    from .probe import OnlineProbe, ProbeBuffer, ValueProbe
    from .trainer import POISETrainer

__version__ = "0.2.0.dev0"

_LAZY = {
    **dict.fromkeys(
        ("baseline_diagnostics", "cross_rollout_baselines", "leave_one_out_targets", "poise_advantages"), ".baselines"
    ),
    **dict.fromkeys(("POISEConfig", "PROBE_PRESETS"), ".config"),
    **dict.fromkeys(("AdvantageResult", "POISEEstimator"), ".estimator"),
    **dict.fromkeys(
        (
            "assemble_features",
            "capture_layer",
            "entropy_statistics",
            "feature_spans",
            "find_decoder_layers",
            "find_last_subsequence",
            "resolve_layer_index",
        ),
        ".features",
    ),
    **dict.fromkeys(("OnlineProbe", "ProbeBuffer", "ValueProbe"), ".probe"),
    **dict.fromkeys(("load_probe_file", "save_probe_file"), ".files"),
    "POISETrainer": ".trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdvantageResult",
    "POISEEstimator",
    "OnlineProbe",
    "POISEConfig",
    "POISETrainer",
    "PROBE_PRESETS",
    "ProbeBuffer",
    "ValueProbe",
    "assemble_features",
    "baseline_diagnostics",
    "capture_layer",
    "cross_rollout_baselines",
    "entropy_statistics",
    "feature_spans",
    "find_decoder_layers",
    "find_last_subsequence",
    "leave_one_out_targets",
    "load_probe_file",
    "poise_advantages",
    "resolve_layer_index",
    "save_probe_file",
]

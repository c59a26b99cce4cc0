"""POISE for TRL: value baselines predicted from the policy's own internal states (arXiv 2605.07579)."""

from .baselines import baseline_diagnostics, cross_rollout_baselines, leave_one_out_targets
from .config import PROBE_PRESETS, POISEConfig
from .features import (
    assemble_features,
    capture_layer,
    entropy_statistics,
    feature_spans,
    find_decoder_layers,
    find_last_subsequence,
    resolve_layer_index,
)
from .probe import ProbeBuffer, ValueProbe, load_probe_file, save_probe_file
from .trainer import POISETrainer

__version__ = "0.1.0"

__all__ = [
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
    "resolve_layer_index",
    "save_probe_file",
]

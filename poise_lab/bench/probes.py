"""The probes `bench scalars` fits its rows with (`--probes`), as data: each one's label and `POISEConfig` fields. It
imports no torch, so the command's `--help` can list them."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .contenders import CONTENDERS


@dataclass(frozen=True)
class Probe:
    """A probe the rows are fitted with: how the report names it and its `POISEConfig` fields."""

    label: str
    settings: Mapping[str, Any]


def _contender(name: str) -> Probe:
    return Probe(CONTENDERS[name].label, CONTENDERS[name].overrides)


PROBES = {
    "poise_paper": _contender("poise_paper"),
    "poise": _contender("poise"),  # POISEConfig's defaults: its default probe_preset
    "poise_reference": Probe("POISE (reference) G=2", {"probe_preset": "reference"}),
    "reference_ridge": Probe(
        "POISE (reference), ridge head G=2", {"probe_preset": "reference", "probe_head": "ridge"}
    ),
    "reference_partner": Probe(
        "POISE (reference) +partner G=2", {"probe_preset": "reference", "probe_partner_reward": True}
    ),
}
"""`--probes` NAME -> its probe: `bench gradient`'s POISE (paper) and POISE (default) (the contenders), the POISE
authors' recipe (`probe_preset="reference"`), and that recipe with one change each: poise-trl's ridge head
(StandardScaler on every column, then exact PCA, no scaling after it, at the recipe's alpha and PCA widths, in the
place of its pca_ridge) or the partner-aware probe."""

DEFAULT_PROBES = ("poise_paper", "poise")
"""`--probes`' default: `bench gradient`'s rows whose probe it fits on the probe pool."""

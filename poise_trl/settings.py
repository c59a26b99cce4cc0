"""Settings' rules shared by several places, light to import (no torch): the importance sampler's floor, its default
and its rule (the command lines show it; the rule itself is `sampling.Importance`), and `Refused`, how an object
refuses one of its constructor's settings so that a spec of those settings names it its own way."""

from typing import Any

DEFAULT_FLOOR = 0.5
"""`prompt_selection_floor`: the share of uniform probability every candidate keeps, so each weight is at most
1 / floor = 2. What the floor changes, measured, is on the docs' "Choosing settings" page
(docs/choosing-settings.md)."""


class Refused(ValueError):
    """A constructor's refusal of its setting `key`: the value and the rule it breaks, kept apart so that a spec that
    holds the setting under another name (specs.py: `HistorySpec.size`, `probe_history_size`) names it its way while
    the check itself lives in one place, the constructor."""

    def __init__(self, key: str, value: Any, rule: str):
        self.key, self.value, self.rule = key, value, rule
        super().__init__(f"{key}={value!r} {rule}")


def check_floor(floor: float) -> None:
    """The importance sampler's floor rule, shared by the sampling rule and `bench gradient`."""
    if not (isinstance(floor, int | float) and 0 < floor <= 1):
        raise ValueError(
            f"prompt_selection_floor={floor!r} must be in (0, 1]: the share of uniform probability every candidate "
            "keeps, so that each has a positive probability and a weight of at most 1 / floor (1: uniform)."
        )

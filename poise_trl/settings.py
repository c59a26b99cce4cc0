"""The importance sampler's floor, its default and its rule, light to import (no torch) for the command lines that
show it; the rule itself is `sampling.Importance`."""

DEFAULT_FLOOR = 0.5
"""`prompt_selection_floor`: the share of uniform probability every candidate keeps, so each weight is at most
1 / floor = 2. What the floor changes, measured, is on the docs' "Choosing settings" page
(docs/choosing-settings.md)."""


def check_floor(floor: float) -> None:
    """The importance sampler's floor rule, shared by the sampling rule and `bench gradient`."""
    if not (isinstance(floor, int | float) and 0 < floor <= 1):
        raise ValueError(
            f"prompt_selection_floor={floor!r} must be in (0, 1]: the share of uniform probability every candidate "
            "keeps, so that each has a positive probability and a weight of at most 1 / floor (1: uniform)."
        )

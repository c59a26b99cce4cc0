"""A `POISEConfig`'s preset (`probe_preset`, one entry of `choices.PROBE_PRESETS`): the fields it fills, the explicit
values it refuses, and the settings a run changed from it. No torch.

A dataclass cannot tell a value the user wrote from a default, so every field a preset sets whose value differs
between presets defaults to None ("the preset's") and is filled here; the others' defaults are every preset's value
(tests/test_config.py checks both). What a run changed from its preset is then what differs from the preset's
value, however it was set: the model card and the estimator's file name each (`preset_record`).
"""

import copy
from collections.abc import Mapping
from typing import Any

from .choices import PROBE_PRESETS, Preset


def preset_settings(preset: Preset, domain_column: str | None) -> dict[str, Any]:
    """The settings `preset` gives a config: its own, with those that apply only with a domain column where the
    config names one."""
    return {**preset.settings, **(preset.domain_settings if domain_column is not None else {})}


def _json(value: Any, number: type | None = None) -> Any:
    """A value as JSON holds it (tuples as lists, keys as strings); numbers made `number` where given."""
    if isinstance(value, list | tuple):
        return [_json(v, number) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json(v, number) for k, v in value.items()}
    if number is not None and isinstance(value, int | float) and not isinstance(value, bool):
        return number(value)
    return value


def same(a: Any, b: Any) -> bool:
    """Whether two settings' values are equal as the config holds them: `[0, 1]` is `(0.0, 1.0)`."""
    return _json(a, float) == _json(b, float)


def fill_preset(config: Any, presets: Mapping[str, Preset] = PROBE_PRESETS) -> None:
    """Fill each field the preset sets that the config leaves at None, then refuse an explicit value that the preset
    cannot do without (`Preset.required`), naming both values and why."""
    name = config.probe_preset
    if name not in presets:
        raise ValueError(f"probe_preset={name!r}: choose one of {list(presets)}.")
    preset = presets[name]
    for key, value in preset_settings(preset, config.probe_domain_column).items():
        if getattr(config, key) is None:
            setattr(config, key, copy.deepcopy(value))
    for key, why in preset.required.items():
        needed = preset.settings[key]
        if not same(getattr(config, key), needed):
            raise ValueError(
                f"{key}={getattr(config, key)!r} with probe_preset={name!r}, which needs {key}={needed!r}: {why}. "
                f"Set {key}={needed!r}, or choose another probe_preset."
            )


def preset_changes(config: Any, presets: Mapping[str, Preset] = PROBE_PRESETS) -> dict[str, tuple[Any, Any]]:
    """Field -> (the preset's value, the config's) for every setting of the config's preset it holds another value
    of (a filled config: after `fill_preset`)."""
    preset = presets[config.probe_preset]
    settings = preset_settings(preset, config.probe_domain_column)
    return {
        key: (value, getattr(config, key)) for key, value in settings.items() if not same(getattr(config, key), value)
    }


def preset_record(config: Any) -> dict[str, Any]:
    """The preset a config names and the settings it changed from it, as JSON (the estimator's file holds it)."""
    changed = preset_changes(config)
    return {"name": config.probe_preset, "changed": {key: _json(value) for key, (_, value) in changed.items()}}


def preset_value(key: str, preset: str | None = None) -> Any:
    """The value `preset` (None: `POISEConfig`'s default preset) gives the field `key`, without a domain column; a
    field it does not set keeps its own default."""
    from .choices import DEFAULT_PRESET

    settings = PROBE_PRESETS[preset or DEFAULT_PRESET].settings
    if key not in settings:
        raise KeyError(f"probe_preset={preset or DEFAULT_PRESET!r} does not set {key}.")
    return copy.deepcopy(settings[key])

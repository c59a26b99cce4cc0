"""A TRL script's `GRPOConfig` as a `POISEConfig` (`POISEConfig.from_grpo_config`), and what the switch changes."""

import logging
from dataclasses import MISSING, fields
from typing import Any

from trl import GRPOConfig

logger = logging.getLogger(__name__)


def changed_defaults(poise: type) -> dict[str, tuple[Any, Any]]:
    """Field -> (GRPOConfig's default, `poise`'s) for the defaults the POISEConfig class `poise` changes."""

    def default(f):
        return f.default_factory() if f.default_factory is not MISSING else f.default

    trl = {f.name: default(f) for f in fields(GRPOConfig)}
    own = {f.name: default(f) for f in fields(poise) if f.name in trl}
    return {name: (trl[name], value) for name, value in own.items() if trl[name] != value}


def conversion_message(config: GRPOConfig, converted: GRPOConfig, changed: list[str]) -> str:
    """What `from_grpo_config` changed, what that does to each optimizer step and epoch, and how to keep a value."""
    message = [
        f"Converted {type(config).__name__} to POISEConfig. A GRPOConfig does not record which values a script set, "
        "so a field holding TRL's default counts as unset and takes POISE's: "
        + (", ".join(changed) or "no field held one")
        + "."
    ]
    before, after = config.num_generations, converted.num_generations
    if before != after:
        completions = config.per_device_train_batch_size * config.gradient_accumulation_steps * config.world_size
        message.append(
            f"Each optimizer step still trains {completions} completions (per_device_train_batch_size x "
            f"gradient_accumulation_steps x {config.world_size} process(es)), now {completions / after:g} prompts x "
            f"{after} rollouts instead of {completions / before:g} x {before}: {before / after:g}x the prompts per "
            f"step, so an epoch takes {before / after:g}x fewer optimizer steps. The learning rate and schedule are "
            "kept."
        )
    message.append(
        "To keep a value (e.g. TRL's G), pass it: POISEConfig.from_grpo_config(config, num_generations=8), or "
        "build a POISEConfig."
    )
    return " ".join(message)


def from_grpo_config(poise: type, config: GRPOConfig, **overrides: Any) -> GRPOConfig:
    """The body of `POISEConfig.from_grpo_config` (its docstring says what it does); `poise` is the class."""
    names = {f.name for f in fields(config) if f.init}
    foreign = sorted(names - {f.name for f in fields(poise)})
    if foreign:
        raise TypeError(f"{type(config).__name__} fields {foreign} have no POISEConfig counterpart.")
    values = {name: getattr(config, name) for name in names}
    # GRPOConfig.__post_init__ fills both of these from whichever was given, and refuses both given: passing the
    # steps alone rebuilds the same pair. Deprecated aliases were already copied to their successors.
    del values["generation_batch_size"]
    if values["steps_per_generation"] == values["gradient_accumulation_steps"]:
        values["steps_per_generation"] = None
    values.update(vllm_importance_sampling_cap=None, use_transformers_paged=False)
    if isinstance(config, poise):
        if config.pca_dims_from_preset:
            values["probe_pca_dims"] = None  # filled in from the preset: filled in (and capped) again
        return poise(**{**values, **overrides})
    changed = []
    for name, (trl_default, poise_default) in changed_defaults(poise).items():
        if name not in overrides and values[name] == trl_default:
            values[name] = poise_default
            changed.append(f"{name} {trl_default!r} -> {poise_default!r}")
    converted = poise(**{**values, **overrides})
    logger.warning(conversion_message(config, converted, changed))
    return converted

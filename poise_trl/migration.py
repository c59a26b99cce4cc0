"""What `POISEConfig.from_grpo_config` tells a user who converts a GRPO script: the fields that took POISE's
defaults and what that does to each optimizer step and epoch."""

from trl import GRPOConfig


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

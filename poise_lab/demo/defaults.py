"""The demo's defaults per kind of model, in a light module: the CLI reads them for `--help` without importing TRL."""

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoDefaults:
    """What a demo run uses where the caller says nothing; the tiny model and a real one need different scales."""

    steps: int
    prompts_per_step: int
    learning_rate: float
    probe_warmup_steps: int
    num_eval: int
    logging_steps: int


# Tiny model, 2 CPU cores: 32 prompts x 2 rollouts per step (8 prompts learn far less per step), lr 1e-4 (3e-4
# collapses the tiny policy to zero reward within 40 steps), 200 steps of about 0.4 s each.
TOY_DEFAULTS = DemoDefaults(
    steps=200, prompts_per_step=32, learning_rate=1e-4, probe_warmup_steps=16, num_eval=140, logging_steps=10
)
# SmolLM2-135M on `arith`, 2 CPU cores, within 15 minutes: measured in docs/real-model.md.
REAL_DEFAULTS = DemoDefaults(
    steps=24, prompts_per_step=16, learning_rate=5e-5, probe_warmup_steps=4, num_eval=96, logging_steps=1
)

"""Switching a TRL script from `GRPOTrainer` to `POISETrainer` in one step: a `GRPOConfig` becomes a `POISEConfig`
that keeps every value the script set and takes POISE's defaults where the script left TRL's."""

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from trl import GRPOConfig

from poise_trl import POISEConfig, POISETrainer
from poise_trl.grpo.migration import changed_defaults

from ..conftest import CPU_ARGS, digit_dataset, digit_reward

# Values a TRL script might set, none of them a default of GRPOConfig or POISEConfig.
USER_VALUES = dict(
    output_dir="grpo-out",
    learning_rate=3e-6,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=4,
    max_completion_length=1024,
    temperature=0.9,
    epsilon=0.25,
    beta=0.01,
    loss_type="grpo",
    num_iterations=2,
    mask_truncated_completions=True,
    top_entropy_quantile=0.5,
    logging_steps=5,
    seed=7,
)


def _grpo(**kwargs) -> GRPOConfig:
    return GRPOConfig(**{**CPU_ARGS, **USER_VALUES, **kwargs})


def _init_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _conversion_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "poise_trl.grpo.migration"]


def test_poise_changes_exactly_the_defaults_its_docstring_names():
    """The docstring and the configuration page say "three defaults"; a new changed default must be named there."""
    assert changed_defaults(POISEConfig) == {
        "num_generations": (8, 2),
        "epsilon_high": (None, 0.28),
        "scale_rewards": ("group", "none"),
    }
    docstring = POISEConfig.__doc__
    assert "changes three defaults" in docstring
    assert all(f"`{name}=" in docstring for name in changed_defaults(POISEConfig))


def test_every_value_the_script_set_survives_and_defaults_become_poise_s(caplog):
    grpo = _grpo()
    with caplog.at_level(logging.WARNING):
        poise = POISEConfig.from_grpo_config(grpo)
    assert type(poise) is POISEConfig
    changed = changed_defaults(POISEConfig)
    for name in _init_fields(GRPOConfig):
        expected = changed[name][1] if name in changed else getattr(grpo, name)
        assert getattr(poise, name) == expected, name
    # POISE's own fields are POISEConfig's defaults.
    fresh = POISEConfig(**{**CPU_ARGS, "output_dir": "x"})
    own = set(_init_fields(POISEConfig)) - set(_init_fields(GRPOConfig))
    assert own and all(getattr(poise, name) == getattr(fresh, name) for name in own)
    # One line, naming each change.
    (line,) = _conversion_lines(caplog)
    assert "num_generations 8 -> 2, epsilon_high None -> 0.28, scale_rewards 'group' -> 'none'" in line
    assert "does not record which values a script set" in line  # why an explicit 8 is listed too
    # 16 x 4 completions per optimizer step on 1 process: 8 prompts x 8 before, 32 x 2 after.
    assert "still trains 64 completions" in line and "now 32 prompts x 2 rollouts instead of 8 x 8" in line
    assert "4x the prompts per step, so an epoch takes 4x fewer optimizer steps" in line
    assert "from_grpo_config(config, num_generations=8)" in line
    # Same completions per step, 4x the prompts: per_device_train_batch_size counts completions.
    assert (poise.per_device_train_batch_size, poise.generation_batch_size) == (16, 64)
    assert poise.generation_batch_size // poise.num_generations == 4 * grpo.generation_batch_size // 8


@pytest.mark.parametrize(
    "batch", [{}, dict(generation_batch_size=128), dict(steps_per_generation=2), dict(steps_per_generation=4)]
)
def test_derived_batch_fields_do_not_conflict(batch):
    """GRPOConfig.__post_init__ fills both generation_batch_size and steps_per_generation, so the naive
    `POISEConfig(**cfg.to_dict())` fails; the conversion rebuilds the same pair."""
    grpo = _grpo(**batch)
    with pytest.raises(ValueError, match="can not be both configured"):
        POISEConfig(**grpo.to_dict())
    poise = POISEConfig.from_grpo_config(grpo)
    assert (poise.generation_batch_size, poise.steps_per_generation) == (
        grpo.generation_batch_size,
        grpo.steps_per_generation,
    )


def test_the_migration_page_quotes_the_warning_its_example_logs(caplog):
    """docs/from-grpo.md shows the warning of its own diff's `GRPOConfig` word for word."""
    page = (Path(__file__).parents[2] / "docs" / "from-grpo.md").read_text()
    (quoted,) = [line for line in page.splitlines() if line.startswith("Converted GRPOConfig")]
    with caplog.at_level(logging.WARNING):
        POISEConfig.from_grpo_config(GRPOConfig(output_dir="Qwen3-0.6B-GRPO", max_completion_length=1024, **CPU_ARGS))
    assert _conversion_lines(caplog) == [quoted]


def test_values_other_than_trl_defaults_are_kept(caplog):
    grpo = _grpo(num_generations=4, epsilon_high=0.3, scale_rewards="batch")
    with caplog.at_level(logging.WARNING):
        poise = POISEConfig.from_grpo_config(grpo)
    assert (poise.num_generations, poise.epsilon_high, poise.scale_rewards) == (4, 0.3, "batch")
    (line,) = _conversion_lines(caplog)
    assert "takes POISE's: no field held one." in line and "optimizer step" not in line  # same G, same steps


def test_g8_becomes_2_unless_kept_explicitly(caplog):
    """A GRPOConfig cannot tell an explicit num_generations=8 from TRL's default: both become 2, as the migration
    page says, and `from_grpo_config(cfg, num_generations=8)` keeps 8."""
    assert POISEConfig.from_grpo_config(_grpo(num_generations=8)).num_generations == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        kept = POISEConfig.from_grpo_config(_grpo(num_generations=8), num_generations=8, probe_layer=-1)
    assert (kept.num_generations, kept.probe_layer, kept.epsilon_high) == (8, -1, 0.28)
    (line,) = _conversion_lines(caplog)
    assert "num_generations 8 -> 2" not in line and "epsilon_high None -> 0.28" in line
    # An explicit scale_rewards="group" is TRL's default too; POISE refuses it when asked for explicitly.
    with pytest.raises(ValueError, match="not supported by POISE"):
        POISEConfig.from_grpo_config(_grpo(), scale_rewards="group")


def test_a_poise_config_converts_without_default_changes(caplog):
    source = POISEConfig(**{**CPU_ARGS, **USER_VALUES, "num_generations": 8, "probe_preset": "paper"})
    with caplog.at_level(logging.WARNING):
        copy = POISEConfig.from_grpo_config(source)
    assert not _conversion_lines(caplog)
    assert all(getattr(copy, name) == getattr(source, name) for name in _init_fields(POISEConfig))
    assert copy.pca_dims_from_preset  # the preset's dims stay capped at a small model's width
    assert not POISEConfig.from_grpo_config(POISEConfig(**{**CPU_ARGS, "probe_pca_dims": [4, 0]})).pca_dims_from_preset


def test_fields_poise_config_lacks_are_refused():
    @dataclass
    class ExperimentalConfig(GRPOConfig):
        geometric_mean: bool = field(default=True)

    with pytest.raises(TypeError, match=r"\['geometric_mean'\] have no POISEConfig counterpart"):
        POISEConfig.from_grpo_config(ExperimentalConfig(**{**CPU_ARGS, "output_dir": "x"}))


def test_trainer_converts_a_grpo_config(tiny_model_path, tmp_path, caplog):
    """`POISETrainer(args=GRPOConfig(...))`: the only change a TRL script needs is the class name."""
    grpo = GRPOConfig(
        **CPU_ARGS, output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=1, max_completion_length=4
    )
    with caplog.at_level(logging.WARNING):
        trainer = POISETrainer(str(tiny_model_path), digit_reward, args=grpo, train_dataset=digit_dataset(8))
    assert type(trainer.args) is POISEConfig and trainer.num_generations == 2
    assert trainer.args.max_completion_length == 4 and trainer.args.scale_rewards == "none"
    assert len(_conversion_lines(caplog)) == 1
    trainer.train()
    assert any("poise/mae" in entry for entry in trainer.state.log_history)

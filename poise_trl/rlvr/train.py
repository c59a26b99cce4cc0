"""`poise-trl train`: POISE's counterpart of `trl grpo`, a reasoning model trained from a YAML recipe.

    accelerate launch --config_file configs/accelerate/zero3.yaml -m poise_trl.cli train \\
        --config configs/poise_qwen3_4b_dapo.yaml

Any field of a recipe can be overridden on the command line, e.g. `--learning_rate 2e-6` or
`--model_name_or_path path/to/model`. The recipe's `trainer` key picks `POISETrainer` with `POISEConfig` or the
baseline's `GRPOTrainer` with `GRPOConfig`, and the recipe is parsed by that config class, so a misspelt or
misplaced key fails at start-up instead of being ignored. Unlike `trl grpo`, the command trains in its own process:
`accelerate launch` starts the processes, as for any script.
"""

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config, get_quantization_config

from poise_trl import POISEConfig, POISETrainer, plugins
from poise_trl.tasks.math_data import dataset_hub_id, load_math_dataset
from poise_trl.tasks.math_reward import math_answer_reward

TRAINERS: dict[str, tuple[type[GRPOTrainer], type[GRPOConfig]]] = {
    "poise": (POISETrainer, POISEConfig),
    "grpo": (GRPOTrainer, GRPOConfig),
}


@dataclass
class ScriptArguments:
    """Which trainer runs and which math dataset it trains on; everything else is the trainer's config."""

    trainer: str = field(
        default="poise",
        metadata={
            "help": "'poise': POISETrainer (cross-rollout probe baseline). 'grpo': trl.GRPOTrainer, the baseline.",
            "choices": list(TRAINERS),
        },
    )
    dataset_name: str = field(
        default="DAPO-Math-17k-en",
        metadata={
            "help": "A `poise_trl.tasks.math_data.BENCHMARKS` key, a Hub dataset id, a local .jsonl/.json/.parquet "
            "file, or a training task registered as an entry point `poise_trl.datasets` (the lab's 'arith': offline "
            "chat arithmetic, with its first-number reward)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    dataset_train_split: str | None = field(
        default=None, metadata={"help": "Split to train on. None: the registry's split, else 'train'."}
    )
    problem_column: str | None = field(
        default=None, metadata={"help": "Column (dotted for nested) holding the problem. None: detected."}
    )
    answer_column: str | None = field(
        default=None, metadata={"help": "Column (dotted for nested) holding the final answer. None: detected."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training rows, for smoke runs."}
    )
    show_traceback: bool = field(
        default=False,
        metadata={"help": "On a rejected setting, show the full traceback instead of one line on stderr."},
    )


def trainer_choice(argv: list[str]) -> str:
    """`--trainer` from the command line, else the recipe's `trainer` key, else 'poise'.

    Needed before the real parse because the trainer decides which config class validates the recipe.
    """
    pre_parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre_parser.add_argument("--config")
    pre_parser.add_argument("--trainer")
    known, _ = pre_parser.parse_known_args(argv)
    if known.trainer is None and known.config is not None:
        with open(known.config) as recipe_file:
            recipe = yaml.safe_load(recipe_file)
        if isinstance(recipe, dict):
            known.trainer = recipe.get("trainer")
    return known.trainer or "poise"


DESCRIPTION = """Train with POISETrainer (or the GRPO/DAPO baseline) from a YAML recipe.

--config RECIPE.yaml  a YAML file whose keys are the options below (e.g. configs/poise_qwen3_4b_dapo.yaml); an
                      `env:` mapping in it sets environment variables. Options given on the command line override
                      the recipe's values.

Start several processes with `accelerate launch [...] -m poise_trl.cli train --config RECIPE.yaml`."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`HfArgumentParser`'s defaults on every option, and the description's line breaks kept."""


def make_parser(trainer: str = "poise", prog: str | None = None) -> TrlParser:
    """The recipe parser: `ScriptArguments`, the trainer's config class and TRL's `ModelConfig`."""
    if trainer not in TRAINERS:
        raise ValueError(f"trainer={trainer!r}: choose one of {list(TRAINERS)}.")
    return TrlParser(
        (ScriptArguments, TRAINERS[trainer][1], ModelConfig),
        prog=prog,
        usage="%(prog)s [-h] [--config RECIPE.yaml] [--FIELD VALUE ...]",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )


def parse_args(
    argv: list[str] | None = None, prog: str | None = None
) -> tuple[ScriptArguments, GRPOConfig, ModelConfig]:
    """Parse `--config recipe.yaml` plus command-line overrides (the command line wins)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return make_parser(trainer_choice(argv), prog).parse_args_and_config(argv)


def main(script_args: ScriptArguments, training_args: GRPOConfig, model_args: ModelConfig) -> GRPOTrainer:
    """Train with the binary math-answer reward (a registered task's own on its name, e.g. the lab's `arith`), then
    save the model and its card (and push them when asked). A registered model name (entry points
    `poise_trl.named_models`, e.g. the lab's `smollm2-135m`) is prepared first."""
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    tasks, models = plugins.registered(plugins.DATASETS), plugins.registered(plugins.MODELS)
    if script_args.dataset_name in tasks:
        dataset, reward = plugins.load(tasks[script_args.dataset_name])(script_args.max_train_samples)
    else:
        dataset, reward = (
            load_math_dataset(
                script_args.dataset_name,
                split=script_args.dataset_train_split,
                config=script_args.dataset_config,
                problem_column=script_args.problem_column,
                answer_column=script_args.answer_column,
                limit=script_args.max_train_samples,
            ),
            math_answer_reward,
        )
    trainer_cls = TRAINERS[script_args.trainer][0]
    model = model_args.model_name_or_path
    if model in models:
        model = str(plugins.load(models[model])(model))
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=training_args,
        train_dataset=dataset,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if trainer.state.global_step == 0:
        raise ValueError(zero_steps_reason(len(dataset), training_args))

    trainer.save_model(training_args.output_dir)
    dataset_id = None if script_args.dataset_name in tasks else dataset_hub_id(script_args.dataset_name)
    trainer.create_model_card(model_name=Path(training_args.output_dir).name, dataset_name=dataset_id)
    trainer.accelerator.print(f"Model and model card saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_id)
        trainer.accelerator.print(f"Model pushed to https://huggingface.co/{trainer.hub_model_id}.")
    trainer.end()  # finish the trackers and free the process group
    return trainer


def zero_steps_reason(rows: int, args: GRPOConfig) -> str:
    """Why a run trained nothing, and what to change; TRL itself finishes such a run without a word."""
    prompts = args.generation_batch_size // args.num_generations
    if rows < prompts:
        return (
            f"trained 0 optimizer steps: the training set ({rows} rows) is too small for one generation batch of "
            f"{prompts} prompts ({args.generation_batch_size} completions / num_generations={args.num_generations}). "
            "Train on more rows, or lower generation_batch_size (or per_device_train_batch_size x "
            "steps_per_generation)."
        )
    return f"trained 0 optimizer steps (max_steps={args.max_steps}, num_train_epochs={args.num_train_epochs})."


def run(argv: list[str] | None = None, prog: str = "poise-trl train", traceback: bool = False) -> int:
    """The command line: train, or print a rejected setting in one line and return 2 (raise with `--show_traceback
    true`, or `traceback`: `poise-trl --debug`)."""
    script_args, training_args, model_args = parse_args(argv, prog)
    try:
        main(script_args, training_args, model_args)
    except ValueError as error:
        if script_args.show_traceback or traceback:
            raise
        print(f"{prog}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0

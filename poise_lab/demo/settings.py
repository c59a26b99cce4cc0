"""What a `poise-trl demo` run uses, typed and frozen: built once from the command line (`DemoSettings.from_args`)
or by a caller, and handed to `run_demo` whole. Light to import (no torch): the CLI builds it."""

import argparse
from dataclasses import dataclass, fields, replace
from pathlib import Path

from poise_lab.tasks.toy import DEFAULT_DIFFICULTIES, DEMO_WARMUP_LR, DEMO_WARMUP_STEPS

from .defaults import REAL_DEFAULTS, TOY_DEFAULTS


@dataclass(frozen=True)
class DemoSettings:
    """A demo run's settings (`poise-trl demo --help` says what each flag does). Fields left at None take the
    defaults of the kind of model (`TOY_DEFAULTS` for the tiny Qwen3, `REAL_DEFAULTS` with `model`)."""

    output_dir: str | Path = "runs/demo"
    """Where the plot, `summary.json`, `trainer_state.json`, the training split and the final model go."""
    model: str | None = None
    """A real model's name (e.g. "smollm2-135m") or a model folder, trained on `arith`; None: the tiny Qwen3."""
    task: str = "sort"
    """The tiny model's task, "sort" or "hops" (ignored with `model`)."""
    steps: int | None = None
    """POISE training steps."""
    seed: int = 0
    """Seed of the task split, the model's initialisation and warm start, training and the held-out samples."""
    min_digits: int = DEFAULT_DIFFICULTIES[0]
    """The easiest sort prompts' digits."""
    max_digits: int = DEFAULT_DIFFICULTIES[1]
    """The hardest sort prompts' digits (at most 9)."""
    num_train: int = 2000
    """Training prompts."""
    num_eval: int | None = None
    """Held-out prompts, never seen in training."""
    eval_k: int = 8
    """Samples per held-out prompt for avg@k, before and after training."""
    warmup_steps: int = DEMO_WARMUP_STEPS
    """Supervised warm-start steps of the tiny model."""
    warmup_lr: float = DEMO_WARMUP_LR
    """The warm start's learning rate."""
    learning_rate: float | None = None
    """POISE's learning rate."""
    num_generations: int = 2
    """Rollouts per prompt (G)."""
    prompts_per_step: int | None = None
    """Prompts per optimisation step."""
    probe_warmup_steps: int | None = None
    """Bootstrap steps before the probe's baselines are used."""
    probe_preset: str | None = None
    """`POISEConfig.probe_preset`, a key of `poise_trl.choices.PROBE_PRESETS`; None: POISEConfig's default preset
    with the demo's scale (its `probe_warmup_steps`). A named preset runs as the preset says: the demo's defaults
    leave the settings it gives alone, so only the ones the caller sets here change it."""
    paper_rules: bool = False
    """The paper's probe input g(φ) and RLOO bootstrap instead of the partner-aware probe and shrunk bootstrap."""
    probe_granularity: str = "sequence"
    """`POISEConfig.probe_granularity`: one baseline per rollout ("sequence") or per token ("prefix")."""
    probe_head: str | None = None
    """`POISEConfig.probe_head`, a key of `poise_trl.heads.heads.HEADS`; None: POISEConfig's default head."""
    probe_history: bool = False
    """`POISEConfig.probe_history`: each prompt's earlier rewards as probe inputs."""
    logging_steps: int | None = None
    """Steps per table row and plot point."""
    cache_dir: str | Path | None = None
    """The warm-started model's cache; None: `$XDG_CACHE_HOME/poise-trl` (a real model's: under `real/`)."""
    show_progress: bool = True
    """A progress bar beside the per-step table."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DemoSettings":
        """The settings of `poise-trl demo`'s parsed arguments."""
        return cls(
            output_dir=args.output_dir,
            model=args.model,
            task=args.task,
            steps=args.steps,
            seed=args.seed,
            min_digits=args.min_digits,
            max_digits=args.max_digits,
            num_train=args.task_size,
            num_eval=args.eval_size,
            eval_k=args.eval_k,
            warmup_steps=args.warmup_steps,
            warmup_lr=args.warmup_lr,
            learning_rate=args.learning_rate,
            num_generations=args.num_generations,
            prompts_per_step=args.prompts_per_step,
            probe_warmup_steps=args.probe_warmup_steps,
            probe_preset=args.probe_preset,
            paper_rules=args.paper_rules,
            probe_granularity=args.probe_granularity,
            probe_head=args.probe_head,
            probe_history=args.probe_history,
            logging_steps=args.logging_steps,
            cache_dir=args.cache_dir,
            show_progress=not args.no_progress,
        )

    def resolved(self) -> "DemoSettings":
        """These settings with every None that has a per-model default replaced by it, except the bootstrap length
        under a named preset (POISEConfig takes the preset's)."""
        defaults = TOY_DEFAULTS if self.model is None else REAL_DEFAULTS
        names = [f.name for f in fields(defaults) if not (self.probe_preset and f.name == "probe_warmup_steps")]
        return replace(self, **{name: getattr(defaults, name) for name in names if getattr(self, name) is None})

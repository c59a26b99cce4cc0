"""The efficiency study's settings, typed and frozen: built once from the parsed arguments (CleanRL's `Args`), then
handed to every function of the study and pickled into its workers as they are.

Each field says what it is to the study (`role`): RUN settings decide a run's result besides its task, contender,
rate and seed, so a results directory holds runs of one value of each (`identity`, checked on every resume); STUDY
settings decide which runs there are; MACHINE settings only how they are run. A field without a role is refused,
and every flag of the parser is a field (tests/lab/bench/test_efficiency.py): a new flag cannot slip out unseen.
"""

import argparse
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .common import ARITH_DATASET, DEMO_LEARNING_RATE, PAPER_LEARNING_RATE, TASK_WARMUP_STEPS, default_jobs

RUN, STUDY, MACHINE = "run", "study", "machine"


def _setting(role: str) -> Any:
    return field(metadata={"role": role})


@dataclass(frozen=True)
class EfficiencySettings:
    """`poise-trl bench efficiency`'s arguments (its `--help` says what each does), dependent defaults resolved."""

    # RUN: a run's result depends on these
    budget: int = _setting(RUN)
    completions_per_step: int = _setting(RUN)
    per_device_batch_size: int | None = _setting(RUN)
    eval_every: int = _setting(RUN)
    eval_k: int = _setting(RUN)
    eval_seed: int = _setting(RUN)
    epsilon: float = _setting(RUN)
    epsilon_high: float = _setting(RUN)
    grpo_scale_rewards: str = _setting(RUN)
    dapo_max_rounds: int = _setting(RUN)
    num_eval: int = _setting(RUN)
    min_digits: int = _setting(RUN)
    max_digits: int = _setting(RUN)
    max_completion_length: int | None = _setting(RUN)
    model: str | None = _setting(RUN)
    train_dataset: str | None = _setting(RUN)
    eval_dataset: str | None = _setting(RUN)
    train_limit: int | None = _setting(RUN)
    eval_limit: int | None = _setting(RUN)
    warmup_steps: int | None = _setting(RUN)  # in the identity per task, resolved (`warmup_steps_of`)
    # STUDY: which runs
    contenders: tuple[str, ...] = _setting(STUDY)
    task: tuple[str, ...] = _setting(STUDY)
    seeds: tuple[int, ...] = _setting(STUDY)
    task_seeds: dict[str, tuple[int, ...]] = _setting(STUDY)
    tune_lr: bool = _setting(STUDY)
    lr_grid: tuple[float, ...] = _setting(STUDY)
    tuning_seeds: tuple[int, ...] = _setting(STUDY)
    max_grid_extensions: int = _setting(STUDY)
    learning_rate: float = _setting(STUDY)
    # MACHINE: how they run
    jobs: int = _setting(MACHINE)
    cpu_threads: int = _setting(MACHINE)
    gradient_checkpointing: bool = _setting(MACHINE)
    eval_batch_size: int = _setting(MACHINE)
    cache_dir: str | None = _setting(MACHINE)
    output_dir: str = _setting(MACHINE)
    allow_mixed_code: bool = _setting(MACHINE)

    def __post_init__(self) -> None:
        unplaced = [f.name for f in fields(self) if f.metadata.get("role") not in (RUN, STUDY, MACHINE)]
        if unplaced:
            raise TypeError(f"EfficiencySettings fields without a role (run, study or machine): {unplaced}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EfficiencySettings":
        """The settings of parsed arguments, sequences as tuples and the dependent defaults resolved: the learning
        rate and gradient checkpointing by model, the parallel jobs (one run at a time on a real model's GPU)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
        values["task_seeds"] = {task: tuple(seeds) for task, seeds in dict(values["task_seeds"]).items()}
        real = values["model"] is not None
        if values["learning_rate"] is None:
            values["learning_rate"] = PAPER_LEARNING_RATE if real else DEMO_LEARNING_RATE
        if values["gradient_checkpointing"] is None:
            values["gradient_checkpointing"] = real  # a real model's activations need it (OOM otherwise)
        if values["jobs"] is None:
            values["jobs"] = 1 if real else default_jobs()
        return cls(**values)

    @property
    def tasks(self) -> list[str]:
        """The offline tasks, or with `--model` one task named after its training data (`arith`) or "model"."""
        if self.model is None:
            return list(self.task)
        return [ARITH_DATASET] if self.train_dataset == ARITH_DATASET else ["model"]

    def eval_seeds(self, task: str) -> list[int]:
        return list(self.task_seeds.get(task, self.seeds))

    def warmup_steps_of(self, task: str) -> int:
        """The task's supervised warm-up steps: `--warmup-steps` if given, else the task's default."""
        return self.warmup_steps if self.warmup_steps is not None else TASK_WARMUP_STEPS[task]

    def identity(self) -> dict[str, Any]:
        """What a run's result depends on besides (task, contender, rate, seed): every RUN setting, the warm-up
        steps per demo task."""
        roles = {f.name: f.metadata["role"] for f in fields(self)}
        identity = {name: value for name, value in asdict(self).items() if roles[name] == RUN}
        identity["warmup_steps"] = {task: self.warmup_steps_of(task) for task in self.tasks if self.model is None}
        return identity

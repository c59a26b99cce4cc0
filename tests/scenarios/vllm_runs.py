"""What the real-vLLM scenarios share (colocate: test_vllm.py; server: test_vllm_server.py): the task, the training
settings, and the checks of POISE's own behaviour, which do not depend on where vLLM runs."""

import math
from pathlib import Path
from typing import Any

from datasets import Dataset

from poise_trl import POISEConfig, POISETrainer

from ..conftest import CPU_ARGS

STEPS = 2


def variety_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    """Dense and continuous (the share of distinct characters), so every group's rewards spread."""
    texts = [completion[0]["content"] for completion in completions]
    return [len(set(text)) / max(len(text), 1) for text in texts]


def addition_prompts() -> Dataset:
    pairs = [(3, 4), (12, 9), (7, 15), (21, 6), (5, 5), (30, 11), (8, 2), (14, 14)]
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}]} for a, b in pairs])


def vllm_args(output_dir: Path, **vllm: Any) -> POISEConfig:
    """`STEPS` CPU steps of 2 prompts x 4 rollouts, at most 16 tokens, the probe trusted from step 2; `vllm` says where
    vLLM runs (`vllm_mode` and its settings)."""
    return POISEConfig(
        output_dir=str(output_dir),
        use_vllm=True,
        per_device_train_batch_size=8,
        num_generations=4,
        max_steps=STEPS,
        max_completion_length=16,
        learning_rate=1e-4,
        logging_steps=1,
        probe_warmup_steps=1,
        seed=0,
        **CPU_ARGS,
        **vllm,
    )


def logged(trainer: POISETrainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def assert_captured_in_trls_pass(trainer: POISETrainer) -> None:
    """vLLM's importance-sampling correction (on by default) makes TRL run its old-log-prob pass; POISE captures its
    features inside it, with no pass of its own, and observes every step."""
    assert trainer.vllm_importance_sampling_correction and trainer._trl_runs_old_logps_pass()
    assert trainer.feature_passes == 0
    assert trainer.estimator.steps_ == STEPS


def assert_poise_metrics_finite(trainer: POISETrainer) -> None:
    """Every `poise/*` value logged is finite: an undefined one (the probe's value before it is trusted, a correlation
    when the step's baselines tie) is left out of that step's log, never logged as None. Those defined whenever
    rewards spread are logged at step 2, where the probe gives the baselines."""
    steps = [
        {key: value for key, value in entry.items() if key.startswith("poise/")}
        for entry in trainer.state.log_history
        if any(key.startswith("poise/") for key in entry)
    ]
    assert len(steps) == STEPS, steps
    assert {key: value for step in steps for key, value in step.items() if not _finite(value)} == {}
    defined = ["reward_mean", "value_mean", "baseline_mean", "mae", "variance_reduction", "bootstrap", "buffer_size"]
    assert [name for name in defined if f"poise/{name}" not in steps[1]] == []
    assert steps[0]["poise/bootstrap"] == 1.0 and steps[1]["poise/bootstrap"] < 1.0  # the probe took over


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)

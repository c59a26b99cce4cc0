"""Shared fixtures: a tiny local Qwen3 and character tokenizer (no hub), CPU-only TRL settings, and the short
training setting most trainer tests start from; `--without-lab` runs the tests with `poise_lab` unimportable.

The library's tests build their models with `poise_trl.tiny` and import nothing of the lab; the lab's tests sit in
`tests/lab/` and, with the docs' tests (`tests/docs/`, which run the lab's commands), in `make test`'s second pytest
step. The fixtures that prepare the lab's models (`demo_cache`, `real_model_path`) import it when a test asks.
"""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset

from poise_trl.tiny import save_tiny

from .without_lab import block_the_lab


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--without-lab",
        action="store_true",
        help="make poise_lab unimportable, as in an install without the lab (make test: the library's tests)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--without-lab"):
        block_the_lab()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker per core (`make test`): one thread each, none oversubscribed
        torch.set_num_threads(1)


CPU_ARGS = dict(
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    save_strategy="no",
    log_completions=False,
    disable_tqdm=True,
)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A saved 4-layer, hidden-128 Qwen3 with a character tokenizer; `</think>` is one token."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


def digit_dataset(n: int = 64) -> Dataset:
    return Dataset.from_list([{"prompt": f"{i % 10}{(3 * i) % 10}+{i % 7}"} for i in range(n)])


def digit_reward(completions: list[str], **kwargs) -> list[float]:
    """A dense, deterministic reward so advantages are rarely zero on an untrained model."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def short_args(tmp_path: Path, **overrides: Any):
    """A 2-step CPU `POISEConfig` of 2 prompts x 2 rollouts with the library's default probe, trusted from the second
    step: the drop-in scenarios check that POISE's advantages reach the loss, not how well it learns."""
    from poise_trl import POISEConfig

    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        max_completion_length=6,
        learning_rate=1e-2,
        logging_steps=1,
        probe_warmup_steps=1,
        seed=0,
    )
    return POISEConfig(**{**CPU_ARGS, **base, **overrides})


def poise_args(tmp_path: Path, **overrides: Any):
    """A 4-step CPU `POISEConfig` of 4 prompts x 2 rollouts with the paper's probe and RLOO bootstrap (no
    partner-aware probe, no shrinkage), trusted after 1 step."""
    paper = dict(
        per_device_train_batch_size=8,
        max_steps=4,
        learning_rate=1e-3,
        probe_preset="paper",
        probe_partner_reward=False,
        probe_bootstrap="rloo",
    )
    return short_args(tmp_path, **{**paper, **overrides})


def spy_batch_advantages(trainer: Any, monkeypatch: Any, record: Callable[[tuple, dict, Any], None]) -> None:
    """Call `record(args, kwargs, result)` for each generation batch's call of `trainer.estimator.advantages`: the
    one the trainer makes when it observes the batch, whichever capture route gave the features (on the loss route
    each micro-batch's own call comes first and is not recorded)."""
    advantages, observe, observing = trainer.estimator.advantages, trainer._observe, []

    def recorded(*args, **kwargs):
        result = advantages(*args, **kwargs)
        if observing:
            record(args, kwargs, result)
        return result

    def observed(step):
        observing.append(True)
        try:
            return observe(step)
        finally:
            observing.pop()

    monkeypatch.setattr(trainer.estimator, "advantages", recorded)
    monkeypatch.setattr(trainer, "_observe", observed)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    """An `$XDG_CACHE_HOME` holding the demo's warm-started model as `make demo` leaves it, built once per session;
    tests set the variable to it, so user-facing code that reuses the demo's cache finds the model there."""
    from poise_lab.models.toy import prepare_demo_model

    xdg_cache_home = tmp_path_factory.mktemp("xdg_cache")
    prepare_demo_model(xdg_cache_home / "poise-trl")
    return xdg_cache_home


@pytest.fixture(scope="session")
def real_model_path(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct from its PyPI package, converted once per session (about 20 s on 2 cores) into a temporary
    cache; `make test` installs the package."""
    from poise_lab.models.real import prepare_real_model

    return prepare_real_model("smollm2-135m", tmp_path_factory.mktemp("real"))

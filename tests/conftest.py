"""Shared fixtures: a tiny local Qwen3 and character tokenizer (no hub), and CPU-only TRL settings."""

from pathlib import Path

import pytest

from poise_trl.tiny import save_tiny

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

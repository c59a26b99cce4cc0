"""`probe_preset="reference"` is the POISE authors' reference implementation step by step: the estimator that
`POISEConfig(probe_preset="reference")` sets up, driven through `advantages`/`observe` on the batches the reference's
probe bank saw (tests/fixtures/reference/README.md), gives every step's advantages within 1e-5 (the 16 bootstrap steps
exactly r_i - r_partner) and its final probe's held-out predictions within 1e-5; and a training step of
`POISETrainer` with the preset runs the reference's schedule on the features it extracts."""

from pathlib import Path

import numpy as np
import pytest
import torch

from poise_trl import POISEConfig, POISETrainer
from poise_trl.estimator.estimator import POISEEstimator, Rollouts

from ..conftest import CPU_ARGS, digit_dataset, poise_args

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "reference"
FILES = ("plain", "massive")
STEPS, BOOTSTRAP, WIDTH = 24, 16, 72  # the reference's training steps, bootstrap steps and hidden width
SETUPS = {  # the fixture's bank holds one configured domain, math: as one probe, or named by a domain column
    "one probe": ({}, None),
    "the math domain": ({"probe_domain_column": "data_source", "probe_domain_buffer_sizes": {"math": 4096}}, "math"),
}


def reference_config(**overrides) -> POISEConfig:
    return POISEConfig(
        output_dir="unused", per_device_train_batch_size=4, probe_preset="reference", **{**CPU_ARGS, **overrides}
    )


def _load(name: str) -> dict[str, torch.Tensor]:
    """One file's batches as the preset's rows lay them out, [prompt block | reasoning block | the 3 scalars]."""
    data = np.load(FIXTURES / f"probe_steps_{name}.npz")

    def rows(prefix: str) -> torch.Tensor:
        return torch.from_numpy(
            np.concatenate([data[f"{prefix}{part}"] for part in ("prompt", "response", "scalars")], -1)
        )

    return {
        "rows": rows(""),
        "rewards": torch.from_numpy(data["rewards"]),
        "advantages": torch.from_numpy(data["advantages"]),
        "heldout": rows("heldout_"),
        "heldout_prediction": torch.from_numpy(data["heldout_prediction"]),
    }


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("name", FILES)
def test_the_reference_preset_gives_the_references_advantages_at_every_step_and_its_probe(name, setup):
    overrides, domain = SETUPS[setup]
    data = _load(name)
    estimator = POISEEstimator.from_config(reference_config(**overrides), num_layers=4, hidden_size=WIDTH)
    assert estimator.row.appended == 0 and data["rows"].size(-1) == 2 * WIDTH + 3  # φ alone: no partner reward
    rows = data["rows"].size(1)
    domains = None if domain is None else [domain] * rows
    for step in range(STEPS):
        rewards = data["rewards"][step]
        result = estimator.advantages(data["rows"][step], Rollouts(rewards, domains=domains))
        if step < BOOTSTRAP:  # the partner's reward, exactly, and no probe fitted yet
            partners = rewards.view(-1, 2).flip(-1).flatten()
            assert torch.equal(result.advantages, rewards - partners)
            assert torch.equal(result.advantages, data["advantages"][step])
            assert not any(online.probe.is_fitted for online in estimator.probes_.values())
        torch.testing.assert_close(result.advantages, data["advantages"][step], atol=1e-5, rtol=0)
        assert result.metrics()["bootstrap"] == float(step < BOOTSTRAP)
        metrics = estimator.observe(result)
        assert metrics["probe_fit_seconds"] > 0 if step >= BOOTSTRAP - 1 else metrics["probe_fit_seconds"] == 0
    heldout = Rollouts(torch.zeros(rows), domains=domains)
    predicted = estimator.predict(data["heldout"], heldout)
    torch.testing.assert_close(predicted, data["heldout_prediction"], atol=1e-5, rtol=0)


def test_a_training_step_with_the_reference_preset_runs_its_schedule(tiny_model_path, tmp_path):
    """POISETrainer with the preset (its text scalars decoded by the trainer's tokenizer): no probe during the one
    bootstrap step, the reference's probe after it, and the model card names the preset and what the run changed."""
    args = poise_args(tmp_path, probe_preset="reference", max_steps=2)
    assert args.preset_changes() == {"probe_warmup_steps": (16, 1)}
    trainer = POISETrainer(str(tiny_model_path), _unit_reward, args=args, train_dataset=digit_dataset())
    assert trainer.estimator.spec.buffer.schedule == "global" and trainer.estimator.spec.head.name == "pca_ridge"
    trainer.train()
    logged = [log for log in trainer.state.log_history if "poise/bootstrap" in log]
    assert [log["poise/bootstrap"] for log in logged] == [1.0, 0.0]
    assert all(np.isfinite(log["poise/mae"]) for log in logged)
    trainer.create_model_card(model_name="tiny-poise")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Probe preset: reference (probe_alpha=100.0, probe_pca_dims=[32, 64]" in card
    assert "Changed from probe_preset='reference': probe_warmup_steps=1 (the preset's: 16)" in card


def _unit_reward(completions: list[str], **kwargs) -> list[float]:
    """A reward in [0, 1], as the reference preset requires."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def test_the_trainer_refuses_data_whose_routed_domains_are_not_the_listed_ones():
    """With a domain column, the preset's buffers list math, code and other, each fitted at the end of the bootstrap:
    a dataset that lacks one, or holds another, is refused when the trainer is built, not 16 steps later."""
    from datasets import Dataset

    from poise_trl.grpo.validation import check_dataset_size

    config = reference_config(probe_domain_column="data_source")
    sources = ["math__aime", "openai/gsm8k", "codegen__taco", "stem_web"]  # math, math, code, other
    check_dataset_size(Dataset.from_dict({"prompt": ["x"] * 4, "data_source": sources}), 2, config)
    with pytest.raises(ValueError, match=r"holds the domains \['code', 'math'\] .* the data lacks \['other'\]"):
        check_dataset_size(Dataset.from_dict({"prompt": ["x"] * 3, "data_source": sources[:3]}), 2, config)
    listed = reference_config(probe_domain_column="data_source", probe_domain_buffer_sizes={"math": 4096})
    with pytest.raises(ValueError, match=r"it does not list \['code', 'other'\]"):
        check_dataset_size(Dataset.from_dict({"prompt": ["x"] * 4, "data_source": sources}), 2, listed)

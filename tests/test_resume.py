"""Resuming in a later epoch or from the final checkpoint ends where the uninterrupted run ends, bit for bit on CPU.

Plain `GRPOTrainer` does not (measured, 64 prompts, 8 per step, 10 steps): a resume in the second epoch trains on the
first epoch's prompt order (TRL's `RepeatSampler` draws each epoch's permutation from one generator seeded once), and a
resume from the final checkpoint runs an eleventh step. `ResumableSampler` fixes both.
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerState
from trl.trainer.utils import RepeatSampler

from poise_trl import POISETrainer
from poise_trl.grpo.resume import ResumableSampler

from .conftest import digit_dataset, digit_reward, poise_args


def _repeat_sampler() -> RepeatSampler:
    return RepeatSampler(range(10), mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=True, seed=5)


def test_resumable_sampler_shuffles_each_epoch_as_trls_sampler_does_uninterrupted():
    uninterrupted = _repeat_sampler()
    passes = [list(uninterrupted) for _ in range(3)]  # TRL's order in epochs 0, 1, 2
    assert passes[0] != passes[1] != passes[2]
    for epoch in (2, 0, 1):  # a fresh sampler per resume, in any order
        state = TrainerState(epoch=epoch + 0.25, global_step=3, max_steps=10)
        assert list(ResumableSampler(_repeat_sampler(), lambda state=state: state)) == passes[epoch]
    finished = TrainerState(epoch=1.25, global_step=10, max_steps=10)
    sampler = ResumableSampler(_repeat_sampler(), lambda: finished)
    assert list(sampler) == [] and len(sampler) == len(passes[0]) and isinstance(sampler, RepeatSampler)


def _trainer(model: Path, out: Path) -> POISETrainer:
    # 16 prompts, 4 per step: an epoch is 4 steps, so 6 steps cross one epoch boundary.
    args = poise_args(out, max_steps=6, save_strategy="steps", save_steps=1, learning_rate=1e-2)
    return POISETrainer(str(model), digit_reward, args=args, train_dataset=digit_dataset(16))


def _final_state(trainer: POISETrainer, out: Path) -> dict[str, torch.Tensor]:
    trainer.save_probe(out / "probe.safetensors")
    probe = {f"probe.{k}": v for k, v in load_file(out / "probe.safetensors").items()}
    return {**{k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, **probe}


@pytest.mark.slow
def test_resume_in_a_later_epoch_or_from_the_final_checkpoint_matches_the_uninterrupted_run(tiny_model_path, tmp_path):
    full = _trainer(tiny_model_path, tmp_path / "full")
    full.train()
    reference = _final_state(full, tmp_path / "full")
    first_epoch = full.get_train_dataloader()
    assert len(first_epoch) == 4
    for checkpoint in (4, 5, 6):  # the epoch boundary, mid second epoch, the final checkpoint
        out = tmp_path / f"resume{checkpoint}"
        name = f"checkpoint-{checkpoint}"
        shutil.copytree(tmp_path / "full" / "out" / name, out / "out" / name)
        resumed = _trainer(tiny_model_path, out)
        resumed.train(resume_from_checkpoint=str(out / "out" / name))
        assert resumed.state.global_step == 6
        assert sorted(p.name for p in (out / "out").glob("checkpoint-*"))[-1] == "checkpoint-6"  # no 7th step
        state = _final_state(resumed, out)
        assert state.keys() == reference.keys()
        different = [k for k in reference if not torch.equal(state[k], reference[k])]
        assert not different, f"resumed from {name}: {different[:5]} differ from the uninterrupted run"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [dict(steps_per_generation=2), dict(num_iterations=2)], ids=lambda s: str(s))
def test_resume_inside_a_generation_batch_matches_the_uninterrupted_run(tiny_model_path, tmp_path, schedule):
    """A checkpoint inside a generation batch keeps the batch TRL has not trained on yet (TRL holds it outside its
    checkpoint), so the resumed run trains on it instead of generating a new one that the probe would observe."""

    def trainer(out: Path) -> POISETrainer:
        args = poise_args(out, max_steps=4, save_strategy="steps", save_steps=1, learning_rate=1e-2, **schedule)
        return POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset(16))

    full = trainer(tmp_path / "full")
    full.train()
    reference = _final_state(full, tmp_path / "full")
    for checkpoint in (1, 2, 3):  # inside, at the end of, and inside the second generation batch
        out, name = tmp_path / f"resume{checkpoint}", f"checkpoint-{checkpoint}"
        shutil.copytree(tmp_path / "full" / "out" / name, out / "out" / name)
        resumed = trainer(out)
        resumed.train(resume_from_checkpoint=str(out / "out" / name))
        state = _final_state(resumed, out)
        different = [k for k in reference if not torch.equal(state[k], reference[k])]
        assert not different, f"resumed from {name}: {different[:5]} differ from the uninterrupted run"

"""Exact resumes: what a POISE checkpoint holds besides transformers' files, and what a resumed run needs to see the
prompts and batches an uninterrupted run would.

- The estimator's one file (`ESTIMATOR_FILE`, or poise-trl 0.1's `LEGACY_FILES`), written beside the weights wherever
  transformers saves the model (`save_model`): in a checkpoint before `trainer_state.json`, so a checkpoint whose
  trainer state parses is complete (`newest_complete_checkpoint`); in a saved model's folder, which `probe_init_path`
  takes (`estimator_file`).
- A checkpoint inside a generation batch keeps each process's slices not yet trained on (`GENERATION_FILE`), which
  TRL holds outside its checkpoint.
- `ResumableSampler` makes a resumed run's `RepeatSampler` shuffle each epoch as the uninterrupted one did.

Like trainer.py it knows TRL and transformers internals; trainer.py's checkpoint overrides call it, nothing else does.
"""

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.trainer.utils import RepeatSampler

from ..estimator.files import atomic_save

if TYPE_CHECKING:
    from ..estimator.estimator import POISEEstimator

ESTIMATOR_FILE = "poise_estimator.safetensors"  # a checkpoint's POISE state: `POISEEstimator.save`
LEGACY_FILES = ("poise_probe.safetensors", "poise_bootstrap.safetensors")  # poise-trl 0.1's checkpoint files
GENERATION_FILE = "poise_generation_batch-{rank}.safetensors"  # a checkpoint inside a generation batch: TRL's slices


class ResumableSampler(RepeatSampler):
    """TRL's `RepeatSampler` as TRL built it, made to resume where an uninterrupted run would be. A run that resumes
    takes it (`POISETrainer._get_train_sampler`); an uninterrupted one keeps TRL's sampler, which this one matches.

    - TRL's sampler draws epoch e's permutation as the (e+1)-th from one generator seeded once, so the fresh sampler
      of a resumed run would shuffle epoch e like epoch 0: a resume in any epoch after the first would train on
      other prompts. Each pass rewinds the generator to epoch e first (transformers' `set_epoch` does not reach the
      sampler on every path).
    - A finished run (global step >= max steps) yields nothing: transformers would otherwise run one extra step when
      resumed from its final checkpoint in mid-epoch."""

    def __init__(self, sampler: RepeatSampler, state: Callable[[], TrainerState]):
        vars(self).update(vars(sampler))  # everything TRL set, unchanged
        self.state = state

    def __iter__(self) -> Iterator[int]:
        state = self.state()
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            return iter(())
        if self.shuffle and self.seed is not None:
            self.generator.manual_seed(self.seed)
            for _ in range(int(state.epoch)):
                torch.randperm(self.num_samples, generator=self.generator)
        return super().__iter__()


def newest_complete_checkpoint(output_dir: str | Path, prefix: str = PREFIX_CHECKPOINT_DIR) -> str | None:
    """The newest `prefix-N` folder whose `trainer_state.json` (the last file transformers writes) parses: a save
    killed before the end leaves a newer folder that is not a checkpoint."""
    steps = []
    for folder in Path(output_dir).glob(f"{prefix}-*"):
        try:
            json.loads((folder / "trainer_state.json").read_text())
            steps.append((int(folder.name.rsplit("-", 1)[1]), folder))
        except (FileNotFoundError, ValueError):
            continue
    return str(max(steps)[1]) if steps else None


def save_batches(batches: list[dict[str, Any]], path: str | Path, step: int) -> bool:
    """Write a list of batches (dicts of tensors or None) and a step counter atomically; False, and nothing written,
    when a batch holds anything else (lists of images), which safetensors cannot store without pickle."""
    tensors, missing = {}, []
    for i, batch in enumerate(batches):
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{i}.{key}"] = value.detach().cpu().clone()  # slices share storage: one copy each
            elif value is None:
                missing.append(f"{i}.{key}")
            else:
                return False
    atomic_save(tensors, path, {"poise": json.dumps({"step": step, "batches": len(batches), "none": missing})})
    return True


def load_batches(path: str | Path, device: torch.device | str | None = None) -> tuple[list[dict[str, Any]], int]:
    """Inverse of `save_batches`: (batches, step), the tensors on `device`."""
    with safe_open(str(path), framework="pt") as f:
        info = json.loads(f.metadata()["poise"])
    batches: list[dict[str, Any]] = [{} for _ in range(info["batches"])]
    for name, tensor in load_file(str(path), device="cpu").items():
        index, key = name.split(".", 1)
        batches[int(index)][key] = tensor if device is None else tensor.to(device)
    for name in info["none"]:
        index, key = name.split(".", 1)
        batches[int(index)][key] = None
    return batches, int(info["step"])


def save_generation_batch(folder: Path, rank: int, batches: list[dict[str, Any]], step: int) -> None:
    """Keep this process's slices of the generation batch still to train on (TRL's `_buffered_inputs`, at micro-step
    `step`); warn when safetensors cannot store them, so the resumed run generates a new batch."""
    if not save_batches(batches, folder / GENERATION_FILE.format(rank=rank), step):
        warnings.warn(
            f"{folder.name} falls inside a generation batch whose inputs safetensors cannot store (non-tensor "
            "values, e.g. images): a run resumed from it generates a new batch. Save at multiples of "
            "steps_per_generation x num_iterations steps to resume exactly.",
            stacklevel=3,
        )


def load_generation_batch(
    folder: Path, rank: int, device: torch.device | str
) -> tuple[list[dict[str, Any]], int] | None:
    """(slices, micro-step) this process kept when the checkpoint fell inside a generation batch; None otherwise."""
    path = folder / GENERATION_FILE.format(rank=rank)
    return load_batches(path, device) if path.exists() else None


def estimator_file(path: str | Path) -> Path:
    """The estimator file `probe_init_path` names: the file itself, or the one a folder holds (a folder
    `save_model` wrote, a checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        return path
    if not (path / ESTIMATOR_FILE).exists():
        raise FileNotFoundError(
            f"probe_init_path={str(path)!r} is a folder without {ESTIMATOR_FILE}: give a folder `trainer.save_model` "
            "or a checkpoint wrote, or a file `trainer.save_probe` wrote."
        )
    return path / ESTIMATOR_FILE


def load_estimator(folder: Path, estimator: "POISEEstimator", device: torch.device | str) -> None:
    """Restore the estimator from a checkpoint's file (or poise-trl 0.1's two); warn, and start afresh, without one."""
    if (folder / ESTIMATOR_FILE).exists():
        estimator.load(folder / ESTIMATOR_FILE, device=device)
    elif (folder / LEGACY_FILES[0]).exists():
        estimator.load(folder / LEGACY_FILES[0], bootstrap_path=folder / LEGACY_FILES[1], device=device)
    else:
        warnings.warn(
            f"Resuming from {folder}, which holds no POISE state ({ESTIMATOR_FILE}): the probe, its buffer "
            "and the bootstrap start from scratch, as in a new run.",
            stacklevel=3,
        )

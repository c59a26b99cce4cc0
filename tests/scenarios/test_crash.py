"""Crash safety: SIGKILL a POISE run between the micro-batches of a step (POISE's record of the generation batch half
captured), at the end of a step and while it writes a checkpoint, resume each time from the newest complete
checkpoint, and end with the estimator and model of an uninterrupted run, bit for bit on CPU."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from poise_trl.grpo.trainer import ESTIMATOR_FILE

ROOT = Path(__file__).parents[2]
CHILD = Path(__file__).parent / "crash" / "train_child.py"


def _child(model: Path, output: Path, result: Path, checkpoint: Path | str | None = None, pause: str | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("POISE_TEST_PAUSE", None)
    if pause:
        env["POISE_TEST_PAUSE"] = pause
    command = [sys.executable, str(CHILD), str(model), str(output), str(result)] + (
        [str(checkpoint)] * bool(checkpoint)
    )
    result.mkdir(parents=True, exist_ok=True)
    log = (result / "log.txt").open("w")  # a file, not a pipe: a full pipe would stall the child
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), result / "log.txt"


def _finish(process: subprocess.Popen, log: Path) -> None:
    assert process.wait(timeout=300) == 0, log.read_text()[-3000:]


def _kill_when_paused(process: subprocess.Popen, log: Path, result: Path) -> None:
    deadline = time.monotonic() + 300
    while not (result / "paused").exists():
        assert process.poll() is None, f"the run ended before its pause:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the run never reached its pause"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL


def _complete(folder: Path) -> bool:
    """transformers writes `trainer_state.json` last (and not atomically): a checkpoint is complete when it parses."""
    try:
        json.loads((folder / "trainer_state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return True


def _checkpoints(output: Path) -> dict[int, bool]:
    """{step: complete} for every checkpoint folder of the run."""
    folders = (output / "out").glob("checkpoint-*")
    return {int(f.name.split("-")[1]): _complete(f) for f in folders}


def _newest_complete(output: Path) -> Path:
    step = max(s for s, complete in _checkpoints(output).items() if complete)
    return output / "out" / f"checkpoint-{step}"


def _state(result: Path) -> tuple[dict[str, torch.Tensor], str, dict[str, torch.Tensor]]:
    with safe_open(str(result / "estimator.safetensors"), framework="pt") as f:
        info = f.metadata()["poise"]
    return load_file(result / "estimator.safetensors"), info, load_file(result / "model.safetensors")


@pytest.mark.slow
def test_sigkill_mid_step_and_mid_save_then_resume_ends_as_the_uninterrupted_run(tiny_model_path, tmp_path):
    output = tmp_path / "run"
    reference = _child(tiny_model_path, tmp_path / "reference", tmp_path / "reference_result")
    crash = _child(tiny_model_path, output, tmp_path / "crash0", pause="micro:2")
    _kill_when_paused(*crash, tmp_path / "crash0")
    assert _checkpoints(output) == {1: True}  # killed between step 2's micro-batches

    crash = _child(tiny_model_path, output, tmp_path / "crash1", _newest_complete(output), pause="step:3")
    _kill_when_paused(*crash, tmp_path / "crash1")
    assert _checkpoints(output) == {1: True, 2: True}  # killed in step 3, before its checkpoint

    crash = _child(tiny_model_path, output, tmp_path / "crash2", _newest_complete(output), pause="save:4")
    _kill_when_paused(*crash, tmp_path / "crash2")
    assert _checkpoints(output) == {1: True, 2: True, 3: True, 4: False}  # checkpoint-4 torn: no trainer_state
    assert (output / "out" / "checkpoint-4" / ESTIMATOR_FILE).exists()  # POISE's file alone is no checkpoint

    # checkpoint-3 ends the first epoch (3 steps of 4 prompts out of 12): the resume crosses an epoch boundary too.
    # resume_from_checkpoint=True must pass over the torn checkpoint-4 to checkpoint-3.
    assert _newest_complete(output).name == "checkpoint-3"
    final = _child(tiny_model_path, output, tmp_path / "final", "latest")
    _finish(*reference)
    _finish(*final)
    assert all(_checkpoints(output).values()) and max(_checkpoints(output)) == 5
    expected, got = _state(tmp_path / "reference_result"), _state(tmp_path / "final")
    assert got[1] == expected[1]  # the estimator's JSON: steps, layer, reward std, bootstrap, domains
    for mine, theirs in ((got[0], expected[0]), (got[2], expected[2])):
        assert mine.keys() == theirs.keys()
        different = [k for k in theirs if not torch.equal(mine[k], theirs[k])]
        assert not different, f"{different[:5]} differ from the uninterrupted run"

"""A POISE run that saves every step, for tests/scenarios/test_crash.py to kill with SIGKILL (never imported by the
package).

    python tests/scenarios/crash/train_child.py MODEL OUTPUT_DIR RESULT_DIR [CHECKPOINT | latest]

`POISE_TEST_PAUSE` makes the run stop at one moment, touch `RESULT_DIR/paused` and sleep until it is killed:
- `micro:N`: in step N between its two micro-batches: the first trained, POISE's record of the generation batch
  holding its features, the second not yet run;
- `step:N`: in step N after POISE learned from its batch and the loss was backpropagated, before the optimizer step;
- `save:N`: while checkpoint-N is written, after the model and POISE's file, before the optimizer and
  `trainer_state.json`.
A run that ends writes the estimator (`trainer.save_probe`) and the model's parameters to RESULT_DIR.
"""

import os
import sys
import time
from pathlib import Path

from safetensors.torch import save_file
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from poise_trl import POISETrainer
from tests.conftest import digit_dataset, digit_reward, short_args

MODEL, OUTPUT, RESULT = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
CHECKPOINT = sys.argv[4] if len(sys.argv) > 4 else None
MOMENT, _, PAUSE_STEP = os.environ.get("POISE_TEST_PAUSE", ":0").partition(":")
STEPS = 5


def pause() -> None:
    (RESULT / "paused").touch()
    time.sleep(600)


class MidStepPause(TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        if MOMENT == "micro" and state.global_step + 1 == int(PAUSE_STEP):
            pause()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if MOMENT == "step" and state.global_step + 1 == int(PAUSE_STEP):
            pause()


class Child(POISETrainer):
    def _save_optimizer_and_scheduler(self, output_dir):
        if MOMENT == "save" and self.state.global_step == int(PAUSE_STEP):
            pause()
        super()._save_optimizer_and_scheduler(output_dir)


# 12 prompts, 4 per step in two micro-batches: an epoch is 3 steps, so resuming from checkpoint-3 crosses an epoch
# boundary. TRL runs no log-prob pass: POISE reads its features from each micro-batch's loss forward.
args = short_args(
    OUTPUT,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=STEPS,
    save_strategy="steps",
    save_steps=1,
)
trainer = Child(MODEL, digit_reward, args=args, train_dataset=digit_dataset(12), callbacks=[MidStepPause()])
assert trainer._capture_route("train") == "loss" and trainer._regroups("train")
trainer.remove_callback(PrinterCallback)
RESULT.mkdir(parents=True, exist_ok=True)
trainer.train(resume_from_checkpoint=True if CHECKPOINT == "latest" else CHECKPOINT)
trainer.save_probe(RESULT / "estimator.safetensors")
save_file({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, RESULT / "model.safetensors")

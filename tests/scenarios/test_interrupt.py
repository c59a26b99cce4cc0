"""Pressing stop in a notebook, then running again: a `train()` interrupted at any point (generation, a reward
function, between micro-batches, inside the loss, during a save; a KeyboardInterrupt or an exception) leaves nothing
stale, and the next `train()` or `evaluate()` trains and evaluates on finite advantages, on every capture route.

TRL keeps a generation batch's untrained micro-batches across `train()` calls; on the loss route their advantages
are written by each micro-batch's own forward, so a leftover micro-batch once reached the loss with its NaN
placeholder and the weights turned NaN."""

import math

import pytest
import torch

from poise_trl import POISETrainer
from poise_trl.grpo.contract import ContractError

from ..conftest import digit_dataset, digit_reward, short_args

# Three generation batches of two micro-batches each (two optimizer steps per batch where TRL runs its pass).
ROUTES = {
    "loss": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "own_pass": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, probe_capture="pass"),
    "trl_pass": dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=2),
}
POINTS = ("generation", "reward", "between micro-batches", "inside the loss", "saving")


class Stop(KeyboardInterrupt):
    """The notebook's stop button."""


class Interrupted(POISETrainer):
    """Raises `error` once, at `point` of the second generation batch; records what every micro-batch's loss read."""

    def arm(self, point: str, error: type[BaseException]) -> None:
        self.point, self.error, self.read = point, error, []
        self.generations = self.losses = 0

    def fire(self, point: str) -> None:
        if self.point == point:
            self.point = None
            raise self.error(f"stopped at {point}")

    def _generate(self, prompts):
        self.generations += 1
        if self.generations == 2:
            self.fire("generation")
        return super()._generate(prompts)

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.model.training:
            self.read.append(inputs["advantages"].detach().clone())
            self.losses += 1
            if self.losses == 3:  # the second generation batch's first micro-batch, after its forward
                self.fire("inside the loss")
        return loss

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.losses == 3:  # after that micro-batch's backward, before the next micro-batch
            self.fire("between micro-batches")
        return loss

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.state.global_step == 2:
            self.fire("saving")
        super()._save_optimizer_and_scheduler(output_dir)

    def reward(self, completions: list[str], **kwargs) -> list[float]:
        self.rewards = getattr(self, "rewards", 0) + 1
        if self.rewards == 2:
            self.fire("reward")
        return digit_reward(completions)


def _trainer(model, tmp_path, route: str) -> Interrupted:
    trainer = None

    def reward(completions: list[str], **kwargs) -> list[float]:
        return trainer.reward(completions)

    args = short_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, **ROUTES[route])
    trainer = Interrupted(str(model), reward, args=args, train_dataset=digit_dataset(), eval_dataset=digit_dataset(4))
    assert trainer._capture_route("train") == route
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("point", POINTS)
def test_train_again_after_an_interrupt_trains_on_finite_advantages(tiny_model_path, tmp_path, route, point):
    trainer = _trainer(tiny_model_path, tmp_path, route)
    trainer.arm(point, Stop)
    with pytest.raises(Stop, match=f"stopped at {point}"):
        trainer.train()
    assert trainer.point is None  # it fired
    assert trainer._generation is None and trainer._buffered_inputs is None and trainer._step == 0

    trainer.read = []
    trainer.train()
    assert trainer.state.global_step == 3
    assert trainer.read and all(torch.isfinite(a).all() for a in trainer.read)
    assert any(a.abs().sum() > 0 for a in trainer.read)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.estimator.steps_ > 0 and trainer._generation is None


@pytest.mark.slow
@pytest.mark.parametrize("route", list(ROUTES))
def test_evaluate_after_an_interrupted_train_or_evaluate(tiny_model_path, tmp_path, route):
    trainer = _trainer(tiny_model_path, tmp_path, route)
    trainer.arm("inside the loss", Stop)
    with pytest.raises(Stop):
        trainer.train()
    first = trainer.evaluate()
    assert math.isfinite(first["eval_loss"]) and "eval_poise/reward_mean" in first

    trainer.arm("generation", ValueError)  # an evaluation stopped while it generates
    trainer.generations = 1
    with pytest.raises(ValueError, match="stopped at generation"):
        trainer.evaluate()
    assert trainer._generation is None
    assert math.isfinite(trainer.evaluate()["eval_loss"])


@pytest.mark.slow
def test_an_exception_in_a_reward_function_then_train_again(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path, "loss")
    trainer.arm("reward", ValueError)
    with pytest.raises(ValueError, match="stopped at reward"):
        trainer.train()
    trainer.read = []
    trainer.train()
    assert trainer.state.global_step == 3 and all(torch.isfinite(a).all() for a in trainer.read)


@pytest.mark.slow
def test_a_micro_batch_without_its_live_record_is_an_error_not_nan(tiny_model_path, tmp_path):
    """Were TRL to hand the loss a micro-batch of a generation batch whose record has ended (what an interrupted
    `train()` left in TRL's buffer before POISE dropped it), the loss refuses it, naming the contract."""
    trainer = _trainer(tiny_model_path, tmp_path, "loss")
    trainer.arm("between micro-batches", Stop)
    stale = []
    original = trainer._end_generation_batch

    def keep_the_buffer():
        stale.append((trainer._buffered_inputs, trainer._step))
        original()

    trainer._end_generation_batch = keep_the_buffer
    with pytest.raises(Stop):
        trainer.train()
    trainer._end_generation_batch = original
    ((buffer, step),) = stale
    trainer._buffered_inputs, trainer._step = buffer, step  # as TRL alone would have left it
    with pytest.raises(ContractError, match="'train_buffer'.*generation batch had already ended"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

"""Pressing stop at any line of the estimator's side of `train()` or `evaluate()` (issue 57): no forward hook is left
on the model, the estimator is whole, and the next `evaluate()` and `train()` run.

The line-level interrupt fuzz (tests/interrupts.py) of a tiny `POISETrainer` (2 steps of 2 prompts x 2 rollouts,
trusted from the second): a KeyboardInterrupt at the first run of a line of a `poise_trl` module of the estimator's
side (every module but the TRL glue, whose interrupt points tests/scenarios/test_interrupt.py names): the captured
passes (capture.py, features.py, prefix.py, columns.py), `advantages`, `observe` and everything below them. Each run
starts from the same weights, estimator state and seed; the stop's traceback is kept, as IPython keeps it. After
each stop the estimator's `state_dict()` is the one after its last completed `observe` or, inside one, the one
before or after that call (replayed uninterrupted on a copy).

The suite stops at a sample: every line that registers or removes the pass's hooks (`features.hooked`,
`capture.capture_pass`), and a seeded few of the other lines of `train()` and `evaluate()` (20 stops). Every line,
once each (1,003 stops; 20 minutes on 2 cores, 45 when they are shared):

    POISE_INTERRUPT_FUZZ=all python -m pytest --without-lab tests/scenarios/test_interrupts_trainer.py
"""

import copy
import inspect
import math
import os
import random
from pathlib import Path

import pytest
from transformers import set_seed

from poise_trl import POISETrainer
from poise_trl.estimator.estimator import POISEEstimator
from poise_trl.features import capture, features

from ..conftest import digit_dataset, digit_reward, short_args
from ..interrupts import LIBRARY, Line, Stop, first_lines, forward_hooks, lines_run, same_state, stop_at, where

GLUE = ("trainer.py", "step.py", "selection.py", "resume.py", "validation.py", "contract.py", "config.py", "card.py")
"""The TRL glue and the settings: not the estimator's side."""
EVERY_LINE = os.environ.get("POISE_INTERRUPT_FUZZ") == "all"


def estimator_side(path: str) -> bool:
    return Path(path).name not in GLUE and Path(path).relative_to(LIBRARY).parts[0] not in ("rlvr", "tasks")


def _lines_of(function) -> set[Line]:
    source, start = inspect.getsourcelines(inspect.unwrap(function))
    path = inspect.getsourcefile(inspect.unwrap(function))
    return {(path, start + i) for i in range(len(source))}


HOOK_LINES = _lines_of(features.hooked) | _lines_of(features._remove) | _lines_of(capture.capture_pass)


class Watch:
    """Wraps `POISEEstimator.observe` of one estimator: the state after its last completed call and, during a call,
    the state before it with the call's arguments, from which the states a stop may leave are rebuilt."""

    def __init__(self, estimator: POISEEstimator):
        self.estimator, self.observe = estimator, POISEEstimator.observe
        self.reset()

    def reset(self) -> None:
        self.inside, self.last = None, self.estimator.state_dict()

    def __call__(self, estimator: POISEEstimator, *args, **kwargs):
        if estimator is not self.estimator:
            return self.observe(estimator, *args, **kwargs)
        self.inside = (copy.deepcopy(estimator), args, kwargs)
        out = self.observe(estimator, *args, **kwargs)
        self.inside, self.last = None, estimator.state_dict()
        return out

    def allowed(self) -> list[dict]:
        """The states the estimator may be left in now."""
        if self.inside is None:
            return [self.last]
        before, args, kwargs = self.inside
        after = copy.deepcopy(before)
        self.observe(after, *args, **kwargs)
        return [before.state_dict(), after.state_dict()]


def _chosen(stops: list[tuple[str, Line, int]]) -> list[tuple[str, Line, int]]:
    """Every stop with `POISE_INTERRUPT_FUZZ=all`; else the hooks' lines of `train()` and a seeded few others."""
    if EVERY_LINE:
        return stops
    hooks = [stop for stop in stops if stop[0] == "train" and stop[1] in HOOK_LINES]
    others = random.Random(0)
    train = others.sample([stop for stop in stops if stop[0] == "train" and stop[1] not in HOOK_LINES], 3)
    return hooks + train + others.sample([stop for stop in stops if stop[0] == "evaluate"], 2)


@pytest.mark.slow
def test_a_stop_at_any_estimator_line_of_train_or_evaluate(tiny_model_path, tmp_path, monkeypatch):
    args = short_args(tmp_path)
    trainer = POISETrainer(
        str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset(), eval_dataset=digit_dataset(4)
    )
    watch = Watch(trainer.estimator)
    monkeypatch.setattr(
        POISEEstimator, "observe", lambda estimator, *args, **kwargs: watch(estimator, *args, **kwargs)
    )
    weights, untrained = copy.deepcopy(trainer.model.state_dict()), trainer.estimator.state_dict()

    def start(estimator_state: dict) -> None:
        trainer.model.load_state_dict(weights)
        trainer.estimator.load_state_dict(estimator_state)
        watch.reset()
        set_seed(args.seed)

    start(untrained)
    trainer.train()
    trained = trainer.estimator.state_dict()  # evaluate() runs on a trusted probe
    calls = {"train": (trainer.train, untrained), "evaluate": (trainer.evaluate, trained)}
    stops = []
    for name, (call, state) in calls.items():
        start(state)
        stops += [(name, line, n) for line, n in first_lines(lines_run(call, estimator_side)).items()]
    assert len([stop for stop in stops if stop[0] == "train" and stop[1] in HOOK_LINES]) >= 8  # the hooks' lines run

    kept = []  # the tracebacks, as IPython keeps the last one: their frames keep the stopped generators open
    chosen = _chosen(stops)
    for name, line, n in chosen:
        call, state = calls[name]
        start(state)
        with pytest.raises(Stop) as stopped, stop_at(n, estimator_side):
            call()
        kept.append(stopped.value)
        at = f"a stop in {name}() at {where(line)}"
        assert not forward_hooks(trainer.model), f"{at} left a forward hook"
        left = trainer.estimator.state_dict()
        assert any(same_state(left, state) for state in watch.allowed()), f"{at} tore the estimator"
        assert math.isfinite(trainer.evaluate()["eval_loss"]), at
        trainer.train()
        assert trainer.state.global_step == args.max_steps and not forward_hooks(trainer.model), at
    assert len(chosen) >= 10
    print(f"{len(chosen)} of {len(stops)} stops made")  # shown with -rP

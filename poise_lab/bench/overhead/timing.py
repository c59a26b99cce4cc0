"""`bench overhead`'s timing: POISE and GRPO trainers (and, with `--prefix`, POISE with the per-prefix baseline) on
the same model and prompts, taking turns cycle by cycle.

Alternating them in one process (threads passing a baton) exposes all to the same machine load, so their per-cycle
ratios are paired; the trainers are built here and reused by the memory worker.
"""

import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from poise_lab.models.real import resolve_model
from poise_lab.models.toy import prepare_demo_model
from poise_lab.tasks.arith import make_arith_splits
from poise_lab.tasks.toy import make_sort_splits
from poise_trl.grpo.config import POISEConfig
from poise_trl.grpo.trainer import POISETrainer
from poise_trl.tasks.math_data import load_math_dataset

from ..common import ARITH_DATASET, summarize, trainer_device_args

PREFIX = "poise_prefix"  # POISE with probe_granularity="prefix", timed beside POISE and GRPO with --prefix
IMPORTANCE = "poise_importance"  # POISE with prompt_selection="importance", timed beside them with --importance
OWN_PASS = "poise_pass"  # POISE with probe_capture="pass" (a no-grad pass of its own), with --capture-route


def contenders(settings: dict[str, Any]) -> tuple[str, ...]:
    """The trainers a row times: POISE and GRPO, POISE per-prefix with `--prefix`, POISE with the importance sampler
    with `--importance`, POISE on its own pass with `--capture-route`."""
    extra = (PREFIX,) * bool(settings.get("prefix")) + (IMPORTANCE,) * bool(settings.get("importance"))
    return ("poise", "grpo", *extra, *(OWN_PASS,) * bool(settings.get("capture_route")))


def any_text_reward(completions: list, **kwargs: Any) -> list[float]:
    """Fraction of digits in the completion: defined for any text, so forced-length completions are all scored."""
    texts = [c if isinstance(c, str) else "".join(str(m["content"]) for m in c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


@dataclass(frozen=True)
class Row:
    """One timed setting: forced completion length and the layout (`common.OVERHEAD_LAYOUTS`): "default", one
    optimizer step per generation, where TRL runs no log-prob pass (POISE reads the loss's forward; with "pass", its
    own pass); "trl-pass", two, where TRL runs its old-log-prob pass and POISE captures inside it."""

    completion_length: int
    layout: str

    @property
    def steps_per_cycle(self) -> int:
        return 2 if self.layout == "trl-pass" else 1

    @property
    def name(self) -> str:
        return f"{self.completion_length} tok, {'TRL pass' if self.layout == 'trl-pass' else 'TRL default'}"


def _config(algorithm: str, row: Row, settings: dict[str, Any], max_steps: int, output_dir: str):
    """Both trainers' config; `--per-device-batch-size` micro-batches with gradient accumulation, so a real model's
    completions per optimizer step stay `--completions-per-step` without holding them all in one forward pass."""
    per_device = settings["per_device_batch_size"] or settings["completions_per_step"]
    accumulation = settings["completions_per_step"] // per_device
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        # Generation once per cycle: "default", one optimizer step (TRL needs no old log-probs); "trl-pass", two.
        steps_per_generation=row.steps_per_cycle * accumulation,
        num_generations=settings["group_size"],
        max_steps=max_steps,
        learning_rate=settings["learning_rate"],
        lr_scheduler_type="constant",
        epsilon_high=0.28,
        beta=0.0,
        loss_type="dapo",
        max_completion_length=row.completion_length,
        generation_kwargs={"min_new_tokens": row.completion_length},
        seed=settings["seed"],
        **trainer_device_args(settings["gradient_checkpointing"]),
    )
    if algorithm == "grpo":
        return GRPOConfig(**common)
    # Trusted after one observed step, so the timed cycles pay for serving the probe (the per-prefix map inside the
    # hook included), not only for fitting it.
    granularity = "prefix" if algorithm == PREFIX else "sequence"
    selection = "importance" if algorithm == IMPORTANCE else None
    capture = "pass" if algorithm == OWN_PASS else "auto"
    return POISEConfig(
        **common,
        probe_warmup_steps=1,
        probe_granularity=granularity,
        prompt_selection=selection,
        probe_capture=capture,
    )


def model_and_prompts(settings: dict[str, Any]) -> tuple[str, Dataset]:
    """The model and prompts: the warm-started demo model on sort prompts, or `--model` (a real model's name is
    prepared from its package) on `--train-dataset` (`arith`: the arith task's training split)."""
    if settings["model"] is None:
        path = prepare_demo_model(settings["cache_dir"], seed=settings["seed"])
        train, _ = make_sort_splits(seed=settings["seed"])
        return str(path), train
    model = resolve_model(settings["model"])
    if settings["train_dataset"] == ARITH_DATASET:
        return model, make_arith_splits(settings["train_limit"] or 2000, seed=settings["seed"])[0]
    return model, load_math_dataset(settings["train_dataset"], limit=settings["train_limit"])


def build_trainer(algorithm: str, row: Row, settings: dict[str, Any], cycles: int, model: str, prompts: Dataset):
    """One contender's trainer for one row, training `cycles` generation cycles; POISE's probe buffers are filled to
    capacity after the first (`SteadyStateProbe`)."""
    trainer_class = GRPOTrainer if algorithm == "grpo" else POISETrainer
    output_dir = str(Path(settings["output_dir"]) / "runs" / f"{algorithm}_{row.completion_length}_{row.layout}")
    trainer = trainer_class(
        model=model,
        reward_funcs=any_text_reward,
        args=_config(algorithm, row, settings, cycles * row.steps_per_cycle, output_dir),
        train_dataset=prompts,
    )
    trainer.remove_callback(PrinterCallback)
    if algorithm != "grpo":
        trainer.add_callback(SteadyStateProbe(trainer, row.steps_per_cycle))
    if algorithm == IMPORTANCE:
        time_selection(trainer)
    return trainer


def time_selection(trainer: POISETrainer) -> None:
    """Record the seconds of every call of the trainer's `_select_prompts` (the prefill, the prompt-only refit and the
    draw: the sampler's own cost) in `trainer.selection_seconds`."""
    select, trainer.selection_seconds = trainer._select_prompts, []

    def timed(inputs, step):
        _synchronize()
        start = time.perf_counter()
        kept = select(inputs, step)
        _synchronize()
        trainer.selection_seconds.append(time.perf_counter() - start)
        return kept

    trainer._select_prompts = timed


def fill_probe_buffer(trainer: POISETrainer) -> None:
    """Repeat the buffered rows up to each buffer's capacity (the per-prefix probe's too), so each refit costs what it
    costs in steady state."""
    learners = trainer.estimator.token_baseline_.learners
    for buffer in (trainer.estimator.probes_["default"].buffer, *(learner.buffer for learner in learners)):
        _fill(buffer)


def _fill(buffer: Any) -> None:
    missing = buffer.capacity - len(buffer)
    if missing <= 0 or len(buffer) == 0:
        return
    index = torch.arange(missing) % len(buffer)
    extra = {} if buffer.groups is None else {"groups": buffer.groups[index]}
    buffer.add(buffer.features[index], buffer.targets[index], **extra)


class SteadyStateProbe(TrainerCallback):
    """After the first generation cycle, fill POISE's probe buffer to capacity (untimed; that cycle is warm-up)."""

    def __init__(self, trainer: POISETrainer, steps_per_cycle: int):
        self.trainer, self.steps_per_cycle = trainer, steps_per_cycle

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.steps_per_cycle:
            fill_probe_buffer(self.trainer)


class Baton:
    """Turn-taking between trainer threads: each runs one cycle while the others wait; all start together.

    Each round of turns runs in the reverse order of the one before (0 1 2, 2 1 0, 0 1 2, ...), so a contender's k-th
    cycle and another's (same prompts, round k) are taken alternately first and second. In one fixed order the first
    of every round would pay against the others whatever the machine drifts by between turns (a process, or a
    machine, that speeds up from cycle to cycle), a bias of the same sign in every paired ratio."""

    def __init__(self, parties: int, timeout: float):
        self._condition = threading.Condition()
        self._parties, self._timeout = parties, timeout
        self._arrived, self._turn = 0, 0
        self._order = list(range(parties))  # this round's turns, in order
        self._left = self._order[1:]  # the turns of this round still to come
        self._finished = [False] * parties
        self._aborted = False

    def arrive(self, me: int) -> None:
        with self._condition:
            self._arrived += 1
            self._condition.notify_all()
        self.wait_turn(me)

    def wait_turn(self, me: int) -> None:
        with self._condition:
            ready = self._condition.wait_for(
                lambda: self._aborted or (self._arrived == self._parties and self._turn == me), self._timeout
            )
            if self._aborted:
                raise RuntimeError("another benchmark thread failed")
            if not ready:
                raise TimeoutError(f"thread {me} waited more than {self._timeout} s for its turn")

    def pass_on(self, me: int, finished: bool) -> None:
        """End `me`'s turn; only the holder of the turn passes it on (a trainer that finished passes again from
        `on_train_end`, while another holds the turn)."""
        with self._condition:
            self._finished[me] = self._finished[me] or finished
            if self._turn == me:
                self._turn = self._next(me)
            self._condition.notify_all()

    def _next(self, me: int) -> int:
        """The next unfinished party of this round, else of the next round (this one reversed); `me` when none is
        left."""
        for _ in range(2):
            while self._left:
                party = self._left.pop(0)
                if not self._finished[party]:
                    return party
            self._order.reverse()
            self._left = list(self._order)
        return me

    def abort(self) -> None:
        with self._condition:
            self._aborted = True
            self._condition.notify_all()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class CycleTimer(TrainerCallback):
    """Times each generation cycle (`steps_per_cycle` optimizer steps) of one trainer, taking turns via a Baton."""

    def __init__(self, baton: Baton, me: int, steps_per_cycle: int, trainer: Any):
        self.baton, self.me, self.steps_per_cycle, self.trainer = baton, me, steps_per_cycle, trainer
        self.seconds: list[float] = []
        self.starts: list[float] = []  # when each cycle began: which contender went first in a round
        self.feature_passes: list[int] = []
        self._start = 0.0
        self._passes = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.baton.arrive(self.me)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_cycle == 0:
            _synchronize()
            self._passes = getattr(self.trainer, "feature_passes", 0)
            self._start = time.perf_counter()
            self.starts.append(self._start)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_cycle:
            return
        _synchronize()
        self.seconds.append(time.perf_counter() - self._start)
        self.feature_passes.append(getattr(self.trainer, "feature_passes", 0) - self._passes)
        finished = state.global_step >= state.max_steps
        self.baton.pass_on(self.me, finished)
        if not finished:
            self.baton.wait_turn(self.me)

    def on_train_end(self, args, state, control, **kwargs):
        self.baton.pass_on(self.me, finished=True)


def time_row(row: Row, settings: dict[str, Any], model: str, prompts: Dataset) -> dict[str, Any]:
    """The contenders alternate cycle by cycle; returns per-cycle times and their paired ratios."""
    cycles = settings["warmup_cycles"] + settings["cycles"]
    trainers = {name: build_trainer(name, row, settings, cycles, model, prompts) for name in contenders(settings)}
    baton = Baton(len(trainers), timeout=settings["thread_timeout"])
    timers = {}
    for me, (name, trainer) in enumerate(trainers.items()):
        timers[name] = CycleTimer(baton, me, row.steps_per_cycle, trainer)
        trainer.add_callback(timers[name])
    errors: list[BaseException] = []

    def train(trainer: Any) -> None:
        try:
            trainer.train()
        except BaseException as error:  # re-raised in the main thread below
            errors.append(error)
            baton.abort()

    threads = [threading.Thread(target=train, args=(t,), name=f"bench-{n}") for n, t in trainers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    skip = settings["warmup_cycles"]
    warmup_steps = skip * row.steps_per_cycle
    seconds = {name: timer.seconds[skip:] for name, timer in timers.items()}
    result = {"row": asdict(row), "name": row.name, "grpo_seconds": seconds["grpo"]}
    for name in trainers:
        if name == "grpo":
            continue
        passes = timers[name].feature_passes[skip:]
        timed_steps = _timed(trainers[name], "poise/probe_fit_seconds", warmup_steps)
        result.update(
            {
                f"{name}_seconds": seconds[name],
                f"{name}_feature_passes_per_cycle": passes,
                f"{name}_probe_fit_seconds_per_step": summarize(h["poise/probe_fit_seconds"] for h in timed_steps),
            }
        )
    result.update({f"{name}_cycle_seconds": summarize(seconds[name]) for name in trainers})
    result["time_ratio"] = _paired(seconds["poise"], seconds["grpo"])
    # The same ratios split by which of the two went first in the round: apart, they show a drift between turns
    # that the alternating order cancels in `time_ratio`.
    first = [p < g for p, g in zip(timers["poise"].starts[skip:], timers["grpo"].starts[skip:], strict=True)]
    ratios = [p / g for p, g in zip(seconds["poise"], seconds["grpo"], strict=True)]
    result["time_ratio_by_order"] = {
        "poise_first": summarize(r for r, f in zip(ratios, first, strict=True) if f),
        "grpo_first": summarize(r for r, f in zip(ratios, first, strict=True) if not f),
    }
    if IMPORTANCE in trainers:
        selection = trainers[IMPORTANCE].selection_seconds[skip:]  # one call per cycle (one generation)
        result.update(
            importance_time_ratio=_paired(seconds[IMPORTANCE], seconds["grpo"]),
            importance_poise_time_ratio=_paired(seconds[IMPORTANCE], seconds["poise"]),
            importance_selection_seconds=summarize(selection),
            importance_selection_share=summarize(s / c for s, c in zip(selection, seconds[IMPORTANCE], strict=True)),
        )
    result["extra_passes_observed"] = max(result["poise_feature_passes_per_cycle"], default=None)
    if OWN_PASS in trainers:
        result.update(
            own_pass_time_ratio=_paired(seconds[OWN_PASS], seconds["grpo"]),
            poise_own_pass_time_ratio=_paired(seconds["poise"], seconds[OWN_PASS]),
            own_pass_passes_observed=max(result[f"{OWN_PASS}_feature_passes_per_cycle"], default=None),
        )
    if PREFIX in trainers:
        timed = [h["poise/prefix/trusted"] for h in _timed(trainers[PREFIX], "poise/prefix/trusted", warmup_steps)]
        result.update(
            prefix_time_ratio=_paired(seconds[PREFIX], seconds["grpo"]),
            prefix_poise_time_ratio=_paired(seconds[PREFIX], seconds["poise"]),
            prefix_timed_generations=len(timed),
            prefix_served_generations=sum(t == 1.0 for t in timed),  # generations given per-token advantages
        )
    return result


def _timed(trainer: Any, key: str, warmup_steps: int) -> list[dict[str, Any]]:
    """The log entries after the untimed warm-up steps that carry `key` (logged once per generation, which spans
    `steps_per_cycle` optimizer steps)."""
    return [h for h in trainer.state.log_history if key in h and h["step"] > warmup_steps]


def _paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Per-cycle ratios a / b of two contenders that took turns, summarized."""
    return summarize(x / y for x, y in zip(a, b, strict=True))

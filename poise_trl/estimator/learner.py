"""`OnlineLearner`: one value head learned online, the same for every granularity. Pure torch.

It owns what learning across steps needs besides the head: the sliding buffer of earlier steps' rows, the step
count, trust (the bootstrap until `warmup_steps` steps of data, or at once after a warm start from a file), and its
persistence. The estimator keeps one per domain for the sequence value (estimator.py) and one for the per-prefix
value (granularity.py); neither cares which head (heads.py) it holds.

A learner is a value: `added`, `fitted` and `loaded` return a new learner and leave this one as it is (its buffer
and its fitted head included), so the estimator builds its next state from the old one and a stop midway leaves the
old one whole.
"""

import copy
from collections.abc import Callable
from typing import Any

import torch

from ..heads.interface import ValueHead
from ..heads.probe import strip_prefix
from .buffer import ProbeBuffer
from .layer_choice import grouped_kfold_errors


class OnlineLearner:
    """A value head, its sliding `ProbeBuffer` and its step counter.

    Buffered rows are (N, C, D): one feature vector per candidate layer (C = 1 for a fixed layer, and for the
    per-prefix value). The head is fitted on one slice, `layer_index` (an index along C, not a layer id), and always
    predicts from the slice it was fitted on.

    Args:
        head: the unfitted head; its settings are reused for every refit (`fitted` fits a clone of it).
        capacity: buffer size in rows.
        warmup_steps: steps of data before the head is trusted (the bootstrap baseline until then).
    """

    def __init__(self, head: ValueHead, capacity: int, warmup_steps: int = 0):
        self.probe = head
        self.buffer = ProbeBuffer(capacity)
        self.warmup_steps = warmup_steps
        self.steps = 0  # steps whose rows entered the buffer
        self.layer_index = 0
        self.warm_started = False  # loaded from a probe file: trusted at once
        self.refit_from_step = 0  # a warm start without buffer keeps its loaded fit until this many steps

    def replace(self, **changes: Any) -> "OnlineLearner":
        """A copy of this learner with `changes` (e.g. `probe=` an unfitted head of another size); this one is left
        as it is."""
        unknown = set(changes) - set(vars(self))
        if unknown:
            raise TypeError(f"An OnlineLearner has no {', '.join(sorted(unknown))}.")
        learner = copy.copy(self)
        vars(learner).update(changes)
        return learner

    @property
    def trusted(self) -> bool:
        """Whether a baseline may use this head: fitted, and past its bootstrap (or warm-started)."""
        return self.probe.is_fitted and (self.warm_started or self.steps >= self.warmup_steps)

    @property
    def can_fit(self) -> bool:
        return len(self.buffer) >= 2 and self.steps >= self.refit_from_step

    def added(
        self,
        features: torch.Tensor,
        targets: torch.Tensor,
        groups: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> "OnlineLearner":
        """This learner with one more step's (N, C, D) rows (those where `keep` is True; possibly none) buffered and
        counted."""
        return self.replace(buffer=self.buffer.added(features, targets, groups, keep), steps=self.steps + 1)

    def fitted(
        self,
        layer_index: int = 0,
        device: torch.device | str | None = None,
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> "OnlineLearner":
        """This learner with its head refitted on the whole buffer (finite rows only ever enter it), on feature slice
        `layer_index`; `agree` maps every fitted tensor (a broadcast from rank 0, so that every process holds the
        same fit to the bit)."""
        features, targets = self.buffer.features, self.buffer.targets
        probe = self.probe.clone().fit(features[:, layer_index].to(device), targets.to(device), check_finite=False)
        if agree is not None:
            probe.map_state(agree)
        return self.replace(probe=probe, layer_index=layer_index)

    def predict(self, features: torch.Tensor, return_unclipped: bool = False):
        """Predictions for (N, C, D) rows, from the slice the head was fitted on."""
        return self.probe.predict(features[:, self.layer_index], return_unclipped=return_unclipped)

    def layer_errors(self, folds: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """(C, N) prompt-grouped K-fold absolute errors of each feature slice on the buffer (see
        `grouped_kfold_errors`); None with too few prompts."""
        if len(self.buffer) < 2:
            return None
        return grouped_kfold_errors(
            self.probe, self.buffer.features.to(device), self.buffer.targets.to(device), self.buffer.groups, folds
        )

    # ---------------------------------------------------------------------------------------------- persistence
    def state_dict(self, include_buffer: bool = True) -> dict[str, torch.Tensor]:
        state = {f"probe.{k}": v for k, v in self.probe.state_dict().items()}
        if include_buffer:
            state.update({f"buffer.{k}": v for k, v in self.buffer.state_dict().items()})
        return state

    def info(self, include_buffer: bool = True) -> dict[str, Any]:
        return {
            "head": self.probe.name,
            "probe": self.probe.config(),
            "buffer_capacity": self.buffer.capacity if include_buffer else None,
            "steps": self.steps,
            "layer_index": self.layer_index,
            "warm_started": self.warm_started,
            "refit_from_step": self.refit_from_step,
        }

    def loaded(
        self,
        state: dict[str, torch.Tensor],
        info: dict[str, Any],
        device: torch.device | str | None = None,
        warm_start: bool = False,
    ) -> "OnlineLearner":
        """A learner with the fit, buffer and counters of `state_dict`/`info`. This learner's head settings and
        capacity are kept, and govern every later refit (the loaded fit predicts as saved; the newest buffered rows
        survive).

        With `warm_start` (a new run from a saved file) the head is trusted at once with a fresh step count; without
        a buffer it keeps the loaded fit until `warmup_steps` steps of new rows are buffered."""
        probe, fit = self.probe.clone(), strip_prefix(state, "probe.")
        if fit:
            probe.load_state_dict(fit)
        rows = strip_prefix(state, "buffer.")
        if rows.get("features") is not None and rows["features"].ndim == 2:  # (N, D): one slice, as (N, 1, D)
            rows["features"] = rows["features"].unsqueeze(1)
        buffer = ProbeBuffer(self.buffer.capacity)
        buffer.load_state_dict(rows, device)
        steps, warm_started = int(info.get("steps", 0)), bool(info.get("warm_started", False))
        refit_from_step = int(info.get("refit_from_step", 0))
        if warm_start:
            steps, warm_started = 0, True
            refit_from_step = self.warmup_steps if len(buffer) == 0 else 0
        return self.replace(
            probe=probe,
            buffer=buffer,
            # "layer" in files before poise-trl 0.2 (the same candidate index under a name that read as a layer id)
            layer_index=int(info.get("layer_index", info.get("layer", 0))),
            steps=steps,
            warm_started=warm_started,
            refit_from_step=refit_from_step,
        )

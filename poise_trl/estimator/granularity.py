"""The baseline's granularity, resolved once: a name -> token baseline table. Pure torch.

"sequence" (the paper) gives each rollout one baseline, so its token baseline adds nothing. "prefix" gives every
generated token its own, r - V(x, y_<t): the same hooked pass yields the feature rows of a few sampled tokens per
rollout and, once a head is fitted, every token's value from that head folded into a map applied inside the hook
(prefix.py). Its head is an `OnlineLearner` like the sequence value's (target: the rollout's own reward), so trust,
warm start and persistence are the learner's. Until it is trusted the caller keeps the sequence-level advantages.

Both entries answer the same calls, so the estimator and the trainer never ask which granularity runs; a token
baseline is a value, as its learner is (`observed`, `fitted` and `loaded` return a new one). Each says
what it can work with, which the estimator's spec checks (specs.py) instead of names: whether its value reads the
prompt history's columns (`takes_history`), whether it needs one fixed layer (`one_layer`), and which methods its
head must have (`head_methods`: the per-prefix value folds its head into an affine map applied inside the hook).
"""

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..features.prefix import (
    PREFIX_SAMPLES,
    STATS,
    PrefixBatch,
    PrefixCapture,
    PrefixMap,
    prefix_pca_blocks,
    prefix_spans,
)
from ..heads.probe import PCABlock, ValueProbe
from .baselines import prefix_advantages
from .learner import OnlineLearner

HeadFactory = Callable[[Sequence[PCABlock] | None], Any]
"""The unfitted value head for some PCA blocks (`specs.HeadSpec.build`)."""

QUARTERS = ("q1", "q2", "q3", "q4")  # poise/prefix/variance_explained/<quarter of the completion>


@dataclass(frozen=True)
class TokenAdvantages:
    """A batch's token advantages (N, T), each row's mean over its generated tokens (N,) and the rows whose tokens
    got the prefix baseline (N,) (the others keep their sequence-level advantage)."""

    advantages: torch.Tensor
    mean: torch.Tensor
    used: torch.Tensor


class SequenceBaseline:
    """The paper's granularity: one baseline per rollout, nothing per token."""

    name = "sequence"
    takes_history = True  # the sequence value reads the whole feature row
    one_layer = False
    head_methods: tuple[str, ...] = ()
    learners: tuple[OnlineLearner, ...] = ()

    def __init__(self, **settings: Any):
        """Takes the settings `PrefixBaseline` takes, and needs none."""

    def capturer(self, *args: Any, **kwargs: Any) -> None:
        """No token capture: the sequence features are all the pass must yield."""
        return None

    def advantages(self, batch: PrefixBatch | None, *args: Any) -> None:
        return None

    def diagnostics(self, batch: PrefixBatch | None, *args: Any) -> dict[str, torch.Tensor]:
        return {}

    def host_metrics(self) -> dict[str, float]:
        return {}

    def observed(self, batch: PrefixBatch | None, *args: Any) -> "SequenceBaseline":
        return self

    def fitted(self, batch: PrefixBatch | None, *args: Any) -> tuple["SequenceBaseline", bool]:
        return self, False

    def state_dict(self, include_buffer: bool = True) -> dict[str, torch.Tensor]:
        return {}

    def info(self) -> dict[str, Any] | None:
        return None

    def loaded(self, *args: Any, **kwargs: Any) -> "SequenceBaseline":
        return self


class PrefixBaseline:
    """The per-prefix value V(x, y_<t): an `OnlineLearner` over sampled tokens' feature rows, and its folded map.

    Args:
        head: builds the unfitted head for some PCA blocks (the estimator's value head, which must have an `affine`
            map); None: ridge with alpha 100, clipped to the observed reward range.
        pca_dims: [prompt k, prefix k] (0: no PCA), resolved against the model's width when the first rows arrive.
        buffer_size: rows buffered (`PREFIX_SAMPLES` per rollout).
        warmup_steps: observed steps before the head is trusted.
    """

    name = "prefix"
    takes_history = False  # the folded map has no input for a prompt's history
    one_layer = True  # its buffer holds one layer's states
    head_methods = ("affine",)

    def __init__(
        self,
        head: HeadFactory | None = None,
        pca_dims: tuple[int, int] = (0, 0),
        buffer_size: int = 4096,
        warmup_steps: int = 16,
    ):
        self.head = head or (lambda blocks: ValueProbe(100.0, blocks))
        self.pca_dims = tuple(pca_dims)
        self.learner = OnlineLearner(self._head(None), buffer_size, warmup_steps)
        self._map: PrefixMap | None = None

    def _head(self, width: int | None) -> Any:
        """The unfitted head for rows of `width` columns (its PCA blocks need the model's width; None: not known)."""
        blocks = None if width is None else prefix_pca_blocks((width - len(STATS)) // 2, self.pca_dims) or None
        return self.head(blocks)

    @property
    def learners(self) -> tuple[OnlineLearner, ...]:
        return (self.learner,)

    @property
    def probe(self) -> Any:
        return self.learner.probe

    @property
    def buffer(self):
        return self.learner.buffer

    @property
    def steps(self) -> int:
        return self.learner.steps

    @property
    def trusted(self) -> bool:
        return self.learner.trusted

    def map(self, device: torch.device | str | None = None) -> PrefixMap | None:
        """The trusted head as the affine map the hook applies; None before it is trusted (no values needed)."""
        if not self.trusted:
            return None
        if self._map is None:
            hidden_size = (self.probe.affine()[0].numel() - len(STATS)) // 2
            self._map = PrefixMap.fold(self.probe, hidden_size)
        return self._map if device is None else self._map.to(device)

    # ----------------------------------------------------------------------------------------------- capture
    def capturer(
        self,
        prompt_mask: torch.Tensor,
        completion_mask: torch.Tensor,
        generated_mask: torch.Tensor | None,
        pool_tokens: int,
        generator: torch.Generator,
        row_offset: int = 0,
    ) -> PrefixCapture:
        """The hook callable for one pass over the batch: which tokens the head learns from are drawn from
        `generator` for the global batch (this process's rows start at `row_offset`), so a resumed run and any
        number of processes draw the same; the values come from the map of earlier steps' fit."""
        spans = prefix_spans(
            prompt_mask, completion_mask, pool_tokens, PREFIX_SAMPLES, generated_mask, generator, row_offset
        )
        return PrefixCapture(spans, self.map(completion_mask.device))

    # ------------------------------------------------------------------------------------------------ estimate
    def advantages(
        self, batch: PrefixBatch | None, rewards: torch.Tensor, receives: torch.Tensor, sequence: torch.Tensor
    ) -> TokenAdvantages | None:
        """The batch's token advantages r - V(x, y_<t), or None while untrusted or without a capture. A generated
        token without a finite value keeps its row's `sequence` advantage (N,), that token alone."""
        if batch is None or not self.trusted or batch.values is None:
            return None
        tokens, used = prefix_advantages(rewards, batch.values, batch.generated, receives, sequence)
        generated = batch.generated.to(tokens.dtype)
        return TokenAdvantages(tokens, (tokens * generated).sum(1) / generated.sum(1).clamp(min=1), used)

    def diagnostics(
        self,
        batch: PrefixBatch | None,
        rewards: torch.Tensor,
        receives: torch.Tensor,
        tokens: TokenAdvantages | None,
    ) -> dict[str, torch.Tensor]:
        """`prefix/*` 0-d tensors, NaN where undefined: `share`, the rows receiving an advantage whose tokens got
        the prefix baseline; `variance_explained`, the share of the reward variance the head of earlier steps
        explains on this batch's sampled tokens (held out: it never saw them), overall and by completion quarter."""
        if batch is None:
            return {}
        keep = batch.sampled & torch.isfinite(rewards).unsqueeze(1) & torch.isfinite(batch.rows).all(-1)
        nan = torch.full((), float("nan"), dtype=torch.float64, device=rewards.device)
        used = torch.zeros_like(receives) if tokens is None else tokens.used
        share = {"prefix/share": torch.where(receives.any(), (used & receives).double().sum() / receives.sum(), nan)}
        names = ["prefix/variance_explained"] + [f"prefix/variance_explained/{q}" for q in QUARTERS]
        if not self.probe.is_fitted:
            return {**share, **dict.fromkeys(names, nan)}
        k = batch.rows.size(1)
        values = self.probe.predict(batch.rows.flatten(0, 1).nan_to_num()).view(-1, k).double()
        targets = rewards.double().unsqueeze(1).expand(-1, k)
        quarter = torch.arange(k, device=keep.device) * len(QUARTERS) // k
        out = {}
        for name, rows in zip(names, [keep] + [keep & (quarter == q) for q in range(len(QUARTERS))], strict=True):
            count = rows.sum()
            mean = torch.where(rows, targets, 0.0).sum() / count
            variance = torch.where(rows, targets - mean, 0.0).pow(2).sum() / count
            error = torch.where(rows, targets - values, 0.0).pow(2).sum() / count
            out[name] = torch.where((count > 1) & (variance > 0), 1 - error / variance, nan)
        return {**share, **out}

    def host_metrics(self) -> dict[str, float]:
        return {"prefix/trusted": float(self.trusted)}

    # --------------------------------------------------------------------------------------------------- learn
    def _with(self, learner: OnlineLearner) -> "PrefixBaseline":
        """This baseline with another learner (and the map folded from its head, when asked); this one is left."""
        baseline = copy.copy(self)
        baseline.learner, baseline._map = learner, None
        return baseline

    def observed(self, batch: PrefixBatch | None, rewards: torch.Tensor, keep: torch.Tensor) -> "PrefixBaseline":
        """This baseline with the sampled rows of the rollouts `keep` (N,) marks (scorable, with a completion)
        buffered, target: the rollout's own reward (a value, not a partner's); the step counted."""
        if batch is None:
            return self
        learner = self.learner
        if not self.probe.is_fitted:  # the rows tell the model's width, which the head's PCA blocks need
            learner = learner.replace(probe=self._head(batch.rows.size(-1)))
        k = batch.rows.size(1)
        rows = keep.unsqueeze(1) & batch.sampled & torch.isfinite(batch.rows).all(-1)
        targets = rewards.unsqueeze(1).expand(-1, k)
        return self._with(learner.added(batch.rows.flatten(0, 1).unsqueeze(1), targets.flatten(), keep=rows.flatten()))

    def fitted(
        self,
        batch: PrefixBatch | None,
        device: torch.device | str | None = None,
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple["PrefixBaseline", bool]:
        """(this baseline refitted on the whole buffer after a step that brought a capture, whether it refitted);
        `agree` as `OnlineLearner.fitted`'s."""
        if batch is None or not self.learner.can_fit:
            return self, False
        return self._with(self.learner.fitted(0, device, agree)), True

    # ---------------------------------------------------------------------------------------------- persistence
    def state_dict(self, include_buffer: bool = True) -> dict[str, torch.Tensor]:
        return self.learner.state_dict(include_buffer)

    def info(self) -> dict[str, Any]:
        return {**self.learner.info(), "fitted": self.probe.is_fitted}

    def loaded(
        self,
        state: dict[str, torch.Tensor],
        info: dict[str, Any],
        warm_start: bool = False,
        device: torch.device | str | None = None,
    ) -> "PrefixBaseline":
        """This baseline with `state_dict`/`info` restored (empty: afresh), its settings and capacity kept."""
        width = state.get("probe.mean", state.get("buffer.features"))
        head = self._head(None if width is None else width.size(-1))
        return self._with(self.learner.replace(probe=head).loaded(state, info, device, warm_start))


GRANULARITIES: dict[str, type] = {SequenceBaseline.name: SequenceBaseline, PrefixBaseline.name: PrefixBaseline}

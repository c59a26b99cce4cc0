"""`PrefixBaseline`: what the per-prefix value learns across steps (its probe, buffer and trust), owned by
`POISEEstimator` as the reward std is. Pure torch.

A step hands it a `PrefixBatch`: the feature rows of a few sampled tokens per rollout and, once a probe is fitted,
every token's value from the map applied inside the hook (prefix.py). `advantages` turns them into token advantages
A_t = r - V(x, y_<t) with the probe of earlier steps; `observe` then buffers the step's rows (target: the rollout's
reward) and refits. Until the probe is trusted (`warmup_steps` observed steps, or a warm start) the caller keeps the
sequence-level advantages.
"""

from dataclasses import dataclass
from typing import Any

import torch

from .baselines import prefix_advantages
from .files import _strip
from .prefix import STATS, PrefixMap, prefix_pca_blocks
from .probe import ProbeBuffer, ValueProbe

QUARTERS = ("q1", "q2", "q3", "q4")  # poise/prefix/variance_explained/<quarter of the completion>


@dataclass(frozen=True)
class TokenAdvantages:
    """A batch's token advantages (N, T), each row's mean over its generated tokens (N,) and the rows whose tokens
    got the prefix baseline (N,) (the others keep their sequence-level advantage)."""

    advantages: torch.Tensor
    mean: torch.Tensor
    used: torch.Tensor


@dataclass
class PrefixBatch:
    """One global batch's per-prefix capture, rows in the order of the rewards.

    rows: (N, K, F) the sampled tokens' feature rows; sampled: (N, K) False where a row had no generated token;
    values: (N, T) every completion token's V(x, y_<t) from the map in use at capture time (None: no fitted probe
    then); generated: (N, T) the tokens the policy wrote, the only ones that get a token advantage; tokens: (N, K)
    the completion token each row of `rows` describes."""

    rows: torch.Tensor
    sampled: torch.Tensor
    values: torch.Tensor | None
    generated: torch.Tensor
    tokens: torch.Tensor


class PrefixBaseline:
    """The per-prefix probe, its sliding buffer of (feature row, reward) examples and its trust.

    Args:
        alpha, pca_dims, clip: the ridge probe's settings; pca_dims is [prompt k, prefix k] (0: no PCA), clip None
            the observed reward range.
        buffer_size: rows buffered (`samples` per rollout).
        warmup_steps: observed steps before the probe is trusted.
    """

    def __init__(
        self,
        alpha: float = 100.0,
        pca_dims: tuple[int, int] = (0, 0),
        clip: tuple[float, float] | None = None,
        buffer_size: int = 4096,
        warmup_steps: int = 16,
    ):
        self.alpha, self.pca_dims, self.clip = alpha, tuple(pca_dims), clip
        self.warmup_steps = warmup_steps
        self.probe: ValueProbe | None = None
        self.buffer = ProbeBuffer(buffer_size)
        self.steps = 0
        self.warm_started = False
        self.refit_from_step = 0  # a warm start without buffer keeps its loaded fit until this many steps
        self._map: PrefixMap | None = None

    @property
    def trusted(self) -> bool:
        return self.probe is not None and (self.warm_started or self.steps >= self.warmup_steps)

    def map(self, device: torch.device | str | None = None) -> PrefixMap | None:
        """The trusted probe as the affine map the hook applies; None before it is trusted (no values needed)."""
        if not self.trusted:
            return None
        if self._map is None:
            hidden_size = (self.probe.affine()[0].numel() - len(STATS)) // 2
            self._map = PrefixMap.fold(self.probe, hidden_size)
        return self._map if device is None else self._map.to(device)

    def _template(self, width: int) -> ValueProbe:
        clip = "observed" if self.clip is None else tuple(self.clip)
        return ValueProbe(self.alpha, prefix_pca_blocks((width - len(STATS)) // 2, self.pca_dims) or None, clip)

    # ------------------------------------------------------------------------------------------------ estimate
    def advantages(
        self, batch: PrefixBatch, rewards: torch.Tensor, receives: torch.Tensor, sequence: torch.Tensor
    ) -> TokenAdvantages | None:
        """The batch's token advantages r - V(x, y_<t), or None while untrusted. Rows without finite values keep the
        `sequence` advantage (N,) on every generated token."""
        if not self.trusted or batch.values is None:
            return None
        tokens, used = prefix_advantages(rewards, batch.values, batch.generated, receives, sequence)
        generated = batch.generated.to(tokens.dtype)
        return TokenAdvantages(tokens, (tokens * generated).sum(1) / generated.sum(1).clamp(min=1), used)

    def diagnostics(
        self, batch: PrefixBatch, rewards: torch.Tensor, receives: torch.Tensor, tokens: TokenAdvantages | None
    ) -> dict[str, torch.Tensor]:
        """`prefix/*` 0-d tensors, NaN where undefined: `share`, the rows receiving an advantage whose tokens got
        the prefix baseline; `variance_explained`, the share of the reward variance the probe of earlier steps
        explains on this batch's sampled tokens (held out: it never saw them), overall and by completion quarter."""
        keep = batch.sampled & torch.isfinite(rewards).unsqueeze(1) & torch.isfinite(batch.rows).all(-1)
        nan = torch.full((), float("nan"), dtype=torch.float64, device=rewards.device)
        used = torch.zeros_like(receives) if tokens is None else tokens.used
        share = {"prefix/share": torch.where(receives.any(), (used & receives).double().sum() / receives.sum(), nan)}
        names = ["prefix/variance_explained"] + [f"prefix/variance_explained/{q}" for q in QUARTERS]
        if self.probe is None:
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

    # --------------------------------------------------------------------------------------------------- learn
    def observe(self, batch: PrefixBatch, rewards: torch.Tensor, keep: torch.Tensor) -> None:
        """Buffer the sampled rows of the rollouts `keep` (N,) marks (scorable, with a completion); count the step."""
        k = batch.rows.size(1)
        rows = keep.unsqueeze(1) & batch.sampled & torch.isfinite(batch.rows).all(-1)
        targets = rewards.unsqueeze(1).expand(-1, k)
        self.buffer.add(batch.rows.flatten(0, 1), targets.flatten(), keep=rows.flatten())
        self.steps += 1

    @property
    def can_fit(self) -> bool:
        return len(self.buffer) >= 2 and self.steps >= self.refit_from_step

    def fit(self, device: torch.device | str | None = None) -> None:
        """Refit on the whole buffer (finite rows only ever enter it)."""
        features = self.buffer.features.to(device)
        probe = self._template(features.size(-1))
        self.probe = probe.fit(features, self.buffer.targets.to(device), check_finite=False)
        self._map = None

    # ---------------------------------------------------------------------------------------------- persistence
    def state_dict(self, include_buffer: bool = True) -> dict[str, torch.Tensor]:
        state = {} if self.probe is None else {f"probe.{k}": v for k, v in self.probe.state_dict().items()}
        if include_buffer:
            state.update({f"buffer.{k}": v for k, v in self.buffer.state_dict().items()})
        return state

    def info(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "warm_started": self.warm_started,
            "refit_from_step": self.refit_from_step,
            "fitted": self.probe is not None,
        }

    def load_state(
        self,
        state: dict[str, torch.Tensor],
        info: dict[str, Any],
        warm_start: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        """Restore `state_dict`/`info` (empty: start afresh); with `warm_start`, trusted at once with a fresh step
        count, and without a buffer its fit is kept until `warmup_steps` steps of new rows are buffered. This
        object's settings and capacity are kept (the newest buffered rows survive)."""
        probe_state = _strip(state, "probe.")
        self.probe, self._map = None, None
        if info.get("fitted"):
            self.probe = self._template(probe_state["mean"].numel())
            self.probe.load_state_dict(probe_state)
        self.buffer = ProbeBuffer(self.buffer.capacity)
        self.buffer.load_state_dict(_strip(state, "buffer."), device)
        self.steps = 0 if warm_start else int(info.get("steps", 0))
        self.warm_started = warm_start or bool(info.get("warm_started", False))
        self.refit_from_step = int(info.get("refit_from_step", 0))
        if warm_start:
            self.refit_from_step = self.warmup_steps if len(self.buffer) == 0 else 0

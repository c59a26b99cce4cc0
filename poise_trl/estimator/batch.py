"""One step's batch as `POISEEstimator` sees it, and what the step hands on. Pure torch.

A caller hands the estimator a batch as its features and a `Rollouts` record of everything else it reads per row
(rewards, G, domains, which rows have a completion, importance weights, prompt ids), each checked once, where the
record is made. `advantages` prepares the batch once (`PreparedBatch`) and returns it inside its `AdvantageResult`;
`observe` takes that result, learns from its batch without preparing it again, and brings the result's diagnostics to
the host in the step's one device->host transfer. Given the features and the record instead, `observe` prepares the
batch itself.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..features.prefix import PrefixBatch
from .baselines import check_num_generations, leave_one_out_targets
from .row import FeatureRow

DEFAULT_DOMAIN = "default"  # the one domain's name when rows carry none


def _shape(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


@dataclass(frozen=True)
class Rollouts:
    """What the estimator reads of one batch of N rollouts besides their features: rows in consecutive groups of
    `num_generations` (G; None: the estimator's), in the same order as the features. Every value is checked here,
    once, when the record is made.

    rewards: (N,) float, NaN where a rollout could not be scored. domains: one name per row (each domain has its own
    probe and buffer). has_completion: (N,) bool, False for rows whose completion is empty or masked (advantage 0,
    never learned from). weights: (N,) finite, positive importance weights of the rows' prompts (sampling.py), which
    multiply the advantages after any scaling. prompt_ids: (N,) int64 ids that are the same for a prompt at every step
    (e.g. `buffer.prompt_group_ids`): the prompt history's key, and the groups of the layer choice's K-fold
    (default: each group of G rows is a prompt of its own).
    """

    rewards: torch.Tensor
    num_generations: int | None = None
    domains: Sequence[str] | None = None
    has_completion: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.rewards, torch.Tensor) or self.rewards.ndim != 1:
            raise ValueError(f"rewards must be an (N,) tensor, one per rollout, got {_shape(self.rewards)}.")
        n = self.rows
        if self.num_generations is not None:
            check_num_generations(self.num_generations)
        if self.domains is not None and len(self.domains) != n:
            raise ValueError(f"Got {len(self.domains)} domain names for {n} rows.")
        for name in ("has_completion", "weights", "prompt_ids"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.Tensor) or value.shape != (n,)):
                raise ValueError(f"{name} must be an ({n},) tensor, one per row as the rewards, got {_shape(value)}.")
        if self.weights is not None and not (self.weights.isfinite() & (self.weights > 0)).all():
            raise ValueError(f"weights must be ({n},) finite and positive, got {self.weights.tolist()}.")

    @property
    def rows(self) -> int:
        return self.rewards.numel()

    def take(self, index: torch.Tensor) -> "Rollouts":
        """The record of the rows `index` (whole groups, in order: e.g. one micro-batch's)."""

        def pick(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value[index.to(value.device)]
            if value is None or isinstance(value, int):  # absent, or G: the same for every row
                return value
            return [value[i] for i in index.tolist()]

        return Rollouts(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})


@dataclass(frozen=True)
class PreparedBatch:
    """The per-batch tensors both `advantages` and `observe` need, on the rewards' device; rows in consecutive groups
    of `num_generations`."""

    features: torch.Tensor  # (N, C, D): rows as the estimator's `FeatureRow` lays them out
    rewards: torch.Tensor  # (N,), NaN where unscorable
    has_completion: torch.Tensor  # (N,) bool
    has_features: torch.Tensor  # (N,) a completion and finite features (the reward column included)
    usable: torch.Tensor  # (N,) rows whose probe value may serve as a partner's baseline
    scorable: torch.Tensor  # (N,) finite reward
    targets: torch.Tensor  # (N,) leave-one-out mean of the partners' rewards
    domain_rows: dict[str, torch.Tensor]  # domain name -> (N,) bool; one, the default, when rows carry no domain
    num_generations: int
    named_domains: bool  # the caller named each row's domain (per-domain diagnostics are logged)
    prompt_ids: torch.Tensor | None = None  # (N,) each row's prompt id, which the prompt history is keyed by

    @property
    def rows(self) -> int:
        return self.rewards.numel()


def split_domains(
    domains: Sequence[str] | None, n: int, device: torch.device | str, known: Iterable[str], max_domains: int
) -> dict[str, torch.Tensor]:
    """Domain name -> (n,) bool rows of that domain (one, `DEFAULT_DOMAIN`, without names); refuses more than
    `max_domains` distinct domains with the `known` ones."""
    if domains is None:
        return {DEFAULT_DOMAIN: torch.ones(n, dtype=torch.bool, device=device)}
    names = [str(d) for d in domains]
    seen = {**dict.fromkeys(known), **dict.fromkeys(names)}
    if len(seen) > max_domains:
        raise ValueError(
            f"{len(seen)} distinct domains ({', '.join(map(repr, list(seen)[:5]))}{', ...' * (len(seen) > 5)}) "
            f"exceed max_domains={max_domains}: each keeps its own probe and buffer. Map the domain column "
            "to fewer values, or raise max_domains if the memory allows (see the estimator's docstring)."
        )
    return {
        name: torch.tensor([d == name for d in names], dtype=torch.bool, device=device)
        for name in dict.fromkeys(names)
    }


def prepare_batch(
    features: torch.Tensor,
    rollouts: Rollouts,
    num_generations: int,
    row: FeatureRow,
    domain_rows: dict[str, torch.Tensor],
    history: torch.Tensor | None = None,
) -> PreparedBatch:
    """Bring a batch to the rewards' device, assemble each row as `row` lays it out (φ, the partner-aware probe's
    reward column, the (N, H) `history` columns of each row's prompt from its earlier steps' rewards), and decide
    which rows are usable. A non-finite value anywhere in a row (a feature, or a reward too large for the column's
    dtype) drops it."""
    if features.ndim == 2:
        features = features.unsqueeze(1)
    device = rollouts.rewards.device
    rewards = torch.where(torch.isfinite(rollouts.rewards), rollouts.rewards, torch.nan)
    given = rollouts.has_completion
    has_completion = torch.ones_like(rewards, dtype=torch.bool) if given is None else given.to(device)
    features = row.assemble(features.to(device), rewards, history)
    scorable = torch.isfinite(rewards)
    has_features = has_completion & torch.isfinite(features).flatten(1).all(1)
    return PreparedBatch(
        features=features,
        rewards=rewards,
        has_completion=has_completion,
        has_features=has_features,
        usable=has_features & scorable if row.partner_reward else has_features,
        scorable=scorable,
        targets=leave_one_out_targets(rewards, num_generations, scorable),
        domain_rows=domain_rows,
        num_generations=num_generations,
        named_domains=rollouts.domains is not None,
        prompt_ids=None if rollouts.prompt_ids is None else rollouts.prompt_ids.to(device),
    )


def scale_advantages(
    advantages: torch.Tensor, divisor: torch.Tensor | None, weights: torch.Tensor | None
) -> torch.Tensor:
    """(N,) or (N, T) advantages divided by `divisor` (the std of earlier steps' rewards, independent of this batch)
    and multiplied by the rows' importance `weights` (the clipped objective is positively homogeneous in A)."""
    if divisor is not None:
        advantages = advantages / divisor.to(advantages.device).to(advantages.dtype)
    if weights is not None:
        advantages = advantages * weights.to(advantages.device, advantages.dtype).view(
            -1, *[1] * (advantages.ndim - 1)
        )
    return advantages


@dataclass
class AdvantageResult:
    """One batch's advantages (N,), baselines (N,, NaN where a row got none), the rows that received a baseline, the
    probe values and the leave-one-out targets, and the prepared `batch` that `observe` reuses; `metrics()` brings the
    diagnostics to the host in one transfer (shared with `observe`'s when the result is handed to it). With a trusted
    per-prefix baseline, `token_advantages` (N, T) is what the loss takes, and `advantages`/`baselines` are each
    row's mean over its generated tokens (for logs); `prefix` is the batch's per-prefix capture, which `observe`
    learns from."""

    advantages: torch.Tensor
    baselines: torch.Tensor
    receives: torch.Tensor
    values: torch.Tensor
    targets: torch.Tensor
    stats: torch.Tensor  # float64, in `names` order
    names: list[str]
    batch: PreparedBatch
    prefix: PrefixBatch | None = None
    token_advantages: torch.Tensor | None = None
    host_metrics: dict[str, float] = field(default_factory=dict)  # known on the host when taken (layer, buffer size)
    _host: list[float] | None = None

    def payload(self) -> torch.Tensor:
        """Everything a logger needs from the device: diagnostics, advantages and logged baselines."""
        logged = torch.where(self.receives, self.baselines, torch.nan)
        return torch.cat([self.stats, self.advantages.double(), logged.double()])

    @property
    def on_host(self) -> bool:
        return self._host is not None

    def receive_host(self, values: Sequence[float]) -> None:
        """Take `payload()` as host floats that a caller fetched in a transfer of its own (`observe` does)."""
        self._host = list(values)

    def host(self) -> list[float]:
        """`payload()` on the host: fetched now unless it already came with another transfer."""
        if self._host is None:
            self._host = self.payload().tolist()
        return self._host

    def metrics(self) -> dict[str, float]:
        """`poise/*` diagnostics of this batch as floats (NaN where undefined)."""
        return {**dict(zip(self.names, self.host()[: len(self.names)], strict=True)), **self.host_metrics}

    def logged_rows(self) -> tuple[list[float], list[float]]:
        """(advantages, baselines with NaN where a row got none) as host lists, from the same transfer."""
        host, n = self.host()[len(self.names) :], self.advantages.numel()
        return host[:n], host[n:]

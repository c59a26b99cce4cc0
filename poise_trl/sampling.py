"""Prompt sampling: which of a generation batch's candidate prompts to generate for, from predicted prompt values.
Pure torch; the trainer's mixin (selection.py) and the benches call it, and it knows nothing of either.

A rule is one entry of `RULES` (the name `prompt_selection` takes): a frozen dataclass whose fields are its own
settings (each naming the `POISEConfig` field that sets it), called with the candidates' predicted values (None while
no probe is trusted), the observed reward range, how many to keep and a seeded generator, and returning a `Draw`, the
kept candidates with their importance weights. `check_objective` refuses the trainer settings under which the rule
would not train on the objective it claims. Draws are seeded from (seed, rank, step) alone (`draw_generator`), so a
resumed run draws what the uninterrupted one drew without saving a counter.

- "value" (beyond the paper, biased): the `keep` candidates of highest predicted reward variance v(1 - v), v the
  predicted value read on the observed reward range (`reward_variance`); at random, uniformly, until a probe is
  trusted. Every weight is 1: the kept prompts are trained on as they come, so the step's gradient is that of the
  high-variance prompts, not of the dataset.
- "importance" (beyond the paper): `keep` draws with replacement, candidate x with probability
  q(x) = (1 - floor) s(x) / sum s + floor / n, s(x) = sqrt(v(1 - v)) (`importance_probabilities`), each with the weight
  1 / (n q(x)) (`importance_weights`). Multiplying a prompt's advantages by its weight makes the step's expected
  gradient the uniform-over-candidates one, E[(1/k) sum_draws w g] = sum_x q(x) g(x) / (n q(x)) = mean_x g(x), exactly
  when the loss divides by a constant (TRL's grpo, dr_grpo, sapo, luspo); under a token-count normaliser (dapo, cispo,
  vespo) the trainer weights the count too and the step is the uniform one up to a finite-batch difference that
  vanishes as the batch grows (docs/prompt-selection.md; POISEConfig refuses bnpo and the loss terms the weights do
  not reach). Uniform without replacement, weights 1, until a probe is trusted.

Why sqrt(v(1 - v)): for draws with replacement the variance of the weighted mean is least at q(x) proportional to
sqrt(E||g(x)||^2), and a prompt's gradient second moment is tau E[(r - b)^2 | x]. For a two-valued reward of range R
and success rate v, a baseline b independent of the rollout it serves gives E[(r - b)^2 | x] = R^2 v(1 - v) + E[(b -
R v)^2 | x]: the first term is the within-prompt noise, the second the baseline's error (R^2 v(1 - v)/(G - 1) for a
leave-one-out group mean, so the same shape at every G; about prompt-independent for a probe). R, the G factor and tau
(taken as equal across prompts) cancel in the normalisation; the floor stands in for the prompt-independent baseline
error and for the prediction's own error (a prompt predicted at v = 0 may still succeed), and bounds every weight by
1 / floor.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from .settings import DEFAULT_FLOOR, check_floor


@dataclass(frozen=True)
class Draw:
    """The kept candidates (indices into the candidate list, in candidate order, repeats allowed for a rule that draws
    with replacement), each one's importance weight (None: all 1), and each candidate's score (None: drawn blind)."""

    indices: list[int]
    weights: list[float] | None = None
    scores: list[float] | None = None


class Rule(Protocol):
    """A sampling rule with its own settings. Until a probe predicts, every rule draws uniformly (`draw`)."""

    def __call__(
        self,
        values: torch.Tensor,
        reward_range: tuple[torch.Tensor, torch.Tensor],
        keep: int,
        generator: torch.Generator,
    ) -> Draw:
        """(predicted values (M,) of the candidates, observed reward range, keep, generator) -> Draw."""

    def check_objective(self, config: Any) -> None:
        """Refuse a trainer configuration (POISEConfig's loss fields) under which the rule misses its objective."""


def draw_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """The generator of one process's draw at one step: a pure function of (seed, rank, step)."""
    return torch.Generator().manual_seed((seed + rank) * 1_000_003 + step)


def reward_variance(values: torch.Tensor, low: torch.Tensor | float, high: torch.Tensor | float) -> torch.Tensor:
    """q(1 - q) per prompt, q = the predicted value mapped from the observed reward range [low, high] to [0, 1]: the
    expected within-group reward variance of a two-valued reward, whatever its two values (±1 rewards, a format
    bonus)."""
    q = ((values - low) / torch.as_tensor(high - low).clamp(min=1e-12)).clamp(0, 1).double()
    return q * (1 - q)


def uniform(candidates: int, keep: int, generator: torch.Generator) -> list[int]:
    """`keep` of `candidates` indices uniformly at random without replacement, in candidate order."""
    return sorted(torch.randperm(candidates, generator=generator)[:keep].tolist())


def top_k(scores: Sequence[float], keep: int) -> list[int]:
    """The indices of the `keep` highest scores (ties: the earlier candidate), in candidate order."""
    return sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:keep])


def importance_probabilities(values: torch.Tensor, low: float, high: float, floor: float) -> torch.Tensor:
    """q(x) = (1 - floor) sqrt(v(1 - v)) / sum + floor / n over the candidates (float64, sums to 1); uniform where
    every candidate's predicted spread is 0."""
    check_floor(floor)
    values = torch.as_tensor(values, dtype=torch.float64)
    if values.ndim != 1 or not values.numel() or not torch.isfinite(values).all():
        raise ValueError(f"The predicted prompt values must be a non-empty finite 1-d tensor, got {values.tolist()}.")
    spread = reward_variance(values, low, high).sqrt()
    even = torch.full_like(spread, 1 / values.numel())
    shaped = spread / spread.sum() if spread.sum() > 0 else even
    return (1 - floor) * shaped + floor * even


def importance_weights(probabilities: torch.Tensor) -> torch.Tensor:
    """1 / (n q(x)): the weight that makes a draw from q count as a uniform one (1 when q is uniform)."""
    return 1 / (probabilities.numel() * probabilities)


@dataclass(frozen=True)
class HighestVariance:
    """The "value" rule: top-k by predicted reward variance. Biased: it claims no objective, so it refuses nothing."""

    def __call__(
        self,
        values: torch.Tensor,
        reward_range: tuple[torch.Tensor, torch.Tensor],
        keep: int,
        generator: torch.Generator,
    ) -> Draw:
        scores = reward_variance(values, *reward_range).tolist()  # the draw's one transfer: decided on the host
        return Draw(top_k(scores, keep), scores=scores)

    def check_objective(self, config: Any) -> None:
        return None


# TRL `loss_type` -> how the importance sampler's weighted step keeps the uniform objective under it. Every loss is
# positively homogeneous in the advantages, so a row's weight may multiply them; what differs is the normaliser.
# "constant": the loss divides by something the draw does not change (grpo/sapo: each sequence over its own tokens,
# then the mean over the micro-batch's rows; dr_grpo: rows x max_completion_length; luspo: the mean over rows), so the
# weighted step's expectation is the uniform one, exactly. "weighted token count": the loss divides by
# `num_items_in_batch`, the generation batch's token count, which the trainer replaces by the importance-weighted count
# (each row's tokens times its weight, the weights rescaled to sum to the rows; unchanged under uniform draws), so
# numerator and denominator both estimate the uniform batch's; the ratio's finite-batch difference from the uniform
# step is measured by exact enumeration in docs/prompt-selection.md. A loss missing here (TRL's "bnpo": the
# micro-batch's own token count, computed inside TRL's loss) is refused.
IMPORTANCE_LOSS_TYPES = {
    "grpo": "constant",
    "dr_grpo": "constant",
    "sapo": "constant",
    "luspo": "constant",
    "dapo": "weighted token count",
    "cispo": "weighted token count",
    "vespo": "weighted token count",
}


@dataclass(frozen=True)
class Importance:
    """The "importance" rule: `keep` draws with replacement from `importance_probabilities` at `floor`, with their
    weights."""

    floor: float = field(default=DEFAULT_FLOOR, metadata={"config": "prompt_selection_floor"})

    def __post_init__(self):
        check_floor(self.floor)

    def __call__(
        self,
        values: torch.Tensor,
        reward_range: tuple[torch.Tensor, torch.Tensor],
        keep: int,
        generator: torch.Generator,
    ) -> Draw:
        bounds = torch.stack([torch.as_tensor(b, device=values.device).reshape(()) for b in reward_range])
        host = (
            torch.cat([values.detach().flatten(), bounds.to(values.dtype)]).double().cpu()
        )  # the draw's one transfer
        values, (low, high) = host[:-2], host[-2:].tolist()
        q = importance_probabilities(values, low, high, self.floor)
        indices = sorted(torch.multinomial(q, keep, replacement=True, generator=generator).tolist())
        weights = importance_weights(q)[indices].tolist()
        return Draw(indices, weights, reward_variance(values, low, high).tolist())

    def check_objective(self, config: Any) -> None:
        """The importance weights multiply the advantages only: refuse the loss terms and normalisers they cannot
        reach, which would average over the q-tilted prompts instead of the uniform ones."""
        if config.loss_type not in IMPORTANCE_LOSS_TYPES:
            working = ", ".join(map(repr, IMPORTANCE_LOSS_TYPES))
            raise ValueError(
                f"prompt_selection='importance' with loss_type={config.loss_type!r}: the importance weights keep the "
                "uniform objective only where the loss divides by a constant or by the generation batch's token "
                "count, which the trainer weights ('bnpo' divides by the micro-batch's, counted inside TRL's loss). "
                f"Use one of {working} (the default 'dapo' included), or set prompt_selection=None."
            )
        unseen = "does not see the advantages, which carry the importance weights"
        terms = {
            "beta": (config.beta != 0.0, "beta=0.0", f"the KL penalty {unseen}"),
            "entropy_coef": (config.entropy_coef != 0.0, "entropy_coef=0.0", f"the entropy bonus {unseen}"),
            "use_adaptive_entropy": (
                config.use_adaptive_entropy,
                "use_adaptive_entropy=False",
                f"the entropy bonus {unseen}",
            ),
            "top_entropy_quantile": (
                config.top_entropy_quantile < 1.0,
                "top_entropy_quantile=1.0",
                "the top-entropy token mask takes its quantile over the drawn batch's tokens",
            ),
        }
        for name, (active, fix, why) in terms.items():
            if active:
                raise ValueError(
                    f"prompt_selection='importance' with {name}={getattr(config, name)!r}: {why}, so it averages over "
                    "prompts drawn in proportion to q instead of uniform ones and the step no longer targets the "
                    f"uniform objective. Set {fix}, or prompt_selection=None."
                )


RULES: dict[str, type] = {"value": HighestVariance, "importance": Importance}


def rule_from_config(config: Any) -> Rule:
    """The rule `config.prompt_selection` names, its settings read from the config fields its fields name."""
    if config.prompt_selection not in RULES:
        raise ValueError(
            f"prompt_selection={config.prompt_selection!r} is not a sampling rule: choose one of {sorted(RULES)}."
        )
    rule = RULES[config.prompt_selection]
    return rule(**{f.name: getattr(config, f.metadata["config"]) for f in fields(rule)})


def draw(
    rule: Rule,
    candidates: int,
    keep: int,
    values: torch.Tensor | None = None,
    reward_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    seed: int,
    rank: int,
    step: int,
) -> Draw:
    """One process's draw of `keep` of its `candidates` prompts under `rule` (e.g. `rule_from_config`), seeded by
    (seed, rank, step). Without predicted `values` (no trusted probe yet) every rule draws uniformly without
    replacement, weights 1."""
    generator = draw_generator(seed, rank, step)
    if values is None or reward_range is None:
        return Draw(uniform(candidates, keep, generator))
    return rule(values, reward_range, keep, generator)

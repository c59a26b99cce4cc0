"""Prompt sampling: which of a generation batch's candidate prompts to generate for, from predicted prompt values.
Pure torch; the trainer's mixin (selection.py) and the benches call it, and it knows nothing of either.

A rule is one entry of `RULES` (the name `prompt_selection` takes): it maps the candidates' predicted values (None
while no probe is trusted), the observed reward range, how many to keep, a seeded generator and the floor (the share
of uniform probability a rule that draws in proportion keeps on every candidate) to a `Draw`, the kept candidates with
their importance weights. Draws are seeded from (seed, rank, step) alone (`draw_generator`), so a
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Every weight is at most 1 / floor = 2. `bench gradient` on SmolLM2's two start pools at this floor (the committed
# benchmarks/real-lm/gradient/start*/results.md): the probe sampler took POISE (default) from 0.97x and 0.82x of
# GRPO G=8's completions (floor 1: no sampler) to 0.78x and 0.66x. On the toy every floor from 0.05 to 1 gives
# 0.57x-0.59x (benchmarks/gradient-toy-floors/). Other floors on SmolLM2 were not kept: no optimum is claimed.
DEFAULT_FLOOR = 0.5


@dataclass(frozen=True)
class Draw:
    """The kept candidates (indices into the candidate list, in candidate order, repeats allowed for a rule that draws
    with replacement), each one's importance weight (None: all 1), and each candidate's score (None: drawn blind)."""

    indices: list[int]
    weights: list[float] | None = None
    scores: list[float] | None = None


Rule = Callable[
    [int, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, int, torch.Generator, float], Draw
]
"""(candidates, predicted values (M,) or None, observed reward range or None, keep, generator, floor) -> Draw."""


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


def check_floor(floor: float) -> None:
    if not (isinstance(floor, int | float) and 0 < floor <= 1):
        raise ValueError(
            f"prompt_selection_floor={floor!r} must be in (0, 1]: the share of uniform probability every candidate "
            "keeps, so that each has a positive probability and a weight of at most 1 / floor (1: uniform)."
        )


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


def highest_variance(
    candidates: int,
    values: torch.Tensor | None,
    reward_range: tuple[torch.Tensor, torch.Tensor] | None,
    keep: int,
    generator: torch.Generator,
    floor: float,
) -> Draw:
    """The "value" rule: top-k by predicted reward variance; uniform while there is no prediction. Biased."""
    if values is None or reward_range is None:
        return Draw(uniform(candidates, keep, generator))
    scores = reward_variance(values, *reward_range).tolist()  # the draw's one transfer: decided on the host
    return Draw(top_k(scores, keep), scores=scores)


def importance(
    candidates: int,
    values: torch.Tensor | None,
    reward_range: tuple[torch.Tensor, torch.Tensor] | None,
    keep: int,
    generator: torch.Generator,
    floor: float,
) -> Draw:
    """The "importance" rule: `keep` draws with replacement from `importance_probabilities`, with their weights;
    uniform without replacement, weights 1, while there is no prediction."""
    if values is None or reward_range is None:
        return Draw(uniform(candidates, keep, generator))
    bounds = torch.stack([torch.as_tensor(b, device=values.device).reshape(()) for b in reward_range])
    host = torch.cat([values.detach().flatten(), bounds.to(values.dtype)]).double().cpu()  # the draw's one transfer
    values, (low, high) = host[:-2], host[-2:].tolist()
    q = importance_probabilities(values, low, high, floor)
    indices = sorted(torch.multinomial(q, keep, replacement=True, generator=generator).tolist())
    weights = importance_weights(q)[indices].tolist()
    return Draw(indices, weights, reward_variance(values, low, high).tolist())


RULES: dict[str, Rule] = {"value": highest_variance, "importance": importance}


def draw(
    rule: str,
    candidates: int,
    keep: int,
    values: torch.Tensor | None = None,
    reward_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    seed: int,
    rank: int,
    step: int,
    floor: float = DEFAULT_FLOOR,
) -> Draw:
    """One process's draw of `keep` of its `candidates` prompts under the rule named `rule`, seeded by (seed, rank,
    step); `floor` is the importance rule's share of uniform probability."""
    if rule not in RULES:
        raise ValueError(f"prompt_selection={rule!r} is not a sampling rule: choose one of {sorted(RULES)}.")
    return RULES[rule](candidates, values, reward_range, keep, draw_generator(seed, rank, step), floor)

"""Prompt sampling: which of a generation batch's candidate prompts to generate for, from predicted prompt values.
Pure torch; the trainer's mixin (selection.py) and the benches call it, and it knows nothing of either.

A rule is one entry of `RULES` (the name `prompt_selection` takes): it maps the candidates' predicted values (None
while no probe is trusted), the observed reward range, how many to keep and a seeded generator to a `Draw`, the kept
candidates with their importance weights. Draws are seeded from (seed, rank, step) alone (`draw_generator`), so a
resumed run draws what the uninterrupted one drew without saving a counter.

- "value" (beyond the paper): the `keep` candidates of highest predicted reward variance q(1 - q), q the predicted
  value read on the observed reward range (`reward_variance`); at random, uniformly, until a probe is trusted. Every
  weight is 1: the kept prompts are trained on as they come.

A rule that draws with replacement in proportion to some q(x) returns the weights 1 / (n q(x)) that keep the
gradient unbiased, in `Draw.weights`; the trainer does not apply weights yet, so such a rule comes with that step.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Draw:
    """The kept candidates (indices into the candidate list, in candidate order, repeats allowed for a rule that draws
    with replacement), each one's importance weight (None: all 1), and each candidate's score (None: drawn blind)."""

    indices: list[int]
    weights: list[float] | None = None
    scores: list[float] | None = None


Rule = Callable[[int, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, int, torch.Generator], Draw]
"""(candidates, predicted values (M,) or None, observed reward range or None, keep, generator) -> Draw."""


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


def highest_variance(
    candidates: int,
    values: torch.Tensor | None,
    reward_range: tuple[torch.Tensor, torch.Tensor] | None,
    keep: int,
    generator: torch.Generator,
) -> Draw:
    """The "value" rule: top-k by predicted reward variance; uniform while there is no prediction."""
    if values is None or reward_range is None:
        return Draw(uniform(candidates, keep, generator))
    scores = reward_variance(values, *reward_range).tolist()  # the draw's one transfer: decided on the host
    return Draw(top_k(scores, keep), scores=scores)


RULES: dict[str, Rule] = {"value": highest_variance}


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
) -> Draw:
    """One process's draw of `keep` of its `candidates` prompts under the rule named `rule`, seeded by (seed, rank,
    step)."""
    if rule not in RULES:
        raise ValueError(f"prompt_selection={rule!r} is not a sampling rule: choose one of {sorted(RULES)}.")
    return RULES[rule](candidates, values, reward_range, keep, draw_generator(seed, rank, step))

"""The prompt samplers `bench gradient` measures: each maps a pool's prompts to positive scores u_x, prompts are drawn
with probability u_x / Σu and weighted 1 / (n q) (`exact.summarize`), so every sampled row stays unbiased and only its
variance moves.

- the oracle sampler reads sqrt(E[(r − b)² | x]) off the pool's own rollouts: the headroom, which no deployed sampler
  has (it would need the rollouts before generating them);
- the probe sampler is what `prompt_selection="importance"` draws online: q from the estimator's prompt-only probe
  (`POISEEstimator.prompt_values`), mixed with uniform at `prompt_selection_floor`
  (`sampling.importance_probabilities`), predicted from the prompt block alone, before anything is generated.
"""

import numpy as np
import torch

from poise_trl.estimator.estimator import POISEEstimator
from poise_trl.sampling import importance_probabilities

from .exact import pair_sampler_score
from .value.collect import Collection

ORACLE_FLOOR = 0.05  # the oracle sampler's score is floored at this share of its mean: every prompt stays possible
SAMPLED = {"poise": "POISE (default)", "grpo8": "GRPO G=8"}  # the rules measured again under each sampler


def oracle_samplers(rewards: np.ndarray, poise_values: np.ndarray | None, rules: list[str]) -> dict[str, np.ndarray]:
    """q(x) ∝ sqrt(E[(r − b)² | x]) read off the pool, floored at `ORACLE_FLOOR` of its mean: b is POISE (default)'s
    partner value, or for GRPO G=8 the other rollouts' mean reward (E[(r − b)² | x] ∝ p(1 − p) for every G, so RLOO's
    pair score serves)."""
    scores = {}
    if "poise" in rules and poise_values is not None:
        scores["poise_sampler"] = pair_sampler_score(rewards, poise_values.reshape(rewards.shape))
    if "grpo8" in rules:
        scores["grpo8_sampler"] = pair_sampler_score(rewards, rewards)
    return {rule: np.maximum(score, ORACLE_FLOOR * score.mean()) for rule, score in scores.items()}


def probe_sampler(
    estimator: POISEEstimator,
    collection: Collection,
    layer: int,
    pool: int,
    floor: float,
    prompt_ids: torch.Tensor | None = None,
) -> np.ndarray:
    """(P,) the importance sampler's probabilities over the pool's prompts, from `estimator`'s prompt-only probe on
    each prompt's prompt block at (`layer`, `pool`) (and, with `history`, the prompt's history by each row's (N,)
    `prompt_ids`), as `prompt_selection="importance"` draws them online."""
    prompt_block = collection.columns(["prompt"], layer, pool)
    first = torch.as_tensor(np.unique(collection.prompt_index.numpy(), return_index=True)[1])
    values = estimator.prompt_values(prompt_block[first], None if prompt_ids is None else prompt_ids[first])
    if values is None:
        raise RuntimeError("the probe sampler needs a trusted probe with buffered rows: give more --probe-prompts")
    low, high = (float(b) for b in estimator.target_range())
    return importance_probabilities(values, low, high, floor).numpy()


def sampled_rows(rules: list[str], oracle: bool, probe: bool) -> dict[str, str]:
    """{row name: base rule} of the sampled rows to measure: each of `SAMPLED` present in `rules`, under the oracle
    and/or the probe sampler."""
    kinds = [kind for kind, on in (("sampler", oracle), ("probe_sampler", probe)) if on]
    return {f"{rule}_{kind}": rule for rule in SAMPLED if rule in rules for kind in kinds}


def row_labels() -> dict[str, str]:
    """Table labels of every sampled row."""
    out = {}
    for rule, name in SAMPLED.items():
        group = "" if rule == "grpo8" else " G=2"
        out[f"{rule}_sampler"] = f"{name} + oracle sampler{group}"
        out[f"{rule}_probe_sampler"] = f"{name} + probe sampler{group}"
    return out

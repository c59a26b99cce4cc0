"""The sampler's prompt values: each candidate prompt's expected reward, predicted before generating from its prompt
block alone. Pure torch; which prompts to draw from these values is sampling.py's.

A prompt-only head is fitted on the buffered rows' prompt block against their leave-one-out targets (whose mean per
prompt is the prompt's success rate), at the layer in use. Its rows come from earlier steps only.
"""

from collections.abc import Sequence

import torch

from .heads import ValueHead
from .learner import OnlineLearner


def fit_prompt_values(
    learners: Sequence[OnlineLearner],
    columns: tuple[int, int],
    layer_index: int,
    head: ValueHead,
    min_rows: int,
    prompt_features: torch.Tensor,
    last_columns: int = 0,
) -> torch.Tensor | None:
    """(M,) predicted success value of each candidate prompt from its (M, width + last_columns) `prompt_features`, the
    prompt block and then the prompt's own `last_columns` (its history): the unfitted `head` (settings for those
    columns) fitted on every learner's buffered prompt-block columns [start, stop) of slice `layer_index` beside its
    last `last_columns` columns. None with fewer than `min_rows` rows buffered."""
    buffers = [learner.buffer for learner in learners if len(learner.buffer)]
    if sum(map(len, buffers)) < min_rows:
        return None
    start, stop = columns
    device = prompt_features.device
    x = torch.cat([b.features[:, layer_index, start:stop] for b in buffers])
    if last_columns:
        last = torch.cat([b.features[:, layer_index, -last_columns:] for b in buffers])
        x = torch.cat([x, last], dim=1)
    x = x.to(device)
    y = torch.cat([b.targets for b in buffers]).to(device)
    return head.fit(x, y, check_finite=False).predict(prompt_features)  # buffered rows are finite


def target_range(learners: Sequence[OnlineLearner]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) buffered target over the learners: the observed reward range prompt values are read on
    (0-d tensors, left on the buffers' device)."""
    targets = torch.cat([learner.buffer.targets for learner in learners if len(learner.buffer)])
    return targets.min(), targets.max()

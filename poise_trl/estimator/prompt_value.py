"""The sampler's prompt values: each candidate prompt's expected reward, predicted before generating from its prompt
block alone. Pure torch; which prompts to draw from these values is sampling.py's.

A prompt-only head is fitted on the buffered rows' prompt block against their leave-one-out targets (whose mean per
prompt is the prompt's success rate), at the layer in use. Its rows come from earlier steps only.
"""

from collections.abc import Sequence

import torch

from ..heads.interface import ValueHead
from .learner import OnlineLearner
from .row import FeatureRow


def fit_prompt_values(
    learners: Sequence[OnlineLearner],
    columns: tuple[int, int],
    layer_index: int,
    head: ValueHead,
    min_rows: int,
    prompt_features: torch.Tensor,
    row: FeatureRow | None = None,
) -> torch.Tensor | None:
    """(M,) predicted success value of each candidate prompt from its (M, ...) `prompt_features`, laid out as
    `row.prompt_inputs` lays out a buffered row (the prompt block [start, stop), then its history if the row holds
    one): the unfitted `head` (settings for those columns) fitted on every learner's buffered rows of slice
    `layer_index`. None with fewer than `min_rows` rows buffered."""
    buffers = [learner.buffer for learner in learners if len(learner.buffer)]
    if sum(map(len, buffers)) < min_rows:
        return None
    row = FeatureRow() if row is None else row
    device = prompt_features.device
    x = torch.cat([row.prompt_inputs(b.features[:, layer_index], columns) for b in buffers]).to(device)
    y = torch.cat([b.targets for b in buffers]).to(device)
    return head.fit(x, y, check_finite=False).predict(prompt_features)  # buffered rows are finite


def target_range(learners: Sequence[OnlineLearner]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) buffered target over the learners: the observed reward range prompt values are read on
    (0-d tensors, left on the buffers' device)."""
    targets = torch.cat([learner.buffer.targets for learner in learners if len(learner.buffer)])
    return targets.min(), targets.max()

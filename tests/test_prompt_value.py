"""The sampler's prompt values: a prompt-only head fitted on the buffered rows' prompt block, earlier steps only."""

import torch

from poise_trl.estimator.learner import OnlineLearner
from poise_trl.estimator.prompt_value import fit_prompt_values, target_range
from poise_trl.heads.probe import ValueProbe


def _learner(seed: int, n: int = 24) -> OnlineLearner:
    g = torch.Generator().manual_seed(seed)
    learner = OnlineLearner(ValueProbe(alpha=1.0), capacity=64)
    x = torch.randn(n, 2, 7, generator=g)  # two candidate layers; columns 2..5 are the prompt block
    return learner.added(x, (x[:, 1, 2] > 0).float())


def test_the_prompt_head_reads_the_prompt_block_of_the_layer_in_use_over_every_learner():
    learners = [_learner(0), _learner(1)]
    candidates = torch.randn(5, 3)
    values = fit_prompt_values(learners, (2, 5), 1, ValueProbe(alpha=1.0, clip="observed"), 4, candidates)
    x = torch.cat([learner.buffer.features[:, 1, 2:5] for learner in learners])
    y = torch.cat([learner.buffer.targets for learner in learners])
    assert torch.equal(values, ValueProbe(alpha=1.0, clip="observed").fit(x, y).predict(candidates))
    assert [float(v) for v in target_range(learners)] == [0.0, 1.0]


def test_too_few_buffered_rows_give_no_values():
    learners = [_learner(0, n=3), OnlineLearner(ValueProbe(), capacity=8)]
    assert fit_prompt_values(learners, (2, 5), 0, ValueProbe(), 4, torch.randn(2, 3)) is None

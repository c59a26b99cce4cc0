"""`poise_trl.sampling`: the prompt-sampling rules as pure functions of (seed, rank, step)."""

import pytest
import torch

from poise_trl import sampling


def test_the_value_rule_keeps_the_highest_predicted_variance_or_draws_uniformly_without_a_prediction():
    values = torch.tensor([0.0, 0.9, 0.5, 1.0, 0.4, 0.2])  # q(1-q): 0, .09, .25, 0, .24, .16
    drawn = sampling.draw("value", 6, 2, values, (torch.tensor(0.0), torch.tensor(1.0)), seed=0, rank=0, step=3)
    assert drawn.indices == [2, 4] and drawn.weights is None and drawn.scores[2] == pytest.approx(0.25)
    blind = [sampling.draw("value", 6, 3, seed=0, rank=rank, step=step) for rank in (0, 1) for step in range(20)]
    assert all(len(d.indices) == 3 == len(set(d.indices)) and d.scores is None for d in blind)
    assert len({tuple(d.indices) for d in blind}) > 5  # ranks and steps draw differently
    again = sampling.draw("value", 6, 3, seed=0, rank=1, step=7)
    assert again == blind[20 + 7]  # a pure function of (seed, rank, step): a resumed run draws the same


def test_an_unknown_rule_is_refused_with_the_rules_there_are():
    with pytest.raises(ValueError, match=r"prompt_selection='nope' is not a sampling rule: choose one of \['value'\]"):
        sampling.draw("nope", 4, 2, seed=0, rank=0, step=0)

"""Layer choice: prompt-grouped K-fold errors per candidate layer, and the hysteresis that keeps a layer."""

import torch

from poise_trl.estimator.layer_choice import choose_layer, grouped_kfold_errors, select_layer
from poise_trl.estimator.learner import OnlineLearner
from poise_trl.heads.probe import ValueProbe


def test_kfold_keeps_a_prompts_rows_in_one_fold_and_finds_the_informative_slice():
    g = torch.Generator().manual_seed(0)
    n_groups, per_group = 40, 2
    groups = torch.arange(n_groups).repeat_interleave(per_group) * 7919  # arbitrary ids, like prompt hashes
    label = (torch.rand(n_groups, generator=g) > 0.5).float()  # one target per prompt, shared by its rollouts
    targets = label.repeat_interleave(per_group)
    # Slice 0: a one-hot of the group, so a probe that saw a row's group would memorise its target.
    memorise = torch.eye(n_groups).repeat_interleave(per_group, 0)
    signal = torch.randn(n_groups * per_group, n_groups, generator=g)
    signal[:, 0] = targets + 0.1 * torch.randn(n_groups * per_group, generator=g)  # slice 1 reveals the target
    noise = torch.randn(n_groups * per_group, n_groups, generator=g)  # slice 2 reveals nothing
    x = torch.stack([memorise, signal, noise], dim=1)
    template = ValueProbe(alpha=1e-3, clip=(0.0, 1.0))
    errors = grouped_kfold_errors(template, x, targets, groups, folds=5)
    assert errors.shape == (3, n_groups * per_group)
    # Rows of one group share their one-hot feature: had the group been split across folds, slice 0 would be
    # nearly exact. Grouped, slice 0 predicts a held-out group from nothing it has seen.
    assert errors[0].mean() > 0.3
    ungrouped = grouped_kfold_errors(template, x, targets, None, folds=5)  # every row its own group: leaks
    assert ungrouped[0].mean() < 0.1
    assert errors[1].mean() < errors[2].mean() - 0.2 and int(errors.mean(1).argmin()) == 1
    assert grouped_kfold_errors(template, x[:8], targets[:8], groups[:8], folds=5) is None  # 4 groups < 5 folds


def test_choose_layer_switches_only_past_the_margin():
    assert choose_layer([1.0, 0.97, 1.2], current=0, margin=0.05) == 0  # 3% better: stay
    assert choose_layer([1.0, 0.90, 1.2], current=0, margin=0.05) == 1
    assert choose_layer([1.0, 0.97, 1.2], current=0, margin=0.0) == 1
    assert choose_layer([0.5, 0.97, 1.2], current=2, margin=0.05) == 0


def test_select_layer_pools_every_learners_errors_and_waits_for_enough_prompts():
    g = torch.Generator().manual_seed(1)
    learners = []
    for _ in range(2):  # two domains: their held-out errors are averaged together
        learner = OnlineLearner(ValueProbe(alpha=1e-3, clip=(0.0, 1.0)), capacity=200)
        targets = (torch.rand(60, generator=g) > 0.5).float()
        informative = targets.unsqueeze(1) + 0.05 * torch.randn(60, 3, generator=g)
        x = torch.stack([torch.randn(60, 3, generator=g), informative], dim=1)  # slice 1 reveals the target
        learners.append(learner.added(x, targets, torch.arange(60) // 2))
    index, metrics = select_layer(learners, [4, 9], current=0, margin=0.05, folds=3)
    assert index == 1 and set(metrics) == {"layer_mae/4", "layer_mae/9"}
    assert metrics["layer_mae/9"] < metrics["layer_mae/4"]
    few = OnlineLearner(ValueProbe(alpha=1.0), capacity=8)
    few = few.added(torch.randn(4, 2, 3), torch.rand(4), torch.tensor([0, 0, 1, 1]))
    assert select_layer([few], [4, 9], current=0, margin=0.05, folds=3) == (0, {})  # 2 prompts < 3 folds

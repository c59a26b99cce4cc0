"""Value-guided prompt selection on two CPU processes (gloo): each rank selects whole groups from its own shard."""

from pathlib import Path

import pytest

from .distributed.launch import launch

SCRIPT = Path(__file__).parent / "distributed" / "selection_ranks.py"


def test_two_ranks_select_whole_groups_from_their_own_shards(tiny_model_path, tmp_path):
    rank0, rank1 = launch(SCRIPT, [str(tiny_model_path), str(tmp_path)], tmp_path)
    assert len(rank0["steps"]) == len(rank1["steps"]) == 3
    for step0, step1 in zip(rank0["steps"], rank1["steps"], strict=True):
        assert not set(step0["candidates"]) & set(step1["candidates"])  # disjoint shards
        for step in (step0, step1):
            assert len(step["candidates"]) == 8 and len(step["kept"]) == 4  # 4 candidate groups, 2 kept, G=2
            assert step["kept"][0::2] == step["kept"][1::2]  # whole groups
            assert set(step["kept"]) <= set(step["candidates"])
    assert rank0["probe"] == rank1["probe"]
    assert rank0["metrics"] == rank1["metrics"]  # gathered: every rank logs the same selection metrics
    metrics = rank0["metrics"]
    assert metrics["poise/selection/random"] == [1.0, 0.0, 0.0]
    assert metrics["poise/selection/kept_fraction"] == [0.5] * 3
    assert metrics["poise/selection/prefill_tokens"][0] == 0
    for step, tokens in zip(range(1, 3), metrics["poise/selection/prefill_tokens"][1:], strict=True):
        candidates = rank0["steps"][step]["candidates"][::2] + rank1["steps"][step]["candidates"][::2]
        assert tokens == sum(map(len, candidates))  # one character token per character, both ranks counted


def test_two_ranks_draw_by_importance_and_every_rank_weighs_every_row_of_each_drawn_group(tiny_model_path, tmp_path):
    rank0, rank1 = launch(SCRIPT, [str(tiny_model_path), str(tmp_path), "importance"], tmp_path)
    weighted = 0
    for step0, step1 in zip(rank0["steps"], rank1["steps"], strict=True):
        assert not set(step0["candidates"]) & set(step1["candidates"])  # disjoint shards
        for step in (step0, step1):
            assert len(step["kept"]) == len(step["weights"]) == 4 and step["kept"][0::2] == step["kept"][1::2]
            assert step["weights"][0::2] == step["weights"][1::2]  # one weight per drawn group, on both its rows
            assert set(step["kept"]) <= set(step["candidates"])
        assert step0["gathered_weights"] == step1["gathered_weights"] == step0["weights"] + step1["weights"]
        weighted += step0["gathered_weights"] != [1.0] * 8
    assert rank0["steps"][0]["gathered_weights"] == [1.0] * 8 and weighted >= 1  # uniform until the probe is trusted
    assert rank0["metrics"] == rank1["metrics"]
    metrics = rank0["metrics"]
    for step, mean, largest in zip(
        rank0["steps"], metrics["poise/selection/weight_mean"], metrics["poise/selection/weight_max"], strict=True
    ):
        assert mean == pytest.approx(sum(step["gathered_weights"]) / 8) and largest == max(step["gathered_weights"])

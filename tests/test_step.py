"""step.py with plain tensors: regrouping TRL's shuffle, the micro-batch guard and the generation batch's record."""

import pytest
import torch
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from poise_trl.estimator.batch import Rollouts
from poise_trl.features.prefix import PrefixBatch
from poise_trl.grpo.contract import ContractError
from poise_trl.grpo.step import (
    GenerationStep,
    MicroBatch,
    check_whole_groups,
    concat_prefix,
    join_rows,
    take_rows,
    whole_groups,
)


def _shuffled_by_trl(batch: dict, seed: int) -> dict:
    torch.manual_seed(seed)
    return shuffle_sequence_dict(batch)


def test_whole_groups_regroups_trls_shuffle_by_its_own_draw():
    batch = {
        "ids": torch.arange(12).view(6, 2),
        "rows": torch.arange(6),
        "names": list("abcdef"),
        "count": torch.tensor(5),
        "none": None,
    }
    shuffled = _shuffled_by_trl(batch, 3)
    state = torch.get_rng_state()
    regrouped = take_rows(shuffled, whole_groups(shuffled["rows"], group_size=2))
    assert torch.equal(state, torch.get_rng_state())  # no draw of its own: the random stream stays GRPOTrainer's
    rows = regrouped["rows"].view(-1, 2)
    assert torch.equal(rows[:, 1] - rows[:, 0], torch.ones(3, dtype=torch.long))  # whole groups, in order
    assert (rows[:, 0] % 2 == 0).all() and sorted(regrouped["rows"].tolist()) == list(range(6))
    first_drawn = [r // 2 for r in shuffled["rows"].tolist()]
    assert (rows[:, 0] // 2).tolist() == list(dict.fromkeys(first_drawn))  # each group where its first row went
    assert regrouped["names"] == [batch["names"][i] for i in regrouped["rows"].tolist()]
    assert torch.equal(regrouped["ids"], batch["ids"][regrouped["rows"]])
    assert regrouped["count"] is batch["count"] and regrouped["none"] is None


def test_whole_groups_reaches_every_order_of_the_groups():
    seen = set()
    for seed in range(200):
        shuffled = _shuffled_by_trl({"rows": torch.arange(6)}, seed)
        seen.add(tuple(take_rows(shuffled, whole_groups(shuffled["rows"], 2))["rows"].tolist()))
    assert len(seen) == 6  # 3! orders of three groups


def test_join_rows_is_the_inverse_of_trls_split():
    batch = {"ids": torch.arange(8).view(4, 2), "names": list("abcd"), "count": torch.tensor(4), "none": None}
    joined = join_rows(split_tensor_dict(batch, 2))
    assert torch.equal(joined["ids"], batch["ids"]) and joined["names"] == batch["names"]
    assert joined["count"] is batch["count"] and joined["none"] is None


@pytest.mark.parametrize(
    "rows, whole",
    [([2, 3, 0, 1], True), ([1, 0], True), ([0, 1, 2], False), ([1, 2], False), ([0, 2, 1, 3], True), ([0, 0], False)],
)
def test_check_whole_groups_refuses_a_split_group(rows, whole):
    if whole:
        check_whole_groups(rows, 2)
    else:
        with pytest.raises(RuntimeError, match="not whole groups of 2 rollouts"):
            check_whole_groups(rows, 2)


def test_a_loss_route_micro_batch_refuses_its_advantages_until_written():
    step = GenerationStep("train", "loss")
    batch = MicroBatch({"advantages": torch.full((2,), torch.nan)}, step)
    with pytest.raises(ContractError, match="'loss_forward'"):
        batch["advantages"]
    with pytest.raises(ContractError, match="'loss_forward'"):
        batch.get("advantages")
    batch["advantages"] = torch.ones(2)
    batch.written = True
    assert torch.equal(batch.get("advantages"), torch.ones(2))
    assert MicroBatch({"advantages": torch.ones(2)}, None).written


def _prefix(rows: torch.Tensor) -> PrefixBatch:
    n = rows.numel()
    return PrefixBatch(
        rows=rows.view(n, 1, 1).float(),
        sampled=torch.ones(n, 1, dtype=torch.bool),
        values=rows.view(n, 1).float(),
        generated=torch.ones(n, 1, dtype=torch.bool),
        tokens=torch.zeros(n, 1, dtype=torch.long),
    )


def test_the_record_assembles_micro_batches_in_the_batchs_row_order():
    step = GenerationStep("train", "loss", rows=6, offset=6)
    for rows in (torch.tensor([4, 5, 0, 1]), torch.tensor([3, 2])):
        step.add(rows, rows.view(-1, 1, 1).float() * 10, _prefix(rows))
        assert not step.complete or rows.numel() == 2
    assert step.complete
    features, prefix = step.assemble()
    assert features.flatten().tolist() == [0, 10, 20, 30, 40, 50]
    assert prefix.values.flatten().tolist() == [0, 1, 2, 3, 4, 5]


def test_the_record_refuses_rows_captured_twice_or_missing():
    step = GenerationStep("train", "loss", rows=4)
    step.add(torch.tensor([0, 1]), torch.zeros(2, 1, 1), None)
    step.add(torch.tensor([1, 0]), torch.zeros(2, 1, 1), None)
    assert step.complete  # four rows captured, but two of them twice
    with pytest.raises(RuntimeError, match="not each of the batch's 4 rows once"):
        step.assemble()


def test_the_record_of_a_micro_batch_holds_its_global_rows():
    step = GenerationStep("train", "loss", rows=4, offset=4)
    step.rollouts = Rollouts(torch.arange(8.0), num_generations=2, domains=list("abcdefgh"))
    part = step.rollouts_of(torch.tensor([2, 3]))
    assert part.rewards.tolist() == [6.0, 7.0] and part.domains == ["g", "h"]
    assert part.weights is None and part.num_generations == 2


def test_concat_prefix_orders_every_field():
    prefix = concat_prefix([_prefix(torch.tensor([2, 0])), _prefix(torch.tensor([1]))], torch.tensor([1, 2, 0]))
    assert prefix.values.flatten().tolist() == [0, 1, 2] and prefix.rows.flatten().tolist() == [0, 1, 2]


def test_an_unknown_route_is_refused():
    with pytest.raises(ValueError, match="route='forward'"):
        GenerationStep("train", "forward")

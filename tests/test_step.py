"""step.py with plain tensors: the whole-group shuffle and the generation batch's record."""

import pytest
import torch
from trl.trainer.utils import shuffle_sequence_dict

from poise_trl.batch import Rollouts
from poise_trl.prefix import PrefixBatch
from poise_trl.step import GenerationStep, concat_prefix, shuffle_groups


def test_shuffle_groups_keeps_groups_whole_and_draws_what_trls_shuffle_draws():
    batch = {
        "ids": torch.arange(12).view(6, 2),
        "rows": torch.arange(6),
        "names": list("abcdef"),
        "count": torch.tensor(5),
        "none": None,
    }
    torch.manual_seed(3)
    shuffled = shuffle_groups(batch, group_size=2)
    after_ours = torch.get_rng_state()
    torch.manual_seed(3)
    shuffle_sequence_dict(batch)
    assert torch.equal(after_ours, torch.get_rng_state())  # the same random stream as GRPOTrainer's
    rows = shuffled["rows"].view(-1, 2)
    assert torch.equal(rows[:, 1] - rows[:, 0], torch.ones(3, dtype=torch.long))  # whole groups, in order
    assert (rows[:, 0] % 2 == 0).all() and sorted(shuffled["rows"].tolist()) == list(range(6))
    assert shuffled["names"] == [batch["names"][i] for i in shuffled["rows"].tolist()]
    assert torch.equal(shuffled["ids"], batch["ids"][shuffled["rows"]])
    assert shuffled["count"] is batch["count"] and shuffled["none"] is None


def test_shuffle_groups_draws_every_order_of_the_groups():
    seen = set()
    for seed in range(200):
        torch.manual_seed(seed)
        seen.add(tuple(shuffle_groups({"rows": torch.arange(6)}, group_size=2)["rows"].tolist()))
    assert len(seen) == 6  # 3! orders of three groups


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

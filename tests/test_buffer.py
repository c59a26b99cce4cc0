"""ProbeBuffer: eviction, growth, masked rows, and the prompt ids that name its rows' groups."""

import pytest
import torch

from poise_trl.estimator.buffer import ProbeBuffer, prompt_group_ids


def test_buffer_evicts_oldest_rows_first():
    buffer = ProbeBuffer(capacity=5)
    buffer.add(torch.arange(3.0).view(3, 1), torch.arange(3.0))
    buffer.add(torch.arange(3.0, 7.0).view(4, 1), torch.arange(3.0, 7.0))
    assert len(buffer) == 5 and buffer.targets.tolist() == [2, 3, 4, 5, 6]
    assert buffer.features[:, 0].tolist() == [2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="Feature width changed"):
        buffer.add(torch.zeros(1, 2), torch.zeros(1))


def test_buffer_grows_as_rows_arrive_and_keeps_the_newest_rows_in_order():
    """A rare domain's buffer takes memory for the rows it holds, not for `capacity`; masked rows never enter."""
    buffer, reference, g = ProbeBuffer(capacity=50), [], torch.Generator().manual_seed(0)
    for step in range(12):
        values = torch.arange(8.0) + 8 * step
        keep = torch.rand(8, generator=g) < 0.7
        buffer.add(values.view(8, 1), values, values.long(), keep=keep)
        buffer.set_counts(*buffer.counts().tolist())  # the estimator's one transfer a step
        reference = (reference + values[keep].tolist())[-50:]
        assert buffer.targets.tolist() == reference and buffer.groups.tolist() == reference
        assert buffer.allocated <= max(2 * len(reference), 8)
    assert buffer.allocated == 50


def test_prompt_ids_are_stable_and_name_equal_prompts_alike():
    prompts = ["a", [{"role": "user", "content": "b"}], "a", {"prompt": "c", "image": object()}]
    ids = prompt_group_ids(prompts)
    assert ids.dtype == torch.long and ids[0] == ids[2] and len(set(ids.tolist())) == 3
    assert torch.equal(ids, prompt_group_ids(prompts))  # the same ids in another call (and process)
    assert prompt_group_ids([{"prompt": "c", "image": object()}])[0] == ids[3]  # unserialisable values: by type


def test_state_round_trips_oldest_first_and_a_loaded_buffer_keeps_growing():
    buffer = ProbeBuffer(4)
    buffer.add(torch.arange(6.0).view(6, 1), torch.arange(6.0), torch.arange(6))
    state = buffer.state_dict()
    assert state["targets"].tolist() == [2, 3, 4, 5] and state["groups"].tolist() == [2, 3, 4, 5]
    loaded = ProbeBuffer(4)
    loaded.load_state_dict(state)
    loaded.add(torch.tensor([[6.0]]), torch.tensor([6.0]), torch.tensor([6]))
    assert loaded.targets.tolist() == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="group ids"):
        loaded.add(torch.tensor([[7.0]]), torch.tensor([7.0]))


@pytest.mark.parametrize("keep", [None, torch.tensor([True, False])])
def test_added_returns_a_new_buffer_and_leaves_this_one_as_it_was_even_when_full(keep):
    """`added` writes into a copy of the ring (the estimator builds its next state from the old one), also once the
    ring is full and the new rows overwrite the oldest."""
    buffer = ProbeBuffer(capacity=3)
    buffer.add(torch.arange(3.0).view(3, 1), torch.arange(3.0))
    new = buffer.added(torch.tensor([[7.0], [8.0]]), torch.tensor([7.0, 8.0]), keep=keep)
    assert buffer.targets.tolist() == [0, 1, 2] and buffer.features[:, 0].tolist() == [0, 1, 2]
    assert new.targets.tolist() == ([2, 7, 8] if keep is None else [1, 2, 7])

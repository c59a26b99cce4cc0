"""row.py: the feature row [φ | partner reward | history], its slices, the columns a PCA leaves out, its assembly,
its projection onto a row with fewer columns, and the prompt-only value's inputs."""

import pytest
import torch

from poise_trl.estimator.history import HISTORY_COLUMNS
from poise_trl.estimator.row import FeatureRow

H = len(HISTORY_COLUMNS)


@pytest.mark.parametrize(
    ("row", "slices"),
    [
        (FeatureRow(False, False), {"features": slice(0, 5)}),
        (FeatureRow(True, False), {"features": slice(0, 5), "partner_reward": slice(5, 6)}),
        (FeatureRow(False, True), {"features": slice(0, 5), "history": slice(5, 5 + H)}),
        (
            FeatureRow(True, True),
            {"features": slice(0, 5), "partner_reward": slice(5, 6), "history": slice(6, 6 + H)},
        ),
    ],
)
def test_slices_lay_the_columns_after_phi_in_order(row, slices):
    assert row.slices(5) == slices and row.appended == sum(s.stop - s.start for s in slices.values()) - 5


def test_an_integer_pca_leaves_the_appended_columns_out_and_blocks_past_phi_are_refused():
    row = FeatureRow(True, True)
    assert row.pca_dims(4) == [(0, -(1 + H), 4)] and row.pca_dims(None) is None and row.pca_dims(0) == 0
    assert FeatureRow(False, False).pca_dims(4) == 4
    row.check_pca([(0, 5, 4)], 5)
    with pytest.raises(ValueError, match="covers column 5, the partner-reward column"):
        row.check_pca([(0, 6, 4)], 5)
    with pytest.raises(ValueError, match="covers column 5, the first history column"):
        FeatureRow(False, True).check_pca([(2, 6, 1)], 5)


def test_assemble_appends_the_reward_then_the_history_to_every_layer_and_project_drops_them():
    phi = torch.arange(24.0).view(4, 2, 3).to(torch.bfloat16)
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.3])
    history = torch.arange(4 * H, dtype=torch.float32).view(4, H)
    rows = FeatureRow(True, True).assemble(phi, rewards, history)
    assert rows.shape == (4, 2, 3 + 1 + H) and rows.dtype == torch.float32
    assert torch.equal(rows[:, :, 3], torch.tensor([1.0, 0.0, 0.0, 0.3]).view(4, 1).expand(4, 2))  # NaN -> 0
    assert torch.equal(rows[:, 1, 4:], history) and torch.equal(rows[..., :3], phi.float())
    assert torch.equal(FeatureRow(True, True).project(rows, FeatureRow(True, False)), rows[..., :4])
    assert torch.equal(FeatureRow(True, True).project(rows, FeatureRow(False, True)), rows[..., [0, 1, 2, 4, 5, 6]])
    with pytest.raises(ValueError, match="do not hold the columns"):
        FeatureRow(True, False).project(rows[..., :4], FeatureRow(True, True))
    with pytest.raises(ValueError, match="needs history columns"):
        FeatureRow(True, True).assemble(phi, rewards)


def test_the_prompt_only_inputs_are_the_prompt_block_then_the_history_for_buffer_and_candidates_alike():
    row = FeatureRow(True, True)
    rows = FeatureRow(True, True).assemble(torch.randn(4, 1, 5), torch.rand(4), torch.rand(4, H))[:, 0]
    inputs = row.prompt_inputs(rows, (1, 3))
    assert torch.equal(inputs, torch.cat([rows[:, 1:3], rows[:, -H:]], 1))
    candidates = row.assemble_prompt(rows[:, 1:3], rows[:, -H:])
    assert torch.equal(candidates, inputs)
    assert row.prompt_pca_dims((1, 3), 1) == [(0, 2, 1)] and row.prompt_pca_dims((1, 3), 0) is None
    assert torch.equal(FeatureRow(True, False).prompt_inputs(rows[:, :6], (1, 3)), rows[:, 1:3])

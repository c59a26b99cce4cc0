"""The value-head table: every entry satisfies the head interface, and a saved head is rebuilt by name."""

import pytest
import torch

from poise_trl.heads import HEADS, ValueHead, head_from_config
from poise_trl.probe import ValueProbe


def test_every_head_in_the_table_has_the_interface_and_its_name():
    assert HEADS == {"ridge": ValueProbe}
    for name, head in HEADS.items():
        assert head.name == name and isinstance(head(), ValueHead)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_head_is_rebuilt_from_its_name_and_config_and_predicts_as_saved(name):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g), torch.rand(40, generator=g)
    head = HEADS[name]().fit(x, y)
    rebuilt = head_from_config(head.config(), name)
    assert not rebuilt.is_fitted and rebuilt.config() == head.config()
    rebuilt.load_state_dict(head.state_dict())
    assert torch.equal(rebuilt.predict(x), head.predict(x))
    assert not head.clone().is_fitted and head.clone().config() == head.config()


def test_files_without_a_head_name_hold_ridge_and_unknown_names_are_refused():
    assert isinstance(head_from_config(ValueProbe(alpha=3.0).config()), ValueProbe)
    with pytest.raises(ValueError, match=r"Unknown value head 'forest': choose one of \['ridge'\]"):
        head_from_config({}, "forest")

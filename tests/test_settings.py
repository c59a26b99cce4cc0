"""settings.py: one set of rules for the estimator's arguments and the config's fields, each error naming what the
caller wrote."""

import pytest

from poise_trl import POISEConfig
from poise_trl.config import ESTIMATOR_FIELDS
from poise_trl.estimator import POISEEstimator

from .conftest import CPU_ARGS
from .test_estimator import G


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("num_generations", 1),
        ("warmup_steps", -3),
        ("layer_folds", 1),
        ("clip", [1.0, 0.0]),
        ("buffer_size", 0),
        ("domain_buffer_sizes", {"math": 3}),
        ("layer_switch_margin", -0.1),
        ("layer_select_every", 0),
        ("alpha", 0.0),
        ("bootstrap", "mean"),
        ("scale_rewards", "group"),
        ("head", "forest"),
    ],
)
def test_the_estimator_refuses_what_the_config_refuses_in_the_same_words(argument, value):
    field = ESTIMATOR_FIELDS[argument]
    with pytest.raises(ValueError) as refused_by_estimator:
        POISEEstimator(**{"num_generations": G, argument: value})
    extra = {"probe_domain_column": "domain"} if argument == "domain_buffer_sizes" else {}
    with pytest.raises(ValueError) as refused_by_config:
        POISEConfig(output_dir="unused", per_device_train_batch_size=4, **{**CPU_ARGS, field: value, **extra})
    assert str(refused_by_config.value) == str(refused_by_estimator.value).replace(argument, field, 1)


def test_a_layer_index_past_the_hooked_layers_is_refused():
    with pytest.raises(ValueError, match=r"layer_index=2 is not a slice of the 2 hooked layers \[8, 12\]"):
        POISEEstimator(G, layers=(8, 12), layer_index=2)


def test_a_head_other_than_ridge_is_refused_for_the_per_prefix_value_saying_why():
    with pytest.raises(
        ValueError, match=r"probe_head='mlp' with probe_granularity='prefix': .* affine map"
    ) as refused:
        POISEConfig(output_dir="unused", **CPU_ARGS, probe_head="mlp", probe_granularity="prefix")
    assert "'ridge'" in str(refused.value)
    with pytest.raises(ValueError, match=r"head='logistic' with granularity='prefix'"):
        POISEEstimator(G, head="logistic", granularity="prefix")


def test_an_unknown_head_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"probe_head='forest' is not a value head: choose one of \['ensemble', "):
        POISEConfig(output_dir="unused", per_device_train_batch_size=4, **CPU_ARGS, probe_head="forest")

"""specs.py: the estimator's settings as typed specs. A spec refuses what the config refuses, in the same words with
the config's field names (one map, the fields' metadata); head settings reach the head from the config and a wrong key
fails early; a granularity asks a head what it can do, not its name; the spec round-trips through the estimator's
file, and a saved estimator refits with another spec on its own buffered rows."""

import pytest
import torch

from poise_trl import POISEConfig
from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.history import PromptHistory
from poise_trl.estimator.specs import (
    BufferSpec,
    EstimatorSpec,
    GranularitySpec,
    HeadSpec,
    HistorySpec,
    LayerSpec,
    PromptSpec,
    SettingError,
    config_field,
    estimator_spec,
    spec_name,
)
from poise_trl.heads.heads import HEADS
from poise_trl.heads.probe import ScaledHead, ValueProbe
from poise_trl.settings import Refused

from .conftest import CPU_ARGS
from .test_estimator import G, _batch, spec


def _config(**fields) -> POISEConfig:
    return POISEConfig(output_dir="unused", per_device_train_batch_size=4, **{**CPU_ARGS, **fields})


@pytest.mark.parametrize(
    ("part", "key", "value"),
    [
        (HeadSpec, "alpha", 0.0),
        (HeadSpec, "clip", (1.0, 0.0)),
        (HeadSpec, "name", "forest"),
        (HeadSpec, "kwargs", {"width": 8}),
        (BufferSpec, "warmup_steps", -3),
        (BufferSpec, "max_domains", 0),
        (LayerSpec, "folds", 1),
        (LayerSpec, "switch_margin", -0.1),
        (LayerSpec, "select_every", 0),
        (HistorySpec, "size", 0),
        (HistorySpec, "decay", 1.5),
        (GranularitySpec, "name", "token"),
        (EstimatorSpec, "bootstrap", "mean"),
        (EstimatorSpec, "scale_rewards", "group"),
        (EstimatorSpec, "partner_reward", "no"),
    ],
)
def test_a_spec_refuses_what_the_config_refuses_in_the_same_words(part, key, value):
    with pytest.raises(ValueError) as refused_by_spec:
        part(**{key: value})
    with pytest.raises(ValueError) as refused_by_config:
        _config(**{config_field(part, key): value})
    assert str(refused_by_config.value) == str(refused_by_spec.value).replace(
        spec_name(part, key), config_field(part, key)
    )


@pytest.mark.parametrize(
    ("part", "key", "value", "build"),
    [
        (HeadSpec, "alpha", 0.0, lambda value: ScaledHead(alpha=value)),
        (HeadSpec, "alpha", True, lambda value: ScaledHead(alpha=value)),
        (HeadSpec, "clip", "max", lambda value: ScaledHead(clip=value)),
        (HistorySpec, "size", 0, lambda value: PromptHistory(size=value)),
        (HistorySpec, "decay", 0.0, lambda value: PromptHistory(decay=value)),
    ],
)
def test_a_spec_refuses_its_objects_settings_by_their_own_check(part, key, value, build):
    """One check per setting, in the object that takes it (the heads' front end, the history table); the spec
    names the refused setting its way."""
    with pytest.raises(Refused) as by_object:
        build(value)
    with pytest.raises(SettingError) as by_spec:
        part(**{key: value})
    assert str(by_spec.value) == str(by_object.value).replace(key, spec_name(part, key), 1)


@pytest.mark.parametrize(
    ("buffer", "field", "value", "extra"),
    [
        (BufferSpec(size=3), "probe_buffer_size", 3, {}),
        (BufferSpec(domain_sizes={"math": 3}), "probe_domain_buffer_sizes", {"math": 3}, {"probe_domain_column": "d"}),
    ],
)
def test_buffers_hold_two_groups_of_the_estimators_g_in_the_same_words(buffer, field, value, extra):
    with pytest.raises(ValueError, match="must be an int holding at least two groups") as refused_by_estimator:
        POISEEstimator(G, EstimatorSpec(buffer=buffer))
    with pytest.raises(ValueError) as refused_by_config:
        _config(**{field: value, **extra})
    shown = "BufferSpec.size" if field == "probe_buffer_size" else "BufferSpec.domain_sizes"
    assert str(refused_by_config.value) == str(refused_by_estimator.value).replace(shown, field)
    with pytest.raises(ValueError, match=r"num_generations=1 is too small") as refused:
        POISEEstimator(1)
    with pytest.raises(ValueError) as config_refused:
        _config(num_generations=1)
    assert str(refused.value) == str(config_refused.value)


def test_a_layer_index_past_the_hooked_layers_is_refused():
    with pytest.raises(ValueError, match=r"LayerSpec.index=2 is not a slice of the 2 hooked layers \[8, 12\]"):
        LayerSpec(ids=(8, 12), index=2)


def test_an_unknown_head_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"probe_head='forest' is not a value head: choose one of \['ensemble', "):
        _config(probe_head="forest")


# ----------------------------------------------------------------------------------------------- head settings
def test_head_kwargs_reach_the_head_from_the_config_and_the_command_line():
    """The MLP's width and the ensemble's members and combiner, set on the config, are the fitted heads'."""
    x, r, groups, _ = _batch(0, width=6)
    for fields in (dict(probe_head_kwargs={"hidden": 5}), dict(probe_head_kwargs='{"hidden": 5}')):
        config = _config(probe_head="mlp", probe_features=["entropy"], probe_warmup_steps=0, **fields)
        estimator = POISEEstimator.from_config(config, num_layers=4, hidden_size=16)
        estimator.observe(features=x[:, :3], rollouts=Rollouts(r, prompt_ids=groups))
        state = estimator.probes_["default"].probe.state_dict()
        assert state["hidden_weight"].shape == (3 + 1, 5) and state["coef"].shape == (5,)
    config = _config(
        probe_head="ensemble",
        probe_head_kwargs={"children": ["ridge", "mlp"], "combine": "stack", "folds": 2},
        probe_features=["entropy"],
    )
    head = POISEEstimator.from_config(config, num_layers=4, hidden_size=16).new_probe("default").probe
    assert [child.name for child in head.children] == ["ridge", "mlp"] and (head.combine, head.folds) == ("stack", 2)


def test_a_wrong_head_setting_fails_when_the_config_is_built_naming_the_heads_own():
    own = r"its own settings are hidden, iterations, learning_rate, seed\."
    with pytest.raises(
        ValueError, match=r"probe_head_kwargs=\{'width': 8\} names \['width'\], not settings of the head 'mlp': " + own
    ):
        _config(probe_head="mlp", probe_head_kwargs={"width": 8})
    with pytest.raises(ValueError, match=r"not settings of the head 'ridge': it has no settings of its own"):
        _config(probe_head_kwargs={"hidden": 8})
    with pytest.raises(ValueError, match=r"probe_head_kwargs=\{'hidden': 0\} is refused by the head 'mlp': hidden=0"):
        _config(probe_head="mlp", probe_head_kwargs={"hidden": 0})
    with pytest.raises(ValueError, match=r"Unknown child heads \['forest'\]"):
        _config(probe_head="ensemble", probe_head_kwargs={"children": ["ridge", "forest"]})
    with pytest.raises(ValueError, match=r"probe_head_kwargs='hidden=8' must be a dict or a JSON object"):
        _config(probe_head="mlp", probe_head_kwargs="hidden=8")


# ---------------------------------------------------------------------------------------------- capabilities
class LinearHead(ValueProbe):
    """A custom head with an affine map (ridge's solve under another name)."""

    name = "linear"


def test_the_per_prefix_value_takes_any_head_with_an_affine_map_and_refuses_others_saying_why(monkeypatch):
    monkeypatch.setitem(HEADS, "linear", LinearHead)
    prefix = GranularitySpec("prefix")
    estimator = POISEEstimator(2, EstimatorSpec(head=HeadSpec("linear", alpha=1.0), granularity=prefix))
    assert type(estimator.token_baseline_.probe) is LinearHead
    with pytest.raises(ValueError, match=r"HeadSpec.name='mlp' with GranularitySpec.name='prefix': .* affine map"):
        EstimatorSpec(head=HeadSpec("mlp"), granularity=prefix)
    with pytest.raises(
        ValueError, match=r"probe_head='logistic' with probe_granularity='prefix': .* affine map"
    ) as no:
        _config(probe_head="logistic", probe_granularity="prefix")
    assert "'ridge'" in str(no.value) and "'linear'" in str(no.value)  # the heads that have it, from the table
    with pytest.raises(ValueError, match=r"GranularitySpec.name='prefix' needs one fixed layer"):
        EstimatorSpec(granularity=prefix, layers=LayerSpec(ids=(1, 2)))
    with pytest.raises(ValueError, match=r"probe_granularity='prefix' needs one fixed probe_layer"):
        _config(probe_granularity="prefix", probe_layer="auto")


# ------------------------------------------------------------------------------------------- file and refit
SPEC = EstimatorSpec(
    head=HeadSpec("mlp", alpha=2.0, pca_dims=3, clip=(0.0, 1.0), kwargs={"hidden": 4, "iterations": 20}),
    history=HistorySpec(size=16, decay=0.9),
    layers=LayerSpec(ids=(3, 5), index=1, select_every=2, folds=2),
    buffer=BufferSpec(size=64, domain_sizes={"math": 32}, max_domains=3, warmup_steps=1),
    bootstrap="rloo",
    scale_rewards="batch",
    prompt=PromptSpec((0, 2), pca_dims=1),
)


def test_a_spec_round_trips_through_the_file(tmp_path):
    estimator = POISEEstimator(G, SPEC, feature_config={"probe_layer": "auto"})
    x, r, _, _ = _batch(0)
    ids = torch.arange(x.size(0)) // G
    features = torch.stack([x, -x], 1)
    estimator.observe(estimator.advantages(features, Rollouts(r, prompt_ids=ids)))
    estimator.save(tmp_path / "e.safetensors")
    loaded = POISEEstimator.from_file(tmp_path / "e.safetensors")
    assert loaded.spec == SPEC and loaded.feature_config == {"probe_layer": "auto"} and loaded.steps_ == 1
    assert EstimatorSpec.from_dict(SPEC.to_dict()) == SPEC
    record = Rollouts(r, prompt_ids=ids)
    assert torch.equal(loaded.predict(features, record), estimator.predict(features, record))


def test_a_file_without_a_spec_is_refused_by_from_file():
    from .test_estimator import LEGACY

    with pytest.raises(ValueError, match="written before estimator files held their spec"):
        POISEEstimator.from_file(LEGACY / "probe.safetensors")


def test_refit_with_another_spec_learns_what_an_estimator_of_that_spec_learned_from_the_same_rows():
    """An estimator with history and ridge, refit with the MLP and no history, predicts bit for bit as the MLP
    estimator without history that observed the same batches (its buffer holds the same rows, less the history)."""
    with_history = spec(history=HistorySpec(), prompt=PromptSpec((0, 3)))
    other = spec(head={"name": "mlp", "kwargs": {"hidden": 4, "iterations": 30}}, prompt=PromptSpec((0, 3)))
    saved, direct = POISEEstimator(G, with_history), POISEEstimator(G, other)
    for step in range(3):
        x, r, _, _ = _batch(step)
        ids = torch.arange(x.size(0)) // G + 10 * (step % 2)
        saved.observe(saved.advantages(x, Rollouts(r, prompt_ids=ids)))
        direct.observe(features=x, rollouts=Rollouts(r, prompt_ids=ids))
    refit = saved.refit(other)
    assert refit.spec == other and refit.steps_ == direct.steps_ == 3 and refit.prompt_history_ is None
    ours, theirs = refit.probes_["default"], direct.probes_["default"]
    assert torch.equal(ours.buffer.features, theirs.buffer.features) and ours.trusted
    x, r, _, _ = _batch(9)
    assert torch.equal(refit.predict(x, Rollouts(r)), direct.predict(x, Rollouts(r)))
    assert torch.equal(refit.prompt_values(x[:, :3]), direct.prompt_values(x[:, :3]))
    record = Rollouts(r, prompt_ids=ids)
    assert torch.equal(saved.refit(with_history).predict(x, record), saved.predict(x, record))
    with pytest.raises(ValueError, match="do not hold the columns"):
        direct.refit(with_history)


def test_the_specs_defaults_are_the_configs():
    """`POISEEstimator(num_generations=2)` (a loop outside TRL) runs what a default `POISEConfig` runs, the settings
    the model decides aside: every field the config sets without the model has the same default in both."""
    from dataclasses import fields

    built = estimator_spec(_config(probe_history=True), num_layers=4, hidden_size=16)
    default = EstimatorSpec(history=HistorySpec())
    compared = 0
    for path in ("", "head", "history", "layers", "buffer", "granularity"):
        ours, theirs = (getattr(spec, path) if path else spec for spec in (default, built))
        for f in fields(ours):
            if f.metadata.get("config") and not f.metadata["derived"]:
                assert getattr(ours, f.name) == getattr(theirs, f.name), (path, f.name)
                compared += 1
    assert compared == 22

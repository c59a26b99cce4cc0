"""POISEConfig defaults, presets and early, actionable errors."""

import re

import pytest

from poise_trl import POISEConfig
from poise_trl.estimator.baselines import BOOTSTRAPS

from .conftest import CPU_ARGS

BOOTSTRAP_NAMES = re.escape(str(list(BOOTSTRAPS)))


def _config(**kwargs) -> POISEConfig:
    return POISEConfig(output_dir="unused", per_device_train_batch_size=4, **{**CPU_ARGS, **kwargs})


def test_paper_defaults():
    c = _config()
    assert (c.num_generations, c.epsilon, c.epsilon_high, c.beta, c.loss_type) == (2, 0.2, 0.28, 0.0, "dapo")
    assert c.scale_rewards == "none" and c.probe_pool_tokens == 10 and c.probe_layer is None
    assert c.probe_features == ["prompt", "reasoning", "entropy"] and c.reasoning_end_marker == "</think>"
    assert c.probe_scalars == [f"{span}_mean_token_entropy" for span in ("output", "reasoning", "answer")]
    assert (c.probe_alpha, c.probe_pca_dims, c.probe_buffer_size, c.probe_warmup_steps) == (100.0, [32, 64], 4096, 16)


def test_paper_preset_and_explicit_overrides():
    assert (_config(probe_preset="paper").probe_alpha, _config(probe_preset="paper").probe_pca_dims) == (0.01, [0, 0])
    c = _config(probe_preset="paper", probe_alpha=3.0, probe_pca_dims=[8, 0])
    assert (c.probe_alpha, c.probe_pca_dims) == (3.0, [8, 0])
    # Only a preset's dims are capped at a small model's block width; explicit dims are checked as given.
    assert _config().pca_dims_from_preset and not c.pca_dims_from_preset
    assert _config(probe_features=["entropy", "prompt"]).probe_features == ["prompt", "entropy"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_generations=1), "at least 2 rollouts"),
        (dict(num_generations=3), "divisible by num_generations"),
        (dict(scale_rewards="group"), "not supported by POISE"),
        (dict(probe_pool_tokens=0), "positive number"),
        (dict(probe_capture="loss"), r"probe_capture='loss': choose 'auto' .* or 'pass'"),
        (dict(probe_features=["prompt", "logits"]), "unknown: \\['logits'\\]"),
        (dict(probe_features=[]), "non-empty subset"),
        (dict(probe_scalars=["output_mean_token_entropy", "output_lenght"]), "did you mean 'output_length'"),
        (dict(probe_scalars=[]), "non-empty list of rollout scalars without repeats"),
        (dict(probe_scalars=["output_length", "output_length"]), "non-empty list of rollout scalars without repeats"),
        (dict(probe_features=["prompt"], probe_scalars=["output_length"]), "read through the 'entropy' block"),
        (dict(probe_features=["entropy", "length"], probe_scalars=["output_length"]), "the same column twice"),
        (dict(probe_preset="fast"), "choose one of"),
        (dict(probe_alpha=-1.0), "must be > 0"),
        (dict(probe_pca_dims=[32]), "two non-negative ints"),
        (dict(probe_clip_range=[1.0, 0.0]), "low < high"),
        (dict(probe_buffer_size=3), "at least two groups"),
        (dict(probe_warmup_steps=-1), ">= 0"),
        (dict(reasoning_end_marker=""), "use None"),
        (dict(multi_objective_aggregation="normalize_then_sum"), "sum_then_normalize"),
        (dict(prompt_selection="value", prompt_selection_oversample=float("inf")), "finite number"),
        (dict(prompt_selection_oversample=float("inf")), "finite number"),  # refused even before it is used
        (dict(prompt_selection="value", prompt_selection_oversample=1.0), "finite number > 1"),
        (dict(prompt_selection="importance", prompt_selection_floor=0.0), r"must be in \(0, 1\]"),
        (dict(prompt_selection_floor=1.5), r"must be in \(0, 1\]"),  # refused even before it is used
        (dict(prompt_selection_floor=float("nan")), r"must be in \(0, 1\]"),
        (dict(prompt_selection="importants"), "did you mean 'importance'"),
        (dict(probe_partner_reward="no"), "give True .* or False"),
        (dict(probe_partner_reward=1), "give True .* or False"),
        (dict(probe_history="yes"), r"probe_history='yes' must be True"),
        (dict(probe_history=True, probe_history_size=0), r"probe_history_size=0 must be an int >= 1"),
        (dict(probe_history_decay=1.5), r"probe_history_decay=1.5 must be in \(0, 1\]"),  # even before it is used
        (
            dict(probe_history=True, probe_granularity="prefix"),
            "probe_history=True with probe_granularity='prefix': the per-prefix value is applied inside the forward",
        ),
        (dict(probe_head="mlp", probe_head_kwargs={"width": 8}), r"names \['width'\], not settings of the head 'mlp'"),
        (dict(probe_head_kwargs="[1]"), r"probe_head_kwargs='\[1\]' must be a dict or a JSON object"),
        (dict(probe_bootstrap="mean"), f"probe_bootstrap='mean' is not a bootstrap: choose one of {BOOTSTRAP_NAMES}"),
    ],
)
def test_bad_values_raise_with_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(**kwargs)


def test_head_kwargs_parse_from_json_as_trls_dict_fields_do():
    c = _config(probe_head="ensemble", probe_head_kwargs='{"children": ["ridge", "mlp"], "combine": "stack"}')
    assert c.probe_head_kwargs == {"children": ["ridge", "mlp"], "combine": "stack"}
    assert _config().probe_head_kwargs is None


def test_the_help_texts_hold_no_measured_figure():
    """What a setting measured lives on the docs' pages, which the help links (and which are rewritten when rerun)."""
    import dataclasses
    import re

    for field in dataclasses.fields(POISEConfig):
        text = field.metadata.get("help", "")
        assert not re.search(
            r"\d+(\.\d+)?x (GRPO|fewer|faster)|\bW\b|cut the probe's error|measured with the", text
        ), field.name


def test_every_preset_setting_is_a_field_left_to_the_preset_or_defaulting_to_its_value():
    """A field a preset sets defaults to None (the preset's), or to the value every preset gives it: a default
    that differed from a preset's value would read as a change the user never made."""
    import dataclasses

    from poise_trl.choices import PROBE_PRESETS

    fields = {f.name: f for f in dataclasses.fields(POISEConfig)}
    for name, preset in PROBE_PRESETS.items():
        assert preset.summary.strip() and set(preset.required) <= set(preset.settings)
        for key, value in {**preset.settings, **preset.domain_settings}.items():
            default = fields[key].default_factory() if callable(fields[key].default_factory) else fields[key].default
            assert default is None or default == value, (name, key, default, value)
        assert not _config(probe_preset=name).preset_changes()
        assert not _config(probe_preset=name, probe_domain_column="source").preset_changes()
        assert repr(name) in fields["probe_preset"].metadata["help"]


def test_the_release_preset_is_the_default_and_keeps_its_settings():
    c = _config()
    assert c.probe_preset == "release"
    assert (c.probe_head, c.probe_partner_reward, c.probe_bootstrap, c.probe_clip_range) == (
        "ridge",
        True,
        "shrunk",
        None,
    )
    assert (c.probe_schedule, c.probe_buffer_whole_groups, c.probe_domain_routing) == ("domain", False, "identity")
    assert (c.probe_same_domain_groups, c.probe_reward_range, c.probe_domain_buffer_sizes) == (False, None, None)


def test_the_reference_and_paper_presets_set_every_setting_of_theirs():
    from poise_trl.features.columns import DEFAULT_SCALARS, REFERENCE_SCALARS

    ref = _config(probe_preset="reference")
    assert (ref.probe_head, ref.probe_alpha, ref.probe_pca_dims, ref.probe_clip_range) == (
        "pca_ridge",
        100,
        [32, 64],
        [0, 1],
    )
    assert ref.probe_scalars == list(REFERENCE_SCALARS) and ref.probe_head_kwargs is None  # pca_ridge's seed: 42
    assert (ref.probe_partner_reward, ref.probe_bootstrap, ref.probe_history, ref.scale_rewards) == (
        False,
        "rloo",
        False,
        "none",
    )
    assert (ref.probe_schedule, ref.probe_warmup_steps, ref.probe_domain_warmup_steps) == ("global", 16, 8)
    assert (ref.probe_buffer_whole_groups, ref.probe_same_domain_groups, ref.probe_reward_range) == (
        True,
        True,
        [0, 1],
    )
    assert (ref.probe_pool_tokens, ref.reasoning_end_marker, ref.num_generations) == (10, "</think>", 2)
    assert ref.probe_domain_routing == "reference" and ref.probe_domain_buffer_sizes is None  # one 4096-row buffer
    sizes = _config(probe_preset="reference", probe_domain_column="source").probe_domain_buffer_sizes
    assert sizes == {"math": 4096, "code": 3072, "other": 3072}
    paper = _config(probe_preset="paper")
    assert (paper.probe_head, paper.probe_alpha, paper.probe_pca_dims, paper.probe_clip_range) == (
        "ridge",
        0.01,
        [0, 0],
        None,
    )
    assert (paper.probe_partner_reward, paper.probe_bootstrap, paper.probe_scalars) == (
        False,
        "rloo",
        list(DEFAULT_SCALARS),
    )
    assert (paper.num_generations, paper.scale_rewards, paper.probe_history, paper.prompt_selection) == (
        2,
        "none",
        False,
        None,
    )


def test_an_explicit_value_a_preset_needs_is_refused_and_one_it_defaults_is_taken_and_recorded():
    with pytest.raises(
        ValueError, match=r"num_generations=4 with probe_preset='reference', which needs num_generations=2: the"
    ):
        _config(probe_preset="reference", num_generations=4)
    c = _config(
        probe_preset="reference", probe_alpha=10.0, probe_buffer_whole_groups=False, probe_same_domain_groups=False
    )
    assert c.preset_changes() == {
        "probe_alpha": (100.0, 10.0),
        "probe_buffer_whole_groups": (True, False),
        "probe_same_domain_groups": (True, False),
    }
    paper = _config(probe_preset="paper", num_generations=4, probe_partner_reward=True)  # the paper's G is a default
    assert paper.preset_changes() == {"num_generations": (2, 4), "probe_partner_reward": (False, True)}
    # a preset's scalars need the 'entropy' block only when written explicitly
    assert _config(probe_preset="reference", probe_features=["prompt"]).probe_features == ["prompt"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(probe_schedule="weekly"),
            r"probe_schedule='weekly' is not a schedule: choose one of \['domain', 'global'\]",
        ),
        (dict(probe_schedule="global", probe_warmup_steps=0), "probe_warmup_steps=0 must be >= 1 with the schedule"),
        (dict(probe_domain_warmup_steps=-1), "probe_domain_warmup_steps=-1 must be >= 0"),
        (dict(probe_domain_routing="source"), "probe_domain_routing='source' is not a domain routing"),
        (dict(probe_buffer_whole_groups=True), "probe_buffer_whole_groups=True with probe_same_domain_groups=False"),
        (dict(probe_same_domain_groups="yes"), "probe_same_domain_groups='yes' must be True or False"),
        (dict(probe_reward_range=[1.0, 0.0]), r"probe_reward_range=\(1.0, 0.0\) is not a range"),
    ],
)
def test_bad_schedule_and_domain_settings_raise_with_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(**kwargs)

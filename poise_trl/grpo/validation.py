"""`POISEConfig`'s checks when it is built, and the datasets' when `POISETrainer` is: each bad value gets one clear
error, early, naming the field (or the columns) and what to change. The values the config fills in (a preset's,
presets.py; a parsed layer, the feature blocks in order) are set here too. The estimator's settings are checked by
building its spec without the model (specs.py: the registries of heads, granularities, bootstraps, reward scalings,
schedules and domain routings, and each one's capabilities), the prompt sampler's by its rule (sampling.py)."""

import inspect
import math
from collections.abc import Callable
from difflib import get_close_matches
from typing import Any

from ..estimator.domains import ROUTINGS
from ..estimator.granularity import GRANULARITIES
from ..estimator.specs import estimator_spec
from ..features.columns import DEFAULT_SCALARS, SCALARS
from ..features.features import FEATURE_BLOCKS
from ..presets import fill_preset
from ..sampling import RULES, rule_from_config
from ..settings import check_floor
from .step import CAPTURES


def validate(config: Any) -> None:
    """Check and complete a `POISEConfig` once TRL's own `__post_init__` ran: first the fields its preset fills."""
    if config.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            f"multi_objective_aggregation={config.multi_objective_aggregation!r} is not supported by POISE: it "
            "normalises each reward within its group, own reward included, so a rollout's reward would depend on "
            "its partners. POISE needs the raw weighted reward sum: set "
            "multi_objective_aggregation='sum_then_normalize'."
        )
    if config.probe_capture not in CAPTURES:
        raise ValueError(
            f"probe_capture={config.probe_capture!r}: choose 'auto' (no forward pass added) or 'pass' (a no-grad "
            "pass of POISE's own where TRL runs none)."
        )
    if config.probe_pool_tokens <= 0:
        raise ValueError(f"probe_pool_tokens={config.probe_pool_tokens} must be a positive number of tokens.")
    if config.reasoning_end_marker == "":
        raise ValueError("reasoning_end_marker='' matches nothing; use None to declare that there is no marker.")
    unknown = sorted(set(config.probe_features) - set(FEATURE_BLOCKS))
    if unknown or not config.probe_features or len(set(config.probe_features)) != len(config.probe_features):
        raise ValueError(
            f"probe_features={config.probe_features}: give a non-empty subset of {list(FEATURE_BLOCKS)} without "
            f"repeats (unknown: {unknown})."
        )
    config.probe_features = [b for b in FEATURE_BLOCKS if b in config.probe_features]
    explicit_scalars = config.probe_scalars is not None
    # A preset's PCA dims are capped at the block width of a small model; explicit dims are taken as given.
    config.pca_dims_from_preset = config.probe_pca_dims is None
    fill_preset(config)
    _check_scalars(config, explicit_scalars)
    _check_pca_dims(config)
    _parse_layer(config)
    _check_domains(config)
    if not isinstance(config.probe_history, bool):  # a string such as "no" would count as True
        raise ValueError(
            f"probe_history={config.probe_history!r} must be True (append each prompt's history to the probe's "
            "input) or False."
        )
    _check_prompt_selection(config)
    estimator_spec(config)  # the estimator's settings, without the model's: errors name the config's fields
    granularity = GRANULARITIES[config.probe_granularity]
    if config.probe_layer == "auto" and granularity.one_layer:
        raise ValueError(
            f"probe_granularity={config.probe_granularity!r} needs one fixed probe_layer (its buffer holds one "
            "layer's states): set probe_layer to an index or None, or probe_granularity='sequence'."
        )


def _check_scalars(config: Any, explicit: bool) -> None:
    """probe_scalars: known names, no repeats, read through the 'entropy' block where `explicit` (not the preset's),
    no column twice."""
    scalars = config.probe_scalars
    if isinstance(scalars, str) or not scalars or len(set(scalars)) != len(scalars):
        raise ValueError(
            f"probe_scalars={scalars!r}: give a non-empty list of rollout scalars without repeats, e.g. "
            f"{list(DEFAULT_SCALARS)} (the paper's)."
        )
    unknown = [name for name in scalars if name not in SCALARS]
    if unknown:
        close = {name: get_close_matches(str(name), SCALARS, n=1) for name in unknown}
        hints = "".join(f" ({name!r}: did you mean {match[0]!r}?)" for name, match in close.items() if match)
        raise ValueError(f"probe_scalars names {unknown}, not rollout scalars{hints}: choose from {list(SCALARS)}.")
    config.probe_scalars = list(scalars)
    if explicit and "entropy" not in config.probe_features and tuple(scalars) != DEFAULT_SCALARS:
        raise ValueError(
            f"probe_scalars={config.probe_scalars} is read through the 'entropy' block of probe_features, which "
            f"{config.probe_features} leaves out: add 'entropy' to probe_features, or leave probe_scalars at None "
            "(the preset's)."
        )
    if "length" in config.probe_features and "output_length" in scalars:
        raise ValueError(
            "probe_features holds 'length' and probe_scalars 'output_length': the same column twice. Drop one."
        )


def _check_pca_dims(config: Any) -> None:
    """probe_alpha as a float, probe_pca_dims as two ints >= 0."""
    config.probe_alpha = float(config.probe_alpha)
    config.probe_pca_dims = list(config.probe_pca_dims)
    if len(config.probe_pca_dims) != 2 or any(int(k) < 0 for k in config.probe_pca_dims):
        raise ValueError(
            f"probe_pca_dims={config.probe_pca_dims}: give two non-negative ints, [prompt dims, reasoning dims]; "
            "0 disables PCA on a block."
        )
    config.probe_pca_dims = [int(k) for k in config.probe_pca_dims]


def _parse_layer(config: Any) -> None:
    """probe_layer as an int, "auto" or None (the command line gives a string); its candidates with "auto"."""
    layer = config.probe_layer
    if isinstance(layer, str):
        text = layer.strip().lower()
        try:
            layer = "auto" if text == "auto" else None if text in ("none", "null") else int(text)
        except ValueError:
            raise ValueError(
                f"probe_layer={config.probe_layer!r}: give a layer index (e.g. 19 or -1), 'auto', or None."
            ) from None
    if isinstance(layer, bool) or not (layer is None or layer == "auto" or isinstance(layer, int)):
        raise ValueError(f"probe_layer={config.probe_layer!r}: give a layer index (e.g. 19 or -1), 'auto', or None.")
    config.probe_layer = layer
    candidates = config.probe_layer_candidates
    if candidates is not None:
        if layer != "auto":
            raise ValueError(
                f"probe_layer_candidates={candidates} is only used with probe_layer='auto' (got "
                f"probe_layer={layer!r})."
            )
        if not candidates or any(isinstance(c, bool) for c in candidates):
            raise ValueError(f"probe_layer_candidates={candidates}: give a non-empty list of ints.")
        config.probe_layer_candidates = [int(c) for c in candidates]


def _check_domains(config: Any) -> None:
    if config.probe_domain_column == "":
        raise ValueError("probe_domain_column='' names no column; use None for a single probe.")
    sizes = config.probe_domain_buffer_sizes
    if sizes is None:
        return
    if config.probe_domain_column is None:
        raise ValueError("probe_domain_buffer_sizes needs probe_domain_column: name the column holding the domain.")
    if not isinstance(sizes, dict):
        raise ValueError(
            f"probe_domain_buffer_sizes={sizes!r}: give a dict or a JSON object, e.g. '{{\"math\": 4096}}'."
        )
    config.probe_domain_buffer_sizes = {str(name): size for name, size in sizes.items()}  # sizes: the spec's


def _check_prompt_selection(config: Any) -> None:
    oversample = config.prompt_selection_oversample
    if not (isinstance(oversample, int | float) and 1 < oversample < math.inf):
        raise ValueError(
            f"prompt_selection_oversample={oversample!r} must be a finite number > 1: it is the number of "
            "candidate prompts drawn per kept prompt (2.0 draws twice as many as are kept)."
        )
    check_floor(config.prompt_selection_floor)  # refused even before it is used
    rule = config.prompt_selection
    if rule is None:
        return
    if rule not in RULES:
        close = get_close_matches(str(rule), RULES, n=1)
        rules = " or ".join(map(repr, RULES)) + (f" (did you mean {close[0]!r}?)" if close else "")
        raise ValueError(f"prompt_selection={rule!r}: choose None (paper) or {rules}.")
    rule_from_config(config).check_objective(config)
    if "prompt" not in config.probe_features:
        raise ValueError(
            f"prompt_selection={rule!r} predicts from the prompt hidden states: add 'prompt' to probe_features (got "
            f"{config.probe_features})."
        )
    rows = config.per_device_train_batch_size * config.steps_per_generation
    if rows % config.num_generations:
        raise ValueError(
            f"prompt_selection={rule!r} keeps whole prompts on each process, so per_device_train_batch_size x "
            f"steps_per_generation ({rows}) must be a multiple of num_generations ({config.num_generations})."
        )


# What TRL passes every reward function that is not a model besides the batch's columns, and the columns it does not
# pass on (TRL contract 'dataset_columns').
REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
UNPASSED_COLUMNS = ("prompt", "completion", "completion_ids")


def check_dataset_size(dataset: Any, needed: int, config: Any) -> None:
    """A map-style training set (`dataset`) smaller than one generation batch (`needed` distinct prompts: the batch
    size of TRL's sampler) makes the sampler yield no batch at all, so `train()` would run 0 steps and save an
    untrained model without a word; a domain column with more domains (after `probe_domain_routing`) than
    `probe_max_domains` would fail mid-run, when the first domain too many arrives, and so would, with
    `probe_schedule="global"` and `probe_domain_buffer_sizes`, a domain it does not list (when it arrives) or one it
    lists and the data lacks (when the bootstrap ends)."""
    if len(dataset) < needed:
        raise ValueError(
            f"The training set is too small: it has {len(dataset)} prompts, but one generation batch needs "
            f"{needed} distinct prompts (generation_batch_size {config.generation_batch_size} / num_generations "
            f"{config.num_generations}"
            + (", times prompt_selection_oversample" if config.prompt_selection else "")
            + "), so training would run 0 steps. Lower per_device_train_batch_size, steps_per_generation or "
            "gradient_accumulation_steps, raise num_generations, or add data."
        )
    column = config.probe_domain_column
    if column is not None and column in getattr(dataset, "column_names", []):
        route = ROUTINGS[config.probe_domain_routing]
        values = {route(str(value)) for value in dataset[column]}
        routed = (
            ""
            if config.probe_domain_routing == "identity"
            else f" (probe_domain_routing={config.probe_domain_routing!r})"
        )
        if len(values) > config.probe_max_domains:
            raise ValueError(
                f"probe_domain_column={column!r} has {len(values)} distinct values{routed}, more than "
                f"probe_max_domains={config.probe_max_domains}: each domain keeps its own probe and buffer on the "
                "accelerator. Map the column to fewer values, or raise probe_max_domains if the memory allows."
            )
        listed = set(config.probe_domain_buffer_sizes or {})
        if config.probe_schedule == "global" and listed and values != listed:
            raise ValueError(
                f"probe_domain_column={column!r} holds the domains {sorted(values)}{routed}, but with "
                f"probe_schedule='global' probe_domain_buffer_sizes lists every domain of the run, each fitted at "
                f"the end of the bootstrap: it lists {sorted(listed)}"
                + (f"; the data lacks {sorted(listed - values)}" if listed - values else "")
                + (f"; it does not list {sorted(values - listed)}" if values - listed else "")
                + ". List exactly the data's domains (with their buffer sizes)."
            )


def check_columns(
    datasets: dict[str, Any],
    reward_funcs: dict[str, Callable],
    *,
    prompt_required: bool,
    domain_column: str | None,
    keywords: tuple[str, ...] = REWARD_KEYWORDS,
) -> None:
    """Refuse, before the first step, a dataset that TRL or POISE would fail on there: one without the 'prompt'
    column TRL reads from every row (`prompt_required`: unless an environment gives the prompt), without a column a
    reward function's signature requires (TRL passes each function `keywords` and the batch's other columns, which
    come from the dataset's), or without `probe_domain_column`. `datasets` maps a name for the error ("train_dataset",
    ...) to a dataset; one whose columns are not known (a stream without features) is not checked."""
    for name, dataset in datasets.items():
        columns = getattr(dataset, "column_names", None)
        if columns is None:
            continue
        has = f"{name} has the columns {sorted(columns)}"
        if prompt_required and "prompt" not in columns:
            raise ValueError(
                f"{has} and no 'prompt' column, which GRPOTrainer reads from every row: rename the column that holds "
                "the prompts to 'prompt' (`dataset.rename_column(...)`)."
            )
        if domain_column is not None and domain_column not in columns:
            raise ValueError(
                f"probe_domain_column={domain_column!r}, but {has}. Add the column, or set probe_domain_column=None."
            )
        passed = {*keywords, *(column for column in columns if column not in UNPASSED_COLUMNS)}
        for function, reward in reward_funcs.items():
            missing = [parameter for parameter in _required_parameters(reward) if parameter not in passed]
            if missing:
                raise ValueError(
                    f"The reward function {function!r} requires {missing}, which TRL would not pass it: it passes "
                    f"{list(keywords)} and every column of the batch but {list(UNPASSED_COLUMNS)}, and {has}. Add "
                    "the column to the dataset, or give the parameter a default."
                )


def _required_parameters(function: Callable) -> list[str]:
    """The parameters of `function` without a default (not *args or **kwargs); none where it has no signature."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind not in variadic]

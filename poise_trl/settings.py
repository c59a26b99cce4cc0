"""The rules every POISE estimator's settings obey, in one place: `POISEEstimator` checks its arguments with them and
`POISEConfig` its fields, so each bad value gets one clear error early, named as the caller wrote it."""

from typing import Any

# Every weight is at most 1 / floor = 2. `bench gradient` on SmolLM2's two start pools at this floor (the committed
# benchmarks/real-lm/gradient/start*/results.md): the probe sampler took POISE (default) from 0.97x and 0.82x of
# GRPO G=8's completions (floor 1: no sampler) to 0.78x and 0.66x. On the toy every floor from 0.05 to 1 gives
# 0.57x-0.59x (benchmarks/gradient-toy-floors/). Other floors on SmolLM2 were not kept: no optimum is claimed.
DEFAULT_FLOOR = 0.5  # prompt_selection_floor (sampling.py); here, light to import for the CLIs


def check_floor(floor: float) -> None:
    """The importance sampler's floor rule, shared by the config and `bench gradient`."""
    if not (isinstance(floor, int | float) and 0 < floor <= 1):
        raise ValueError(
            f"prompt_selection_floor={floor!r} must be in (0, 1]: the share of uniform probability every candidate "
            "keeps, so that each has a positive probability and a weight of at most 1 / floor (1: uniform)."
        )


def check_settings(settings: dict[str, Any], names: dict[str, str] | None = None) -> None:
    """The rules every POISE estimator obeys, in one place: `POISEEstimator` checks its arguments with them and
    `POISEConfig` its fields (`names` maps an argument to the field that sets it, so each error names what the
    caller wrote). Only the keys present are checked."""

    name = (names or {}).get

    def bad(key: str, rule: str) -> ValueError:
        return ValueError(f"{name(key, key)}={settings[key]!r} {rule}")

    g = settings.get("num_generations", 2)
    if "num_generations" in settings and (isinstance(g, bool) or not isinstance(g, int) or g < 2):
        raise bad(
            "num_generations",
            "is too small: POISE's cross-rollout baseline needs at least 2 rollouts per prompt. Set "
            "num_generations=2 (the paper's value) or more.",
        )
    if "scale_rewards" in settings and settings["scale_rewards"] not in ("none", "batch"):
        raise bad(
            "scale_rewards",
            "is not supported by POISE: a per-group std includes the rollout's own reward and biases the gradient. "
            "Use 'none' (paper) or 'batch'.",
        )
    if "bootstrap" in settings and settings["bootstrap"] not in ("rloo", "shrunk"):
        raise bad("bootstrap", "is not a bootstrap: choose 'rloo' (paper) or 'shrunk'.")
    if "alpha" in settings and not settings["alpha"] > 0:
        raise bad("alpha", "must be > 0 (ridge needs a positive penalty).")
    clip = settings.get("clip")
    if clip is not None and (len(clip) != 2 or not clip[0] < clip[1]):
        raise bad("clip", "is not a range: give [low, high] with low < high, or None.")
    sizes = [(name("buffer_size", "buffer_size"), settings.get("buffer_size", 2 * g))]
    domain_sizes = settings.get("domain_buffer_sizes") or {}
    sizes += [(f"{name('domain_buffer_sizes', 'domain_buffer_sizes')}[{d!r}]", n) for d, n in domain_sizes.items()]
    for shown, size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 2 * g:
            raise ValueError(f"{shown}={size!r} must be an int holding at least two groups ({2 * g} examples).")
    if settings.get("max_domains", 1) < 1:
        raise bad("max_domains", "must be >= 1.")
    if settings.get("warmup_steps", 0) < 0:
        raise bad("warmup_steps", "must be >= 0.")
    if settings.get("layer_select_every") is not None and settings["layer_select_every"] < 1:
        raise bad("layer_select_every", "must be >= 1 (steps between layer choices).")
    if not 0 <= settings.get("layer_switch_margin", 0) < 1:
        raise bad("layer_switch_margin", "must be in [0, 1) (a relative improvement).")
    if settings.get("layer_folds", 2) < 2:
        raise bad("layer_folds", "must be >= 2 (prompt-grouped K-fold needs two folds).")
    layers = settings.get("layers", [0])
    if not layers or not 0 <= settings.get("layer_index", 0) < len(layers):
        raise bad("layer_index", f"is not a slice of the {len(layers)} hooked layers {list(layers)}.")
    if "head" in settings:
        from .heads import HEADS  # torch: imported only where a head is checked, so the CLIs stay light

        if settings["head"] not in HEADS:
            raise bad("head", f"is not a value head: choose one of {sorted(HEADS)}.")
        if settings.get("granularity") == "prefix" and settings["head"] != "ridge":
            raise ValueError(
                f"{name('head', 'head')}={settings['head']!r} with {name('granularity', 'granularity')}='prefix': "
                "the per-prefix value is applied inside the forward hook as one affine map of the hidden states "
                "(ValueProbe.affine), which only the linear 'ridge' head has. Use the head 'ridge' for the per-prefix "
                "value, or the granularity 'sequence' for another head."
            )
    if "granularity" in settings and settings["granularity"] not in ("sequence", "prefix"):
        raise bad("granularity", "is not a baseline granularity: choose 'sequence' (paper) or 'prefix' (per token).")
    if settings.get("granularity") == "prefix" and len(layers) > 1:
        raise bad("granularity", f"needs one fixed layer, got the candidates {list(layers)}: fix the probe layer.")
    pca = settings.get("prefix_pca_dims", (0, 0))
    if len(pca) != 2 or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in pca):
        raise bad("prefix_pca_dims", "must be two ints >= 0, [prompt k, prefix k] (0: no PCA on that block).")
    if settings.get("prompt_pca_dims", 0) < 0:
        raise bad("prompt_pca_dims", "must be >= 0 (0: no PCA).")
    if not isinstance(settings.get("history", False), bool):  # a string such as "no" would count as True
        raise bad("history", "must be True (append each prompt's history to the probe's input) or False.")
    size = settings.get("history_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise bad("history_size", "must be an int >= 1: the prompts the history table remembers.")
    decay = settings.get("history_decay", 1.0)
    if isinstance(decay, bool) or not (isinstance(decay, int | float) and 0 < decay <= 1):
        raise bad("history_decay", "must be in (0, 1]: the weight of a reward one step older in the mean (1: plain).")
    if settings.get("history") and settings.get("granularity") == "prefix":
        raise ValueError(
            f"{name('history', 'history')}=True with {name('granularity', 'granularity')}='prefix': the per-prefix "
            "value is applied inside the forward hook as one affine map of the hidden states (prefix.py), which has "
            "no input for a prompt's history. Use the granularity 'sequence' with the history, or leave it off."
        )

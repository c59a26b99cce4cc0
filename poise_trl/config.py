"""`POISEConfig`: `GRPOConfig` plus the probe's fields, with the paper's defaults."""

import logging
import math
from dataclasses import MISSING, dataclass, field, fields
from difflib import get_close_matches
from functools import partial
from typing import Any

from trl import GRPOConfig

from .features import (
    FEATURE_BLOCKS,
    HIDDEN_BLOCKS,
    block_slices,
    layer_candidates,
    pca_blocks,
    resolve_layer_index,
)
from .sampling import RULES as SAMPLING_RULES
from .settings import DEFAULT_FLOOR, check_floor, check_settings

logger = logging.getLogger(__name__)

# TRL `loss_type` -> how the importance sampler's weighted step keeps the uniform objective under it. Every loss is
# positively homogeneous in the advantages, so a row's weight may multiply them; what differs is the normaliser.
# "constant": the loss divides by something the draw does not change (grpo/sapo: each sequence over its own tokens,
# then the mean over the micro-batch's rows; dr_grpo: rows x max_completion_length; luspo: the mean over rows), so the
# weighted step's expectation is the uniform one, exactly. "weighted token count": the loss divides by
# `num_items_in_batch`, the generation batch's token count, which the trainer replaces by the importance-weighted count
# (each row's tokens times its weight, the weights rescaled to sum to the rows; unchanged under uniform draws), so
# numerator and denominator both estimate the uniform batch's; the ratio's finite-batch difference from the uniform
# step is measured by exact enumeration in docs/prompt-selection.md. A loss missing here (TRL's "bnpo": the
# micro-batch's own token count, computed inside TRL's loss) is refused.
IMPORTANCE_LOSS_TYPES = {
    "grpo": "constant",
    "dr_grpo": "constant",
    "sapo": "constant",
    "luspo": "constant",
    "dapo": "weighted token count",
    "cispo": "weighted token count",
    "vespo": "weighted token count",
}

# `POISEEstimator` argument -> the POISEConfig field that sets it: both are checked by `check_settings`.
ESTIMATOR_FIELDS = {
    "num_generations": "num_generations",
    "scale_rewards": "scale_rewards",
    "bootstrap": "probe_bootstrap",
    "alpha": "probe_alpha",
    "clip": "probe_clip_range",
    "head": "probe_head",
    "buffer_size": "probe_buffer_size",
    "domain_buffer_sizes": "probe_domain_buffer_sizes",
    "max_domains": "probe_max_domains",
    "warmup_steps": "probe_warmup_steps",
    "layer_select_every": "probe_layer_select_every",
    "layer_switch_margin": "probe_layer_switch_margin",
    "layer_folds": "probe_layer_folds",
    "granularity": "probe_granularity",
    "history": "probe_history",
    "history_size": "probe_history_size",
    "history_decay": "probe_history_decay",
}

PROBE_PRESETS: dict[str, tuple[float, list[int]]] = {
    "release": (100.0, [32, 64]),  # holi-lab/POISE release, Qwen3-4B
    "paper": (0.01, [0, 0]),  # paper §3 / Table 4
}
"""`probe_preset` -> (ridge alpha, [prompt PCA dims, reasoning PCA dims]); 0 dims means no PCA on that block."""


def conversion_message(config: GRPOConfig, converted: GRPOConfig, changed: list[str]) -> str:
    """What `from_grpo_config` changed, what that does to each optimizer step and epoch, and how to keep a value."""
    message = [
        f"Converted {type(config).__name__} to POISEConfig. A GRPOConfig does not record which values a script set, "
        "so a field holding TRL's default counts as unset and takes POISE's: "
        + (", ".join(changed) or "no field held one")
        + "."
    ]
    before, after = config.num_generations, converted.num_generations
    if before != after:
        completions = config.per_device_train_batch_size * config.gradient_accumulation_steps * config.world_size
        message.append(
            f"Each optimizer step still trains {completions} completions (per_device_train_batch_size x "
            f"gradient_accumulation_steps x {config.world_size} process(es)), now {completions / after:g} prompts x "
            f"{after} rollouts instead of {completions / before:g} x {before}: {before / after:g}x the prompts per "
            f"step, so an epoch takes {before / after:g}x fewer optimizer steps. The learning rate and schedule are "
            "kept."
        )
    message.append(
        "To keep a value (e.g. TRL's G), pass it: POISEConfig.from_grpo_config(config, num_generations=8), or "
        "build a POISEConfig."
    )
    return " ".join(message)


def _probe_settings(blocks: list[str], hidden_size: int, probe: Any) -> str:
    """A value head's refit settings in POISEConfig's terms, for the estimator's error messages (an ensemble's from
    its first child: POISEConfig builds every child from the same settings)."""
    head, probe = probe.name, getattr(probe, "children", [probe])[0]
    pca = probe.pca_dims
    if isinstance(pca, list | tuple):
        slices = block_slices(blocks, hidden_size)
        ks = {int(start): int(k) for start, _, k in pca}
        pca = [ks.get(slices[name][0], 0) if name in slices else 0 for name in HIDDEN_BLOCKS]
    clip = None if probe.clip == "observed" else list(probe.clip) if probe.clip is not None else "no clipping"
    return f"probe_head={head!r}, probe_alpha={probe.alpha}, probe_pca_dims={pca}, probe_clip_range={clip}"


def changed_defaults() -> dict[str, tuple[Any, Any]]:
    """Field -> (GRPOConfig's default, POISEConfig's) for the defaults POISE changes."""

    def default(f):
        return f.default_factory() if f.default_factory is not MISSING else f.default

    trl = {f.name: default(f) for f in fields(GRPOConfig)}
    poise = {f.name: default(f) for f in fields(POISEConfig) if f.name in trl}
    return {name: (trl[name], value) for name, value in poise.items() if trl[name] != value}


@dataclass
class POISEConfig(GRPOConfig):
    r"""
    Configuration class for [`POISETrainer`].

    Inherits every parameter of [`~trl.GRPOConfig`] and changes three defaults to the paper's Table 4: two rollouts per
    prompt (`num_generations=2`), asymmetric clipping (`epsilon_high=0.28`) and unscaled advantages
    (`scale_rewards="none"`), since POISE's advantage is `r - b` with no std normalisation. Token-mean aggregation
    (`loss_type="dapo"`) and no KL (`beta=0.0`) are TRL's defaults already. `scale_rewards="batch"` divides by the
    std of the rewards of earlier training steps (1 at the first step), a constant given the past, so the gradient
    stays unbiased; `"group"` is rejected because a per-group std includes the rollout's own reward.
    `from_grpo_config` converts an existing `GRPOConfig`, and `POISETrainer` does so itself when given one.

    The `probe_*` fields configure the value probe that predicts each rollout's expected reward from the policy's
    hidden states; the Configuration page of the docs lists each one, with the paper's and the release's values.
    """

    # JSON strings given for these fields (command line, YAML) are parsed into dicts, as TRL does for its own.
    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["probe_domain_buffer_sizes"]

    num_generations: int | None = field(
        default=2,
        metadata={"help": "Rollouts per prompt (G). POISE needs only 2; any G >= 2 works and stays unbiased."},
    )
    epsilon_high: float | None = field(
        default=0.28, metadata={"help": "Upper clipping bound of the importance ratio (paper: 0.28)."}
    )
    scale_rewards: str = field(
        default="none",
        metadata={
            "help": "'none' (paper): advantage = reward - baseline. 'batch': divide by the std of the rewards of all "
            "earlier training steps (+1e-4; 1 until they show any spread), never by a std that contains the "
            "rollout's own reward. 'group' is not supported by POISE because it would make the advantage depend on "
            "the rollout itself.",
        },
    )
    # `int | str | None` parses as a string on the command line; __post_init__ turns "19" into 19.
    probe_layer: int | str | None = field(
        default=None,
        metadata={
            "help": "Decoder block whose output feeds the probe (0-based). None: round(0.53 * num_layers), layer 19 "
            "of 36 for Qwen3-4B as in the paper. Negative values count from the end. 'auto': capture every layer of "
            "`probe_layer_candidates` in the same pass and keep the one whose probe has the lowest prompt-grouped "
            "K-fold error on the buffer, re-chosen every `probe_layer_select_every` steps.",
        },
    )
    probe_layer_candidates: list[int] | None = field(
        default=None,
        metadata={
            "help": "With probe_layer='auto': the layers to choose from (negative counts from the end). None: "
            "round(f * num_layers) for f in 0.25, 0.53, 0.75, 1 (capped at the last layer). The buffer holds every "
            "candidate's features, so its memory grows with their number.",
        },
    )
    probe_layer_select_every: int = field(
        default=16,
        metadata={"help": "With probe_layer='auto': generation steps between two layer choices."},
    )
    probe_layer_switch_margin: float = field(
        default=0.05,
        metadata={
            "help": "With probe_layer='auto': hysteresis. Switch only when the best layer's held-out MAE is below "
            "(1 - margin) times the current layer's.",
        },
    )
    probe_layer_folds: int = field(
        default=5,
        metadata={"help": "With probe_layer='auto': K of the prompt-grouped K-fold cross-validation."},
    )
    probe_pool_tokens: int = field(
        default=10,
        metadata={"help": "n: hidden states are averaged over the last n prompt tokens and last n reasoning tokens."},
    )
    reasoning_end_marker: str | None = field(
        default="</think>",
        metadata={
            "help": "Text that ends the reasoning span (last occurrence, marker included). None: no markers, the "
            "whole completion is the reasoning span and the answer span is its last n tokens.",
        },
    )
    probe_features: list[str] = field(
        default_factory=lambda: ["prompt", "reasoning", "entropy"],
        metadata={"help": f"Feature blocks fed to the probe, any subset of {list(FEATURE_BLOCKS)}."},
    )
    probe_preset: str = field(
        default="release",
        metadata={
            "help": "Probe hyper-parameters: 'release' (PCA prompt->32, reasoning->64, alpha=100) or 'paper' "
            "(no PCA, alpha=0.01). `probe_alpha` and `probe_pca_dims` override the preset when set.",
        },
    )
    probe_alpha: float | None = field(
        default=None, metadata={"help": "Ridge regularisation strength. None: taken from `probe_preset`."}
    )
    probe_pca_dims: list[int] | None = field(
        default=None,
        metadata={
            "help": "PCA components for the [prompt, reasoning] hidden-state blocks; 0 disables PCA on a block. "
            "None: taken from `probe_preset` and capped at each block's width (a model with hidden size 8 keeps 8 "
            "prompt components); explicit dims wider than their block are an error.",
        },
    )
    probe_clip_range: list[float] | None = field(
        default=None,
        metadata={
            "help": "[low, high] range the probe's predictions are clipped to. None: the range of rewards seen in "
            "the buffer, which is [0, 1] for binary rewards.",
        },
    )
    probe_capture: str = field(
        default="auto",
        metadata={
            "help": "Which teacher-forced pass the probe's features come from. 'auto': TRL's own old-log-prob pass "
            "when it runs one (vLLM importance-sampling correction, num_iterations > 1, or steps_per_generation != "
            "gradient_accumulation_steps); otherwise the loss's own forward, with each prompt's rollouts shuffled "
            "into one micro-batch, so a step runs no forward pass GRPOTrainer does not; where a group cannot sit "
            "in one micro-batch (per_device_train_batch_size not a multiple of num_generations), a no-grad pass of "
            "POISE's own, said once in the log. 'pass': always that no-grad pass where TRL runs none (poise-trl "
            "0.1's route; the features and advantages are the same).",
        },
    )
    probe_granularity: str = field(
        default="sequence",
        metadata={
            "help": "'sequence' (paper): one baseline per rollout. 'prefix': once its own probe is trusted (after "
            "`probe_warmup_steps`), every generated token t gets A_t = r - V(x, y_<t), a value of the prefix from the "
            "states before t (unbiased: it never reads token t or later), learned from 4 sampled tokens per rollout; "
            "the sequence-level baseline serves until then. Needs a fixed `probe_layer`.",
        },
    )
    probe_head: str = field(
        default="ridge",
        metadata={
            "help": "The value head fitted on the probe's features, for the baseline and the prompt values "
            "`prompt_selection` reads: 'ridge' (paper), 'logistic' (sigmoid link trained to cross-entropy, "
            "scikit-learn's LogisticRegression(C=1/probe_alpha)), 'mlp' (one hidden layer of 64, as "
            "holi-lab/POISE's) or 'ensemble' (the mean of ridge and logistic). Every head uses probe_alpha as its L2 "
            "penalty and the same scaler and PCA. Ridge stays the default: measured with the exact gradient "
            "instrument, no other head is better on SmolLM2 and the others pay more after training (docs: other "
            "value heads). The per-prefix value (probe_granularity='prefix') needs 'ridge'.",
        },
    )
    probe_buffer_size: int = field(
        default=4096, metadata={"help": "Sliding buffer of (features, target) examples; the oldest leave first."}
    )
    probe_warmup_steps: int = field(
        default=16,
        metadata={
            "help": "Generation steps of bootstrap (the `probe_bootstrap` baseline, built from the other rollouts' "
            "rewards) before the probe's predictions are used.",
        },
    )

    probe_partner_reward: bool = field(
        default=True,
        metadata={
            "help": "Partner-aware probe: the probe's input for rollout j is [φ_j, r_j], its own reward appended as "
            "one more standardized column (outside any PCA block); the target stays the other rollouts' mean reward. "
            "b_i = mean over j != i of h(φ_j, r_j) depends only on the other rollouts, so it stays unbiased. False: "
            "the paper's g(φ_j).",
        },
    )
    probe_history: bool = field(
        default=False,
        metadata={
            "help": "Each prompt's own history (beyond the paper, as SPO tracks past rewards): the probe's input for "
            "a rollout also holds [seen, log(1 + count), mean reward] of its prompt's rollouts at earlier steps "
            "(0 where unseen), outside any PCA block, and so does the prompt-only value `prompt_selection` reads "
            "before generating. Earlier steps' rewards do not depend on this step's rollouts, so the baseline stays "
            "unbiased; the step's own rewards enter the history only after its advantages. Worth it where prompts "
            "repeat across steps and many settle: on two trained SmolLM2 runs it cut the probe's error by a fifth "
            "to a third; on the toys it changes nothing measurable, hence off by default (docs: beyond the paper). "
            "Needs probe_granularity='sequence'.",
        },
    )
    probe_history_size: int = field(
        default=65536,
        metadata={
            "help": "With probe_history: prompts the history remembers (about 40 bytes each on the accelerator); "
            "beyond it, the least recently seen prompts leave first.",
        },
    )
    probe_history_decay: float = field(
        default=1.0,
        metadata={
            "help": "With probe_history: in (0, 1], the weight of a reward one training step older in a prompt's "
            "mean reward (1: the plain mean of every earlier reward; below 1 it follows a changing policy). The count "
            "column counts every reward.",
        },
    )
    probe_bootstrap: str = field(
        default="shrunk",
        metadata={
            "help": "Baseline before the probe is trusted (and where a row has no usable partner): 'rloo' (paper), "
            "the other rollouts' mean reward m_i; 'shrunk', a + w * m_i with (a, w) a least-squares fit of r_i on "
            "m_i over earlier steps' rollouts (a=0, w=1 before any history).",
        },
    )
    prompt_selection: str | None = field(
        default=None,
        metadata={
            "help": "None: train on the sampler's prompts (paper). Otherwise draw `prompt_selection_oversample` "
            "times more candidate prompts and predict each one's success rate p from its prompt hidden states (one "
            "no-grad prefill; a prompt-only probe on the buffer's prompt block), read as v on the observed reward "
            "range. 'importance': draw with replacement with probability proportional to sqrt(v(1 - v)), mixed with "
            "uniform at `prompt_selection_floor`, and multiply each prompt's advantages by its importance weight "
            "1 / (n q), so the expected gradient is the uniform one (exactly under loss_type grpo, dr_grpo, sapo, "
            "luspo; under dapo, cispo, vespo the token-count normaliser is weighted too, up to a finite-batch "
            "difference; bnpo, beta != 0, the entropy bonus and top_entropy_quantile < 1 are refused). 'value' "
            "(biased): keep the candidates of highest v(1 - v), unweighted. Uniform until the probe is trusted (a "
            "warm start is trusted at once).",
        },
    )
    prompt_selection_oversample: float = field(
        default=2.0,
        metadata={"help": "With prompt_selection: candidate prompts per kept prompt (> 1)."},
    )
    prompt_selection_floor: float = field(
        default=DEFAULT_FLOOR,
        metadata={
            "help": "With prompt_selection='importance': the share of uniform probability every candidate keeps, in "
            "(0, 1]; it bounds each weight by 1 / floor (1: uniform, weights 1).",
        },
    )

    probe_init_path: str | None = field(
        default=None,
        metadata={
            "help": "Probe file written by `POISETrainer.save_probe` to warm-start from. Its layer, pooling, features "
            "and hidden size must match this run. The loaded fit predicts as saved; every later refit uses this "
            "run's probe_alpha, probe_pca_dims and probe_clip_range. The bootstrap phase is skipped; a file saved "
            "without its buffer is kept unrefitted until `probe_warmup_steps` steps of new examples are buffered.",
        },
    )

    probe_domain_column: str | None = field(
        default=None,
        metadata={
            "help": "Dataset column naming each prompt's domain. Each domain gets its own probe, buffer and "
            "bootstrap; rows of a domain with too little data use the bootstrap baseline (`probe_bootstrap`). "
            "None: one probe for all prompts.",
        },
    )
    probe_domain_buffer_sizes: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": 'Buffer size per domain, e.g. \'{"math": 4096, "code": 1024}\' (a JSON string works on the '
            "command line). Domains not listed use `probe_buffer_size`.",
        },
    )

    probe_max_domains: int = field(
        default=64,
        metadata={
            "help": "Most distinct values of `probe_domain_column` a run may have; more is an error at start-up "
            "(map the column to fewer values). Each domain's buffer lives on the accelerator and grows with its "
            "rows, up to buffer size x candidate layers x (features + 1) float32 (about 84 MB at Qwen3-4B width, "
            "4x with probe_layer='auto').",
        },
    )

    def __post_init__(self):
        check_settings({"num_generations": self.num_generations})  # before TRL divides batches by it
        super().__post_init__()
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r} is not supported by POISE: it "
                "normalises each reward within its group, own reward included, so a rollout's reward would depend on "
                "its partners. POISE needs the raw weighted reward sum: set "
                "multi_objective_aggregation='sum_then_normalize'."
            )
        if self.probe_pool_tokens <= 0:
            raise ValueError(f"probe_pool_tokens={self.probe_pool_tokens} must be a positive number of tokens.")
        if self.probe_capture not in ("auto", "pass"):
            raise ValueError(f"probe_capture={self.probe_capture!r}: choose 'auto' (no extra forward pass) or 'pass'.")
        if self.reasoning_end_marker == "":
            raise ValueError("reasoning_end_marker='' matches nothing; use None to declare that there is no marker.")
        unknown = sorted(set(self.probe_features) - set(FEATURE_BLOCKS))
        if unknown or not self.probe_features or len(set(self.probe_features)) != len(self.probe_features):
            raise ValueError(
                f"probe_features={self.probe_features}: give a non-empty subset of {list(FEATURE_BLOCKS)} without "
                f"repeats (unknown: {unknown})."
            )
        self.probe_features = [b for b in FEATURE_BLOCKS if b in self.probe_features]
        if self.probe_preset not in PROBE_PRESETS:
            raise ValueError(f"probe_preset={self.probe_preset!r}: choose one of {list(PROBE_PRESETS)}.")
        preset_alpha, preset_dims = PROBE_PRESETS[self.probe_preset]
        # A preset's PCA dims are capped at the block width of a small model; explicit dims are taken as given.
        self.pca_dims_from_preset = self.probe_pca_dims is None
        self.probe_alpha = preset_alpha if self.probe_alpha is None else float(self.probe_alpha)
        self.probe_pca_dims = list(preset_dims if self.probe_pca_dims is None else self.probe_pca_dims)
        if len(self.probe_pca_dims) != 2 or any(int(k) < 0 for k in self.probe_pca_dims):
            raise ValueError(
                f"probe_pca_dims={self.probe_pca_dims}: give two non-negative ints, [prompt dims, reasoning dims]; "
                "0 disables PCA on a block."
            )
        self.probe_pca_dims = [int(k) for k in self.probe_pca_dims]
        self._check_layer_fields()
        self._check_domain_fields()
        self._check_beyond_paper_fields()
        check_settings({name: getattr(self, field) for name, field in ESTIMATOR_FIELDS.items()}, ESTIMATOR_FIELDS)

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **overrides: Any) -> "POISEConfig":
        """The `POISEConfig` of a TRL script's `GRPOConfig`: every value is kept, except that the fields whose default
        POISE changes take POISE's default where `config` holds TRL's. A `GRPOConfig` cannot tell a value the script
        set from a default, so an explicit `num_generations=8` becomes 2 as well: the same completions per step then
        cover 4x the prompts, and an epoch takes 4x fewer steps. One warning says what changed and what it does per
        step and per epoch. `overrides` (any `POISEConfig` field, e.g. `num_generations=8` to keep TRL's G) are
        applied last and never changed."""
        names = {f.name for f in fields(config) if f.init}
        foreign = sorted(names - {f.name for f in fields(cls)})
        if foreign:
            raise TypeError(f"{type(config).__name__} fields {foreign} have no POISEConfig counterpart.")
        values = {name: getattr(config, name) for name in names}
        # GRPOConfig.__post_init__ fills both of these from whichever was given, and refuses both given: passing the
        # steps alone rebuilds the same pair. Deprecated aliases were already copied to their successors.
        del values["generation_batch_size"]
        if values["steps_per_generation"] == values["gradient_accumulation_steps"]:
            values["steps_per_generation"] = None
        values.update(vllm_importance_sampling_cap=None, use_transformers_paged=False)
        if isinstance(config, POISEConfig) and config.pca_dims_from_preset:
            values["probe_pca_dims"] = None  # filled in from the preset: filled in (and capped) again
        if isinstance(config, POISEConfig):
            return cls(**{**values, **overrides})
        changed = []
        for name, (trl_default, poise_default) in changed_defaults().items():
            if name not in overrides and values[name] == trl_default:
                values[name] = poise_default
                changed.append(f"{name} {trl_default!r} -> {poise_default!r}")
        converted = cls(**{**values, **overrides})
        logger.warning(conversion_message(config, converted, changed))
        return converted

    def estimator_settings(self, num_layers: int, hidden_size: int) -> dict[str, Any]:
        """`POISEEstimator` keyword arguments for a model with `num_layers` decoder layers of width `hidden_size`."""
        default_layer = resolve_layer_index(None, num_layers)
        auto = self.probe_layer == "auto"
        # Layers hooked in every captured pass; buffered rows hold one feature vector per entry, in this order.
        layers = (
            layer_candidates(self.probe_layer_candidates, num_layers)
            if auto
            else [resolve_layer_index(self.probe_layer, num_layers)]
        )
        pca = pca_blocks(self.probe_features, hidden_size, self.probe_pca_dims, cap_at_width=self.pca_dims_from_preset)
        return dict(
            alpha=self.probe_alpha,
            pca_dims=pca,
            clip=None if self.probe_clip_range is None else tuple(self.probe_clip_range),
            head=self.probe_head,
            buffer_size=self.probe_buffer_size,
            domain_buffer_sizes=self.probe_domain_buffer_sizes,
            max_domains=self.probe_max_domains,
            warmup_steps=self.probe_warmup_steps,
            partner_reward=self.probe_partner_reward,
            bootstrap=self.probe_bootstrap,
            scale_rewards=self.scale_rewards,
            layers=layers,
            # auto mode starts at the candidate nearest the fixed default
            layer_index=min(range(len(layers)), key=lambda i: abs(layers[i] - default_layer)),
            layer_select_every=self.probe_layer_select_every if auto else None,
            layer_switch_margin=self.probe_layer_switch_margin,
            layer_folds=self.probe_layer_folds,
            prompt_columns=block_slices(self.probe_features, hidden_size).get("prompt"),
            prompt_pca_dims=self.probe_pca_dims[0],
            feature_config={
                "probe_layer": "auto" if auto else layers[0],
                "probe_layer_candidates": list(layers),
                "probe_pool_tokens": self.probe_pool_tokens,
                "probe_features": list(self.probe_features),
                "reasoning_end_marker": self.reasoning_end_marker,
                "hidden_size": hidden_size,
                "probe_partner_reward": self.probe_partner_reward,
                "probe_domain_column": self.probe_domain_column,
            },
            describe=partial(_probe_settings, list(self.probe_features), hidden_size),
            history=self.probe_history,
            history_size=self.probe_history_size,
            history_decay=self.probe_history_decay,
            granularity=self.probe_granularity,
            prefix_pca_dims=tuple(self.probe_pca_dims),  # [prompt k, prefix k], capped at the width
        )

    def _check_layer_fields(self) -> None:
        layer = self.probe_layer
        if isinstance(layer, str):
            text = layer.strip().lower()
            try:
                layer = "auto" if text == "auto" else None if text in ("none", "null") else int(text)
            except ValueError:
                raise ValueError(
                    f"probe_layer={self.probe_layer!r}: give a layer index (e.g. 19 or -1), 'auto', or None."
                ) from None
        if isinstance(layer, bool) or not (layer is None or layer == "auto" or isinstance(layer, int)):
            raise ValueError(f"probe_layer={self.probe_layer!r}: give a layer index (e.g. 19 or -1), 'auto', or None.")
        self.probe_layer = layer
        if layer == "auto" and self.probe_granularity == "prefix":
            raise ValueError(
                "probe_granularity='prefix' needs one fixed probe_layer (its buffer holds one layer's states): set "
                "probe_layer to an index or None, or probe_granularity='sequence'."
            )
        if self.probe_layer_candidates is not None:
            if layer != "auto":
                raise ValueError(
                    f"probe_layer_candidates={self.probe_layer_candidates} is only used with probe_layer='auto' "
                    f"(got probe_layer={layer!r})."
                )
            if not self.probe_layer_candidates or any(isinstance(c, bool) for c in self.probe_layer_candidates):
                raise ValueError(
                    f"probe_layer_candidates={self.probe_layer_candidates}: give a non-empty list of ints."
                )
            self.probe_layer_candidates = [int(c) for c in self.probe_layer_candidates]

    def _check_domain_fields(self) -> None:
        if self.probe_domain_column == "":
            raise ValueError("probe_domain_column='' names no column; use None for a single probe.")
        sizes = self.probe_domain_buffer_sizes
        if sizes is None:
            return
        if self.probe_domain_column is None:
            raise ValueError(
                "probe_domain_buffer_sizes needs probe_domain_column: name the column holding the domain."
            )
        if not isinstance(sizes, dict):
            raise ValueError(
                f"probe_domain_buffer_sizes={sizes!r}: give a dict or a JSON object, e.g. '{{\"math\": 4096}}'."
            )
        self.probe_domain_buffer_sizes = {str(name): size for name, size in sizes.items()}  # sizes: check_settings

    def _check_beyond_paper_fields(self) -> None:
        if not isinstance(self.probe_partner_reward, bool):  # a string such as "no" would count as True
            raise ValueError(
                f"probe_partner_reward={self.probe_partner_reward!r}: give True (partner-aware probe) or False "
                "(the paper's g(φ))."
            )
        oversample = self.prompt_selection_oversample
        if not (isinstance(oversample, int | float) and 1 < oversample < math.inf):
            raise ValueError(
                f"prompt_selection_oversample={oversample!r} must be a finite number > 1: it is the number of "
                "candidate prompts drawn per kept prompt (2.0 draws twice as many as are kept)."
            )
        check_floor(self.prompt_selection_floor)
        if self.prompt_selection is not None and self.prompt_selection not in SAMPLING_RULES:
            close = get_close_matches(str(self.prompt_selection), SAMPLING_RULES, n=1)
            rules = " or ".join(map(repr, SAMPLING_RULES)) + (f" (did you mean {close[0]!r}?)" if close else "")
            raise ValueError(f"prompt_selection={self.prompt_selection!r}: choose None (paper) or {rules}.")
        if self.prompt_selection is None:
            return
        if self.prompt_selection == "importance":
            self._check_importance_objective()
        if "prompt" not in self.probe_features:
            raise ValueError(
                f"prompt_selection={self.prompt_selection!r} predicts from the prompt hidden states: add 'prompt' to "
                f"probe_features (got {self.probe_features})."
            )
        rows = self.per_device_train_batch_size * self.steps_per_generation
        if rows % self.num_generations:
            raise ValueError(
                f"prompt_selection={self.prompt_selection!r} keeps whole prompts on each process, so "
                f"per_device_train_batch_size x steps_per_generation ({rows}) must be a multiple of num_generations "
                f"({self.num_generations})."
            )

    def _check_importance_objective(self) -> None:
        """The importance weights multiply the advantages only: refuse the loss terms and normalisers they cannot
        reach, which would average over the q-tilted prompts instead of the uniform ones."""
        if self.loss_type not in IMPORTANCE_LOSS_TYPES:
            working = ", ".join(map(repr, IMPORTANCE_LOSS_TYPES))
            raise ValueError(
                f"prompt_selection='importance' with loss_type={self.loss_type!r}: the importance weights keep the "
                "uniform objective only where the loss divides by a constant or by the generation batch's token "
                "count, which the trainer weights ('bnpo' divides by the micro-batch's, counted inside TRL's loss). "
                f"Use one of {working} (the default 'dapo' included), or set prompt_selection=None."
            )
        unseen = "does not see the advantages, which carry the importance weights"
        terms = {
            "beta": (self.beta != 0.0, "beta=0.0", f"the KL penalty {unseen}"),
            "entropy_coef": (self.entropy_coef != 0.0, "entropy_coef=0.0", f"the entropy bonus {unseen}"),
            "use_adaptive_entropy": (
                self.use_adaptive_entropy,
                "use_adaptive_entropy=False",
                f"the entropy bonus {unseen}",
            ),
            "top_entropy_quantile": (
                self.top_entropy_quantile < 1.0,
                "top_entropy_quantile=1.0",
                "the top-entropy token mask takes its quantile over the drawn batch's tokens",
            ),
        }
        for name, (active, fix, why) in terms.items():
            if active:
                raise ValueError(
                    f"prompt_selection='importance' with {name}={getattr(self, name)!r}: {why}, so it averages over "
                    "prompts drawn in proportion to q instead of uniform ones and the step no longer targets the "
                    f"uniform objective. Set {fix}, or prompt_selection=None."
                )

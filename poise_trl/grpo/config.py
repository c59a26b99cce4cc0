"""`POISEConfig`: `GRPOConfig` plus the probe's fields, with the paper's defaults: the fields and their help.

What the fields become is elsewhere, where a reader looks for it: the checks at construction (validation.py), the
estimator they set up (specs.py: one map from these fields to the estimator's spec), the prompt sampler's rules and
the losses its weights keep unbiased (sampling.py), and the conversion of a TRL script's `GRPOConfig`
(migration.py). Help texts say what a field does; what it measured is on the docs' pages they link.
"""

from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from ..choices import (
    BOOTSTRAPS,
    DEFAULT_PRESET,
    GRANULARITIES,
    HEADS,
    PROBE_PRESETS,
    REWARD_SCALINGS,
    ROUTINGS,
    RULES,
    SCHEDULES,
    described,
)
from ..estimator.baselines import check_num_generations
from ..features.columns import SCALARS
from ..features.features import FEATURE_BLOCKS
from ..heads.heads import own_settings
from ..presets import preset_changes
from ..settings import DEFAULT_FLOOR
from . import migration
from .validation import validate

_PRESETS = " ".join(f"{name!r}: {preset.summary}." for name, preset in PROBE_PRESETS.items())
"""The probe presets, from their table, for the help text."""


def _preset_help(key: str) -> str:
    """What each preset gives the field `key` (whose None means the preset's), from the presets' table."""
    values = [
        f"{name!r}: {preset.settings[key]!r}" for name, preset in PROBE_PRESETS.items() if key in preset.settings
    ]
    values += [
        f"{name!r}: {preset.domain_settings[key]!r} with a probe_domain_column"
        for name, preset in PROBE_PRESETS.items()
        if key in preset.domain_settings
    ]
    return f"None: the preset's (`probe_preset`; {'; '.join(values)})."


_HEAD_SETTINGS = "; ".join(f"{name!r}: {', '.join(own_settings(name))}" for name in HEADS if own_settings(name))
"""Each value head's own settings (`probe_head_kwargs`), from the head table, for the help text."""


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
    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["probe_domain_buffer_sizes", "probe_head_kwargs"]

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
            "help": f"{described(REWARD_SCALINGS)} 'group' is not supported by POISE because it would make the "
            "advantage depend on the rollout itself.",
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
        metadata={
            "help": f"Feature blocks fed to the probe, any subset of {list(FEATURE_BLOCKS)}, laid out in that order: "
            "the mean hidden states of the last n prompt tokens and of the last n reasoning tokens (hidden size "
            "columns each), the rollout scalars `probe_scalars` ('entropy', named after their default) and the "
            "number of generated tokens ('length', the scalar 'output_length').",
        },
    )
    probe_scalars: list[str] | None = field(
        default=None,
        metadata={
            "help": "The rollout scalars the 'entropy' block of probe_features holds, in order: one column each, "
            "never in a PCA block. The paper's are its three entropy statistics (mean token entropy over the "
            "completion, the reasoning and the answer span); the reference's cut the reasoning and answer spans from "
            "the decoded text. The official code's token-entropy statistics, length and repetition features are the "
            f"other choices: {list(SCALARS)} (what each computes: docs, Configuration). "
            + _preset_help("probe_scalars"),
        },
    )
    probe_preset: str = field(
        default=DEFAULT_PRESET,
        metadata={
            "help": f"The whole probe setup, by name. {_PRESETS} Every field whose default is None takes the "
            "preset's value; an explicit value is taken instead (the model card and the estimator's file then name "
            "each setting changed from the preset), except one the preset cannot do without, which is an error "
            "(e.g. num_generations=4 with 'reference'). Each preset's settings: docs, Configuration.",
        },
    )
    probe_alpha: float | None = field(
        default=None, metadata={"help": "Ridge regularisation strength. " + _preset_help("probe_alpha")}
    )
    probe_pca_dims: list[int] | None = field(
        default=None,
        metadata={
            "help": "PCA components for the [prompt, reasoning] hidden-state blocks; 0 disables PCA on a block. "
            "A preset's dims are capped at each block's width (a model with hidden size 8 keeps 8 prompt "
            "components); explicit dims wider than their block are an error. " + _preset_help("probe_pca_dims"),
        },
    )
    probe_clip_range: list[float] | None = field(
        default=None,
        metadata={
            "help": "[low, high] range the probe's predictions are clipped to; a preset's None is the range of "
            "rewards seen in the buffer, which is [0, 1] for binary rewards. " + _preset_help("probe_clip_range"),
        },
    )
    probe_capture: str = field(
        default="auto",
        metadata={
            "help": "Which teacher-forced pass the probe's features come from. 'auto': TRL's own old-log-prob pass "
            "when it runs one (vLLM importance-sampling correction, or gradient_accumulation_steps not a multiple "
            "of steps_per_generation * num_iterations); otherwise the loss's own forward, with each prompt's "
            "rollouts shuffled into one micro-batch, so a step runs no forward pass GRPOTrainer does not; where a "
            "group cannot sit in one micro-batch (per_device_train_batch_size not a multiple of num_generations), a "
            "no-grad pass of POISE's own, said once in the log. 'pass': always that no-grad pass where TRL runs "
            "none (poise-trl 0.1's route; the features and advantages are the same).",
        },
    )
    probe_granularity: str = field(
        default="sequence",
        metadata={
            "help": f"The baseline's granularity. {described(GRANULARITIES)}",
        },
    )
    probe_head: str | None = field(
        default=None,
        metadata={
            "help": "The value head fitted on the probe's features, for the baseline, the prompt values "
            f"`prompt_selection` reads and the per-prefix value. {described(HEADS)} Every head uses probe_alpha as "
            "its L2 penalty and the same scaler and PCA; its own settings are `probe_head_kwargs`. What each fits: "
            "docs, How POISE works (other value heads); which pays, measured: docs, Choosing settings. "
            + _preset_help("probe_head"),
        },
    )
    probe_head_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "The value head's own settings, beside probe_alpha and the PCA: a dict, or a JSON string on the "
            f"command line, e.g. '{{\"hidden\": 128}}' for 'mlp'. The heads' own settings: {_HEAD_SETTINGS} "
            "(the ensemble's children by name). A key the head does not take is refused when the config is built.",
        },
    )
    probe_buffer_size: int = field(
        default=4096, metadata={"help": "Sliding buffer of (features, target) examples; the oldest leave first."}
    )
    probe_warmup_steps: int = field(
        default=16,
        metadata={
            "help": "Generation steps of bootstrap (the `probe_bootstrap` baseline, built from the other rollouts' "
            "rewards) before the probe's predictions are used: each domain's own steps, or the training steps with "
            "probe_schedule='global'.",
        },
    )
    probe_schedule: str | None = field(
        default=None,
        metadata={
            "help": f"When each domain's probe is fitted and trusted. {described(SCHEDULES)} "
            + _preset_help("probe_schedule")
        },
    )
    probe_domain_warmup_steps: int = field(
        default=8,
        metadata={
            "help": "With probe_schedule='global': a domain's observed steps before its probe is refitted after the "
            "bootstrap (the reference's warmup_steps; its count is set to the training step when the bootstrap "
            "ends, so with probe_warmup_steps >= this value every step whose batch held the domain refits it).",
        },
    )
    probe_buffer_whole_groups: bool | None = field(
        default=None,
        metadata={
            "help": "True: a prompt's rollouts enter a buffer together or not at all and leave it together, the "
            "oldest prompts first; a buffer of n rows holds floor(n / G) prompts (the reference's FIFO of pairs). "
            "False: rows enter and leave one by one. Needs probe_same_domain_groups. "
            + _preset_help("probe_buffer_whole_groups"),
        },
    )

    probe_partner_reward: bool | None = field(
        default=None,
        metadata={
            "help": "Partner-aware probe: the probe's input for rollout j is [φ_j, r_j], its own reward appended as "
            "one more standardized column (outside any PCA block); the target stays the other rollouts' mean reward. "
            "b_i = mean over j != i of h(φ_j, r_j) depends only on the other rollouts, so it stays unbiased. False: "
            "the paper's g(φ_j). " + _preset_help("probe_partner_reward"),
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
            "repeat across steps and many settle; what it changed where measured: docs, Choosing settings. Needs a "
            "granularity whose value reads the feature row (probe_granularity='sequence').",
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
    probe_bootstrap: str | None = field(
        default=None,
        metadata={
            "help": "Baseline before the probe is trusted (and where a row has no usable partner). "
            f"{described(BOOTSTRAPS)} " + _preset_help("probe_bootstrap"),
        },
    )
    probe_reward_range: list[float] | None = field(
        default=None,
        metadata={
            "help": "[low, high]: a finite reward outside it is an error, at the step that gives it (the reference's "
            "correctness rewards lie in [0, 1]); a preset's None accepts any reward. "
            + _preset_help("probe_reward_range"),
        },
    )
    prompt_selection: str | None = field(
        default=None,
        metadata={
            "help": "None: train on the sampler's prompts (paper). Otherwise draw `prompt_selection_oversample` "
            "times more candidate prompts and predict each one's success rate p from its prompt hidden states (one "
            "no-grad prefill; a prompt-only probe on the buffer's prompt block), read as v on the observed reward "
            f"range. {described(RULES)} Uniform until the probe is trusted (a warm start is trusted at once).",
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
            "help": "Where to warm-start the probe from: a folder `POISETrainer.save_model` wrote (a saved or pushed "
            "model, a checkpoint: the estimator's file is beside the weights), or a file `POISETrainer.save_probe` "
            "wrote. Its layer, pooling, features and hidden size must match this run. The loaded fit predicts as "
            "saved; every later refit uses this run's probe_alpha, probe_pca_dims and probe_clip_range. The bootstrap "
            "phase is skipped; a file saved without its buffer is kept unrefitted until `probe_warmup_steps` steps of "
            "new examples are buffered.",
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
            "command line). Domains not listed use `probe_buffer_size`; with probe_schedule='global' it lists every "
            "domain the run may have, each fitted at the end of the bootstrap. A preset that names none leaves every "
            "domain at probe_buffer_size. " + _preset_help("probe_domain_buffer_sizes"),
        },
    )
    probe_domain_routing: str | None = field(
        default=None,
        metadata={
            "help": "How a row's `probe_domain_column` value becomes its domain. "
            f"{described(ROUTINGS)} " + _preset_help("probe_domain_routing"),
        },
    )
    probe_same_domain_groups: bool | None = field(
        default=None,
        metadata={
            "help": "True: a prompt whose rollouts fall in two domains (after probe_domain_routing) is an error. "
            + _preset_help("probe_same_domain_groups"),
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
        check_num_generations(self.num_generations)  # before TRL divides batches by it
        super().__post_init__()
        validate(self)

    def preset_changes(self) -> dict[str, tuple[Any, Any]]:
        """Field -> (the preset's value, this config's) for each setting of `probe_preset` this config changed: what
        the model card and the estimator's file name."""
        return preset_changes(self)

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **overrides: Any) -> "POISEConfig":
        """The `POISEConfig` of a TRL script's `GRPOConfig`: every value is kept, except that the fields whose default
        POISE changes take POISE's default where `config` holds TRL's. A `GRPOConfig` cannot tell a value the script
        set from a default, so an explicit `num_generations=8` becomes 2 as well: the same completions per step then
        cover 4x the prompts, and an epoch takes 4x fewer steps. One warning says what changed and what it does per
        step and per epoch. `overrides` (any `POISEConfig` field, e.g. `num_generations=8` to keep TRL's G) are
        applied last and never changed."""
        return migration.from_grpo_config(cls, config, **overrides)

"""The estimator's settings as small typed, frozen specs, and the one map from `POISEConfig` to them.

`POISEEstimator(num_generations, spec)` takes one `EstimatorSpec`: the value head with its own settings
(`HeadSpec`), the prompt history or none (`HistorySpec`), the candidate layers (`LayerSpec`), the buffers, the
domains and the probes' schedule (`BufferSpec`), the granularity (`GranularitySpec`), the partner-aware probe, the
bootstrap, the reward scaling, the rewards' range and the sampler's prompt block (`PromptSpec`). Every default is
poise-trl's release's (probe_preset "release"). A spec checks itself when built, against the registries
(`heads.HEADS`, `granularity.GRANULARITIES`, `baselines.BOOTSTRAPS` and `REWARD_SCALINGS`, `schedule.SCHEDULES`,
`domains.ROUTINGS`) and, where two settings meet, by what each entry can do (a granularity's `takes_history`,
`one_layer` and `head_methods`), never by a name. The estimator's file saves it (`to_dict`, JSON), so a saved
estimator is rebuilt as it was (`POISEEstimator.from_file`).

Each field that a `POISEConfig` field sets names that field in its metadata ("config"): the one map from the config
to the estimator. `estimator_spec` reads the config through it (computing the "derived" fields, which need the
model, itself), and a refusal names the field the user wrote (`SettingError.named`).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..features.features import HIDDEN_BLOCKS, FeatureLayout, layer_candidates, resolve_layer_index
from ..heads.heads import HEADS, make_head, own_settings
from ..heads.probe import PCABlock, ScaledHead
from ..settings import Refused
from .baselines import BOOTSTRAPS, REWARD_SCALINGS
from .domains import ROUTINGS
from .granularity import GRANULARITIES
from .history import PromptHistory
from .row import FeatureRow
from .schedule import SCHEDULES

Name = Callable[[type, str], str]
"""How a refusal names a setting: (spec class, field) -> the name shown."""


def spec_name(spec: type, key: str) -> str:
    """A setting named as the spec holds it, e.g. `HeadSpec.alpha`."""
    return f"{spec.__name__}.{key}"


def config_field(spec: type, key: str) -> str:
    """The `POISEConfig` field that sets a spec's field (its metadata)."""
    return spec.__dataclass_fields__[key].metadata["config"]


class SettingError(ValueError):
    """A refused setting, named by `spec_name` until `named` renders it with other names (POISEConfig's fields)."""

    def __init__(self, message: Callable[[Name], str]):
        self.message = message
        super().__init__(message(spec_name))

    def named(self, name: Name) -> str:
        return self.message(name)


def _bad(spec: type, key: str, value: Any, rule: str) -> SettingError:
    return SettingError(lambda name: f"{name(spec, key)}={value!r} {rule}")


def _config(name: str, derived: bool = False) -> dict[str, Any]:
    """A field's metadata: the config field that sets it; `derived`: computed from it and the model."""
    return {"config": name, "derived": derived}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tuples(value: Any) -> Any:
    """Lists (JSON's, or a config's) as tuples, recursively; mappings as dicts."""
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _normalise(spec: Any, **values: Any) -> None:
    for key, value in values.items():
        object.__setattr__(spec, key, value)


@dataclass(frozen=True)
class HeadSpec:
    """The value head of the sequence value, the sampler's prompt values and the per-prefix value: its name in
    `heads.HEADS`, the front end's settings every head shares (alpha, PCA, clip: None is the observed reward range)
    and its own (`kwargs`: the MLP's `hidden`, the ensemble's `children` by name, `combine`, `folds`, ...; JSON
    values, as the spec is saved in the estimator's file)."""

    name: str = field(default="ridge", metadata=_config("probe_head"))
    alpha: float = field(default=100.0, metadata=_config("probe_alpha"))
    pca_dims: int | tuple[PCABlock, ...] | None = field(default=None, metadata=_config("probe_pca_dims", True))
    clip: tuple[float, float] | None = field(default=None, metadata=_config("probe_clip_range"))
    kwargs: Mapping[str, Any] = field(default_factory=dict, metadata=_config("probe_head_kwargs"))

    def __post_init__(self):
        if not isinstance(self.kwargs or {}, Mapping):
            raise _bad(HeadSpec, "kwargs", self.kwargs, 'must be a dict or a JSON object, e.g. {"hidden": 128}.')
        _normalise(self, pca_dims=_tuples(self.pca_dims), clip=_tuples(self.clip), kwargs=_tuples(self.kwargs or {}))
        if self.name not in HEADS:
            raise _bad(HeadSpec, "name", self.name, f"is not a value head: choose one of {sorted(HEADS)}.")
        try:  # the front end every head shares checks the shared settings
            ScaledHead(self.alpha, clip="observed" if self.clip is None else self.clip)
        except Refused as refused:
            raise _bad(HeadSpec, refused.key, refused.value, refused.rule) from None
        if self.clip is not None and (len(self.clip) != 2 or not self.clip[0] < self.clip[1]):
            raise _bad(HeadSpec, "clip", self.clip, "is not a range: give [low, high] with low < high, or None.")
        own = own_settings(self.name)
        unknown = sorted(set(self.kwargs) - set(own))
        if unknown:
            takes = f"its own settings are {', '.join(own)}" if own else "it has no settings of its own"
            rule = f"names {unknown}, not settings of the head {self.name!r}: {takes}."
            raise _bad(HeadSpec, "kwargs", self.kwargs, rule)
        try:
            self.build(self.pca_dims)
        except (ValueError, TypeError) as error:  # the head's own check of its values, e.g. the MLP's width
            raise _bad(HeadSpec, "kwargs", self.kwargs, f"is refused by the head {self.name!r}: {error}") from None
        _normalise(self, alpha=float(self.alpha))

    def build(self, pca_dims: int | Sequence[PCABlock] | None, observed_clip: bool = False) -> Any:
        """The unfitted head with PCA `pca_dims` (a feature row's blocks: `row.FeatureRow.pca_dims`), clipped to the
        spec's range (None, or `observed_clip`: the observed reward range)."""
        clip = None if observed_clip else self.clip
        blocks = pca_dims if pca_dims is None or isinstance(pca_dims, int) else list(pca_dims)
        return make_head(
            self.name, alpha=self.alpha, pca_dims=blocks, clip="observed" if clip is None else clip, **self.kwargs
        )


@dataclass(frozen=True)
class HistorySpec:
    """Each prompt's history as probe inputs (history.py): the prompts remembered and the per-step decay of the
    mean."""

    size: int = field(default=65536, metadata=_config("probe_history_size"))
    decay: float = field(default=1.0, metadata=_config("probe_history_decay"))

    def __post_init__(self):
        try:  # the table checks its own settings
            PromptHistory(self.size, self.decay)
        except Refused as refused:
            raise _bad(HistorySpec, refused.key, refused.value, refused.rule) from None


@dataclass(frozen=True)
class LayerSpec:
    """The candidate layer ids whose features the (N, C, D) rows hold, in order; `index` is the slice in use at the
    start, re-chosen every `select_every` observed steps (None: fixed) by prompt-grouped `folds`-fold error, with
    hysteresis `switch_margin`."""

    ids: tuple[int, ...] = field(default=(0,), metadata=_config("probe_layer_candidates", True))
    index: int = field(default=0, metadata=_config("probe_layer", True))
    select_every: int | None = field(default=None, metadata=_config("probe_layer_select_every", True))
    switch_margin: float = field(default=0.05, metadata=_config("probe_layer_switch_margin"))
    folds: int = field(default=5, metadata=_config("probe_layer_folds"))

    def __post_init__(self):
        _normalise(self, ids=tuple(int(i) for i in self.ids))
        if self.select_every is not None and not (_is_int(self.select_every) and self.select_every >= 1):
            raise _bad(LayerSpec, "select_every", self.select_every, "must be >= 1 (steps between layer choices).")
        if not 0 <= self.switch_margin < 1:
            raise _bad(LayerSpec, "switch_margin", self.switch_margin, "must be in [0, 1) (a relative improvement).")
        if not _is_int(self.folds) or self.folds < 2:
            raise _bad(LayerSpec, "folds", self.folds, "must be >= 2 (prompt-grouped K-fold needs two folds).")
        if not self.ids or not 0 <= self.index < len(self.ids):
            rule = f"is not a slice of the {len(self.ids)} hooked layers {list(self.ids)}."
            raise _bad(LayerSpec, "index", self.index, rule)


@dataclass(frozen=True)
class BufferSpec:
    """Each domain's sliding buffer (`size` rows; `domain_sizes` per domain), the domains a run may have, how a row's
    name becomes its domain (`routing`, a key of `domains.ROUTINGS`) and the schedule of the domains' probes
    (`schedule`, a key of `schedule.SCHEDULES`): `warmup_steps` observed steps before a probe is trusted (per domain,
    or one global bootstrap), `domain_warmup_steps` a domain's steps before its refits after the global bootstrap.
    `whole_groups`: a prompt's rows enter a buffer together or not at all, and leave it together (its capacity is
    rounded down to whole groups); `same_domain_groups`: a prompt whose rollouts fall in two domains is refused. The
    sizes depend on G (`check`, `rows`), which the estimator knows."""

    size: int = field(default=4096, metadata=_config("probe_buffer_size"))
    domain_sizes: Mapping[str, int] = field(default_factory=dict, metadata=_config("probe_domain_buffer_sizes"))
    max_domains: int = field(default=64, metadata=_config("probe_max_domains"))
    warmup_steps: int = field(default=16, metadata=_config("probe_warmup_steps"))
    schedule: str = field(default="domain", metadata=_config("probe_schedule"))
    domain_warmup_steps: int = field(default=8, metadata=_config("probe_domain_warmup_steps"))
    whole_groups: bool = field(default=False, metadata=_config("probe_buffer_whole_groups"))
    routing: str = field(default="identity", metadata=_config("probe_domain_routing"))
    same_domain_groups: bool = field(default=False, metadata=_config("probe_same_domain_groups"))

    def __post_init__(self):
        _normalise(self, domain_sizes=dict(self.domain_sizes or {}))
        if not _is_int(self.max_domains) or self.max_domains < 1:
            raise _bad(BufferSpec, "max_domains", self.max_domains, "must be >= 1.")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise _bad(BufferSpec, "warmup_steps", self.warmup_steps, "must be >= 0.")
        if self.schedule not in SCHEDULES:
            rule = f"is not a schedule: choose one of {list(SCHEDULES)}."
            raise _bad(BufferSpec, "schedule", self.schedule, rule)
        if self.schedule == "global" and self.warmup_steps < 1:
            rule = "must be >= 1 with the schedule 'global': its probes are fitted at the end of the bootstrap."
            raise _bad(BufferSpec, "warmup_steps", self.warmup_steps, rule)
        if not _is_int(self.domain_warmup_steps) or self.domain_warmup_steps < 0:
            raise _bad(BufferSpec, "domain_warmup_steps", self.domain_warmup_steps, "must be >= 0.")
        if self.routing not in ROUTINGS:
            raise _bad(
                BufferSpec, "routing", self.routing, f"is not a domain routing: choose one of {list(ROUTINGS)}."
            )
        for key in ("whole_groups", "same_domain_groups"):
            if not isinstance(getattr(self, key), bool):  # a string such as "no" would count as True
                raise _bad(BufferSpec, key, getattr(self, key), "must be True or False.")
        if self.whole_groups and not self.same_domain_groups:
            raise SettingError(
                lambda name: (
                    f"{name(BufferSpec, 'whole_groups')}=True with {name(BufferSpec, 'same_domain_groups')}=False: "
                    "a prompt's rows enter one domain's buffer together, so its rollouts must share a domain. Turn "
                    f"{name(BufferSpec, 'same_domain_groups')} on, or {name(BufferSpec, 'whole_groups')} off."
                )
            )

    def capacity(self, domain: str) -> int:
        return self.domain_sizes.get(domain, self.size)

    def rows(self, domain: str, num_generations: int) -> int:
        """The rows a domain's probe buffer holds: its capacity, rounded down to whole groups of `num_generations`
        with `whole_groups` (the reference's FIFO of floor(rows / 2) pairs)."""
        capacity = self.capacity(domain)
        return capacity - capacity % num_generations if self.whole_groups else capacity

    def check(self, num_generations: int) -> None:
        """Every buffer must hold two groups of `num_generations` rollouts."""
        sizes = [(lambda name: name(BufferSpec, "size"), self.size)]
        for domain, size in self.domain_sizes.items():
            sizes.append((lambda name, d=domain: f"{name(BufferSpec, 'domain_sizes')}[{d!r}]", size))
        for shown, size in sizes:
            if not _is_int(size) or size < 2 * num_generations:
                rule = f"must be an int holding at least two groups ({2 * num_generations} examples)."
                raise SettingError(lambda name, shown=shown, size=size, rule=rule: f"{shown(name)}={size!r} {rule}")


@dataclass(frozen=True)
class GranularitySpec:
    """The baseline's granularity, a key of `granularity.GRANULARITIES`, and the per-prefix value's PCA
    [prompt k, prefix k] (0: none)."""

    name: str = field(default="sequence", metadata=_config("probe_granularity"))
    pca_dims: tuple[int, int] = field(default=(0, 0), metadata=_config("probe_pca_dims", True))

    def __post_init__(self):
        _normalise(self, pca_dims=_tuples(self.pca_dims))
        if self.name not in GRANULARITIES:
            choices = " or ".join(map(repr, GRANULARITIES))
            raise _bad(GranularitySpec, "name", self.name, f"is not a baseline granularity: choose {choices}.")
        if len(self.pca_dims) != 2 or not all(_is_int(k) and k >= 0 for k in self.pca_dims):
            rule = "must be two ints >= 0, [prompt k, prefix k] (0: no PCA on that block)."
            raise _bad(GranularitySpec, "pca_dims", self.pca_dims, rule)


@dataclass(frozen=True)
class PromptSpec:
    """The prompt block's feature columns [start, stop), which the sampler's prompt values read, and its PCA size
    (0: none)."""

    columns: tuple[int, int] = field(metadata=_config("probe_features", True))
    pca_dims: int = field(default=0, metadata=_config("probe_pca_dims", True))

    def __post_init__(self):
        _normalise(self, columns=_tuples(self.columns))
        if len(self.columns) != 2 or not 0 <= self.columns[0] < self.columns[1]:
            raise _bad(PromptSpec, "columns", self.columns, "must be two columns [start, stop) with start < stop.")
        if not _is_int(self.pca_dims) or self.pca_dims < 0:
            raise _bad(PromptSpec, "pca_dims", self.pca_dims, "must be >= 0 (0: no PCA).")


@dataclass(frozen=True)
class EstimatorSpec:
    """Everything `POISEEstimator` is set up with (module docstring); `partner_reward`: the probe input of rollout j
    is [φ_j, r_j] (beyond the paper) instead of φ_j; `bootstrap`: a key of `baselines.BOOTSTRAPS`; `scale_rewards`:
    a key of `baselines.REWARD_SCALINGS`; `reward_range`: [low, high], a finite reward outside it is refused (None:
    any reward); `prompt`: None without a prompt block (no prompt values)."""

    head: HeadSpec = field(default_factory=HeadSpec)
    history: HistorySpec | None = field(default=None, metadata=_config("probe_history", True))
    layers: LayerSpec = field(default_factory=LayerSpec)
    buffer: BufferSpec = field(default_factory=BufferSpec)
    granularity: GranularitySpec = field(default_factory=GranularitySpec)
    partner_reward: bool = field(default=True, metadata=_config("probe_partner_reward"))
    bootstrap: str = field(default="shrunk", metadata=_config("probe_bootstrap"))
    scale_rewards: str = field(default="none", metadata=_config("scale_rewards"))
    reward_range: tuple[float, float] | None = field(default=None, metadata=_config("probe_reward_range"))
    prompt: PromptSpec | None = None

    def __post_init__(self):
        if not isinstance(self.partner_reward, bool):  # a string such as "no" would count as True
            raise SettingError(
                lambda name: (
                    f"{name(EstimatorSpec, 'partner_reward')}={self.partner_reward!r}: give True "
                    "(partner-aware probe) or False (the paper's g(φ))."
                )
            )
        if self.bootstrap not in BOOTSTRAPS:
            rule = f"is not a bootstrap: choose one of {list(BOOTSTRAPS)}."
            raise _bad(EstimatorSpec, "bootstrap", self.bootstrap, rule)
        if self.scale_rewards not in REWARD_SCALINGS:
            rule = (
                "is not supported by POISE: a per-group std includes the rollout's own reward and biases the "
                f"gradient. Use {' or '.join(map(repr, REWARD_SCALINGS))}."
            )
            raise _bad(EstimatorSpec, "scale_rewards", self.scale_rewards, rule)
        _normalise(self, reward_range=_tuples(self.reward_range))
        low_high = self.reward_range
        if low_high is not None and (
            len(low_high) != 2
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in low_high)
            or not low_high[0] < low_high[1]
        ):
            rule = "is not a range: give [low, high] with low < high, or None (any reward)."
            raise _bad(EstimatorSpec, "reward_range", self.reward_range, rule)
        if low_high is not None:
            _normalise(self, reward_range=(float(low_high[0]), float(low_high[1])))
        self._check_granularity()

    @property
    def row(self) -> FeatureRow:
        """The probe's input row this spec lays out, [φ | partner reward | history]."""
        return FeatureRow(self.partner_reward, self.history is not None)

    def _check_granularity(self) -> None:
        """What the granularity can work with: the head's methods, the history's columns, several layers."""
        granularity, head = GRANULARITIES[self.granularity.name], HEADS[self.head.name]
        chosen = self.granularity.name
        missing = [method for method in granularity.head_methods if not callable(getattr(head, method, None))]
        if missing:
            able = [
                n for n, h in HEADS.items() if all(callable(getattr(h, m, None)) for m in granularity.head_methods)
            ]
            raise SettingError(
                lambda name: (
                    f"{name(HeadSpec, 'name')}={self.head.name!r} with {name(GranularitySpec, 'name')}="
                    f"{chosen!r}: the value is applied inside the forward hook as one affine map of the hidden "
                    f"states (the head's `{'`, `'.join(missing)}`), which the head {self.head.name!r} has not. Use a "
                    f"head that has it ({', '.join(map(repr, able))}), or the granularity 'sequence' for this head."
                )
            )
        if self.history is not None and not granularity.takes_history:
            raise SettingError(
                lambda name: (
                    f"{name(EstimatorSpec, 'history')}=True with {name(GranularitySpec, 'name')}={chosen!r}: "
                    "the per-prefix value is applied inside the forward hook as one affine map of the hidden states "
                    "(prefix.py), which has no input for a prompt's history. Use the granularity 'sequence' with the "
                    "history, or leave it off."
                )
            )
        if granularity.one_layer and len(self.layers.ids) > 1:
            rule = f"needs one fixed layer, got the candidates {list(self.layers.ids)}: fix the probe layer."
            raise _bad(GranularitySpec, "name", chosen, rule)

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-able values (tuples become lists in JSON); `from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EstimatorSpec":
        parts = {"head": HeadSpec, "history": HistorySpec, "layers": LayerSpec, "buffer": BufferSpec}
        parts.update(granularity=GranularitySpec, prompt=PromptSpec)
        values = {}
        for key, value in data.items():
            if key in parts and value is not None:
                value = parts[key](**{k: v if k == "domain_sizes" else _tuples(v) for k, v in value.items()})
            values[key] = value
        return cls(**values)


# ------------------------------------------------------------------------------------------- from POISEConfig
def _read(spec: type, config: Any, **given: Any) -> Any:
    """`spec` with each field set by its config field (metadata "config"), except the derived ones and `given`."""
    values = {
        f.name: getattr(config, f.metadata["config"])
        for f in fields(spec)
        if f.metadata.get("config") and not f.metadata["derived"] and f.name not in given
    }
    return spec(**values, **given)


def estimator_spec(config: Any, num_layers: int | None = None, hidden_size: int | None = None) -> EstimatorSpec:
    """The `EstimatorSpec` of a `POISEConfig` for a model of `num_layers` decoder layers of width `hidden_size`.
    Without the model, the derived fields (layers, PCA blocks, prompt block) keep their defaults: what the config
    checks when it is built. A refusal names the config's fields."""
    auto = config.probe_layer == "auto"
    layers: dict[str, Any] = {"select_every": config.probe_layer_select_every}  # checked even when not used
    head: dict[str, Any] = {}
    prompt = None
    if num_layers is not None:
        ids = (
            layer_candidates(config.probe_layer_candidates, num_layers)
            if auto
            else [resolve_layer_index(config.probe_layer, num_layers)]
        )
        start = resolve_layer_index(None, num_layers)  # auto mode starts at the candidate nearest the fixed default
        layers = dict(
            ids=tuple(ids),
            index=min(range(len(ids)), key=lambda i: abs(ids[i] - start)),
            select_every=config.probe_layer_select_every if auto else None,
        )
        layout = FeatureLayout.from_config(config)
        cap = config.pca_dims_from_preset
        head["pca_dims"] = layout.pca_blocks(hidden_size, config.probe_pca_dims, cap_at_width=cap)
        columns = layout.slices(hidden_size).get("prompt")
        prompt = None if columns is None else PromptSpec(columns, config.probe_pca_dims[0])
    try:
        history = _read(HistorySpec, config)  # checked even when off
        spec = _read(
            EstimatorSpec,
            config,
            head=_read(HeadSpec, config, **head),
            history=history if config.probe_history else None,
            layers=_read(LayerSpec, config, **layers),
            buffer=_read(BufferSpec, config),
            granularity=_read(GranularitySpec, config, pca_dims=tuple(config.probe_pca_dims)),
            prompt=prompt,
        )
        spec.buffer.check(config.num_generations)
    except SettingError as error:
        raise ValueError(error.named(config_field)) from None
    return spec


def feature_config(config: Any, spec: EstimatorSpec, hidden_size: int) -> dict[str, Any]:
    """How the trainer extracts the features `spec`'s estimator reads: a saved state loads only into the same."""
    ids = list(spec.layers.ids)
    return {
        "probe_layer": "auto" if config.probe_layer == "auto" else ids[0],
        "probe_layer_candidates": ids,
        "probe_pool_tokens": config.probe_pool_tokens,
        "probe_features": list(config.probe_features),
        "probe_scalars": list(FeatureLayout.from_config(config).read_scalars),
        "reasoning_end_marker": config.reasoning_end_marker,
        "hidden_size": hidden_size,
        "probe_partner_reward": config.probe_partner_reward,
        "probe_domain_column": config.probe_domain_column,
    }


def head_settings(layout: FeatureLayout, hidden_size: int, probe: Any) -> str:
    """A value head's refit settings in POISEConfig's terms, for the estimator's error messages (an ensemble's from
    its first child: the spec builds every child from the same shared settings)."""
    head, probe = probe.name, getattr(probe, "children", [probe])[0]
    pca = probe.pca_dims
    if isinstance(pca, list | tuple):
        slices = layout.slices(hidden_size)
        ks = {int(start): int(k) for start, _, k in pca}
        pca = [ks.get(slices[name][0], 0) if name in slices else 0 for name in HIDDEN_BLOCKS]
    clip = None if probe.clip == "observed" else list(probe.clip) if probe.clip is not None else "no clipping"
    shown = {"name": head, "alpha": probe.alpha, "pca_dims": pca, "clip": clip}
    return ", ".join(f"{config_field(HeadSpec, key)}={value!r}" for key, value in shown.items())

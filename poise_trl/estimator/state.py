"""What `POISEEstimator` has learned, as one frozen record, and the pieces of it its spec builds. Pure torch.

The estimator keeps its settings (the spec, G, the feature configuration) apart from what it learns, as a
scikit-learn estimator does: the learned part is one `EstimatorState`, which `observe` and `load_state_dict` replace
in one assignment once the next state is built whole from the old one. Every part of it is a value that is never
changed once the record holds it (a learner's `added`/`fitted`, a buffer's `added`, the history's and the reward
std's `updated` return new ones), so a stop anywhere inside `observe` leaves the estimator as it was before the call
or as it is after it, never between. Its file (files.py) is a function of this record and the settings.

A new learned part (a global bootstrap buffer, say) is one more field here, its update in `observe`, and its keys
in files.py's `state_to_dict`/`state_from_dict`.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .baselines import BOOTSTRAPS, RunningStd
from .buffer import ProbeBuffer
from .granularity import GRANULARITIES, PrefixBaseline, SequenceBaseline
from .history import PromptHistory
from .learner import OnlineLearner
from .schedule import SCHEDULES
from .specs import EstimatorSpec


@dataclass(frozen=True)
class EstimatorState:
    """Everything the estimator learned across steps; the mappings and their values are never changed once held.

    probes: each domain's learner of the sequence value (its head, buffer, step count, trust).
    bootstrap_pairs: each domain's buffered (partner mean, reward) pairs of earlier steps (the shrunk bootstrap).
    bootstrap_lines: each domain's bootstrap line [a, w], fitted on those pairs.
    reward_std: the running std of earlier steps' rewards (`scale_rewards="batch"`).
    steps: observed (training) steps.
    layer_index: the candidate layer slice the probes use (the automatic layer choice moves it).
    prompt_history: each prompt's count and mean reward at earlier steps (None without a history spec).
    token_baseline: the granularity's token baseline (granularity.py), with its own learner for "prefix".
    """

    probes: Mapping[str, OnlineLearner] = field(default_factory=dict)
    bootstrap_pairs: Mapping[str, ProbeBuffer] = field(default_factory=dict)
    bootstrap_lines: Mapping[str, torch.Tensor] = field(default_factory=dict)
    reward_std: RunningStd = field(default_factory=RunningStd)
    steps: int = 0
    layer_index: int = 0
    prompt_history: PromptHistory | None = None
    token_baseline: SequenceBaseline | PrefixBaseline = field(default_factory=SequenceBaseline)

    @classmethod
    def initial(cls, spec: EstimatorSpec) -> "EstimatorState":
        """What an estimator with `spec` knows before any step: nothing learned, the bootstrap baselines."""
        history = spec.history
        return cls(
            layer_index=spec.layers.index,
            prompt_history=None if history is None else PromptHistory(history.size, history.decay),
            token_baseline=GRANULARITIES[spec.granularity.name](
                head=spec.head.build,
                pca_dims=spec.granularity.pca_dims,
                buffer_size=spec.buffer.size,
                warmup_steps=spec.buffer.warmup_steps,
            ),
        )


def new_learner(spec: EstimatorSpec, domain: str, num_generations: int) -> OnlineLearner:
    """A domain's learner of the sequence value, unfitted: `spec`'s head (PCA laid on its feature row), the domain's
    buffer rows (whole groups of `num_generations` with `BufferSpec.whole_groups`) and the warmup its schedule gives
    a learner (schedule.py)."""
    head = spec.head.build(spec.row.pca_dims(spec.head.pca_dims))
    warmup = SCHEDULES[spec.buffer.schedule].learner_warmup(spec.buffer)
    return OnlineLearner(head, spec.buffer.rows(domain, num_generations), warmup)


def bootstrap_lines(bootstrap: str, pairs: Mapping[str, ProbeBuffer]) -> dict[str, torch.Tensor]:
    """Each domain's bootstrap line [a, w] (`baselines.BOOTSTRAPS[bootstrap]`), fitted on its buffered (partner
    mean, reward) pairs; none for the RLOO bootstrap, which learns nothing."""
    fit = BOOTSTRAPS[bootstrap]
    if fit is None:
        return {}
    return {name: fit(ring.features[:, 0], ring.targets) for name, ring in pairs.items() if len(ring)}

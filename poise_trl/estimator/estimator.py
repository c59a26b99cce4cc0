"""`POISEEstimator`: everything POISE learns across steps, as one pure-torch object any training loop can call.

The contract (the one TRL's `POISETrainer`, verl, OpenRLHF or a hand-written loop relies on):

    estimator = POISEEstimator(num_generations=2)           # G rollouts per prompt; settings: EstimatorSpec (specs.py)
    batch = Rollouts(rewards, prompt_ids=ids)               # (N,) rewards, stable prompt ids, ...: one record a batch
    result = estimator.advantages(features, batch)          # features (N, D) or (N, C, D)
    loss = policy_loss(..., result.advantages)              # A_i = r_i - b_i, b_i from rollout i's partners only
    estimator.observe(result)                               # the ONLY learning method: buffers, refit, bootstrap
    # with a history spec the record's prompt_ids are needed; prompt_values(states, prompt_ids=ids)
    print(result.metrics())                                 # diagnostics (paper App. C), fetched with observe's
    estimator.save("poise.safetensors")                     # one file, no pickle, written atomically

- `advantages` uses only what earlier `observe` calls taught it, so a rollout's baseline never depends on its own
  reward or features and the policy gradient stays unbiased. Before the probe is trusted (`BufferSpec.warmup_steps`
  observed steps of its domain, or of training under the global schedule: schedule.py) the baseline is the
  bootstrap: RLOO, the partners' mean reward m_i, or the shrunk a + w * m_i. It changes nothing, and neither does
  `predict`, each row's probe value. It refuses a batch its spec does not accept (a prompt's rollouts in two domains,
  a reward outside the range, a domain the global schedule's buffers do not list).
- `observe` appends the step's leave-one-out examples (features of j, mean reward of j's partners) to the sliding
  buffer of each domain (whole prompts, with `BufferSpec.whole_groups`), refits the probes its schedule says, the
  shrunk bootstrap's line, the running reward std and (with
  several candidate layers) the layer choice. Handed the step's `result`, it reuses the batch `advantages` prepared
  (`PreparedBatch`, batch.py) and the step costs exactly one device->host transfer; given the batch
  (`observe(features=..., rollouts=...)`) it prepares it itself. It builds the whole next learned state from the old
  one and the batch and assigns it once: a stop anywhere inside leaves the estimator as it was before the call or
  as it is after it, never between (so does `load_state_dict`).
- `prompt_values` predicts a prompt's success rate from its prompt block; which prompts to draw from it is
  sampling.py's.
- With a `HistorySpec`, each row's input also holds its prompt's history (history.py: seen, log(1 + count), mean
  reward of the prompt's rollouts at earlier steps), looked up by the record's `prompt_ids` (and those handed to
  `prompt_values`), and updated by `observe` once the step's advantages were taken.
- `state_dict`/`load_state_dict` round-trip bit for bit; `save`/`load` also read the two-file layout of poise-trl 0.1
  (`poise_probe.safetensors` + `.json`, `poise_bootstrap.safetensors`). The file holds the spec: `from_file` rebuilds
  a saved estimator, and `refit` makes one with another spec (another head, no history) from its buffered rows.

Features may hold one vector per candidate layer, (N, C, D); `layer_index_` says which slice the probes use. Rows are
grouped as G consecutive rollouts of one prompt. The record's `domains` (one name per row) give each domain its own
probe.

What it is made of, each in a module of its own: its settings (specs.py), what it learned (state.py: one frozen
`EstimatorState`, `state_`), the feature row's layout (row.py), the value head (heads.py, probe.py), the online
learner that buffers, trusts and persists a head (learner.py; one per domain, and one more for the per-prefix
value), the granularity's token baseline (granularity.py), the layer choice (layer_choice.py), the sampler's prompt
values (prompt_value.py), the prompts' history (history.py) and the file format (files.py: functions of the state
and the settings).
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ..features.features import FeatureLayout
from ..heads.interface import ValueHead
from ..presets import preset_record
from .baselines import (
    BOOTSTRAPS,
    REWARD_SCALINGS,
    RunningStd,
    check_num_generations,
    cross_rollout_baselines,
    poise_advantages,
    step_statistics,
)
from .batch import AdvantageResult, PreparedBatch, Rollouts, prepare_batch, scale_advantages, split_domains
from .buffer import ProbeBuffer
from .domains import check_same_domain, routed
from .files import read_state, save_state, state_from_dict, state_to_dict
from .granularity import PrefixBaseline, PrefixBatch, SequenceBaseline
from .history import PromptHistory
from .layer_choice import select_layer
from .learner import OnlineLearner
from .prompt_value import fit_prompt_values, target_range
from .row import FeatureRow
from .schedule import SCHEDULES
from .specs import EstimatorSpec, estimator_spec, feature_config, head_settings
from .state import EstimatorState, bootstrap_lines, new_learner

__all__ = ["POISEEstimator", "AdvantageResult", "PreparedBatch", "Rollouts"]  # the batch types live in batch.py


class POISEEstimator:
    """POISE's value baseline, learned online (paper Algorithm 1). See the module docstring for the contract.

    As a scikit-learn estimator, the constructor checks and stores its arguments and builds nothing (None: the
    default spec); what derives from them (the feature row, each domain's learner) is computed where it is used.
    What is learned is one frozen record, `state_` (state.py: probes, buffers, bootstrap lines, reward std, step
    count, the layer in use, the prompt history, the token baseline), which `observe` and `load_state_dict` build
    whole and assign once; until the first of them it is the record of an estimator that learned nothing (the
    bootstrap baselines). Its parts read as attributes with scikit-learn's trailing underscore (`probes_`, `steps_`,
    `layer_`, `trusted_`, ...). `state_dict`/`save` are functions of it and the settings (files.py); the file holds
    the spec too (`from_file`).

    Args:
        num_generations: G, rollouts per prompt (>= 2).
        spec: everything the estimator is set up with (specs.py: the value head and its settings, the prompt history
            or none, the layers, the buffers, the granularity, the partner-aware probe, the bootstrap, the reward
            scaling, the prompt block); None: `EstimatorSpec()`, the paper's and the release's defaults.
            `POISEConfig` builds it (`from_config`).
        feature_config: how the caller extracts features; a saved state loads only into the same configuration.
        broadcast: makes every process agree (e.g. accelerate's `broadcast` from rank 0); None in one process.
        describe: text for a probe's refit settings in error messages (`from_config` passes POISEConfig's terms).
        preset: where the settings came from, recorded in the file and never checked (`from_config` passes the
            config's `probe_preset` and the settings changed from it: `presets.preset_record`).
    """

    def __init__(
        self,
        num_generations: int = 2,
        spec: EstimatorSpec | None = None,
        *,
        feature_config: dict[str, Any] | None = None,
        broadcast: Callable[[torch.Tensor], torch.Tensor] | None = None,
        describe: Callable[[ValueHead], str] | None = None,
        preset: Mapping[str, Any] | None = None,
    ):
        check_num_generations(num_generations)
        spec = EstimatorSpec() if spec is None else spec
        spec.buffer.check(num_generations)
        self.num_generations = num_generations
        self.spec = spec
        self.feature_config = feature_config
        self.broadcast = broadcast
        self.describe = describe
        self.preset = preset

    @classmethod
    def from_config(
        cls,
        config: Any,
        num_layers: int,
        hidden_size: int,
        broadcast: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> "POISEEstimator":
        """The estimator a `POISEConfig` sets up for a model of `num_layers` decoder layers of width `hidden_size`
        (`specs.estimator_spec`, the one map from the config's fields), its errors in the config's terms."""
        spec = estimator_spec(config, num_layers, hidden_size)
        return cls(
            config.num_generations,
            spec,
            feature_config=feature_config(config, spec, hidden_size),
            broadcast=broadcast,
            describe=partial(head_settings, FeatureLayout.from_config(config), hidden_size),
            preset=preset_record(config),
        )

    @classmethod
    def from_file(
        cls, path: str | Path, broadcast: Callable[[torch.Tensor], torch.Tensor] | None = None, **kwargs: Any
    ) -> "POISEEstimator":
        """The estimator a file holds, built from the spec and feature configuration saved in it and then loaded
        (`load`'s keywords pass on); files written before the spec was saved are refused: build the estimator
        with their settings and `load` them."""
        info = read_state(path)["info"]
        if "spec" not in info:
            raise ValueError(
                f"{path} was written before estimator files held their spec: build the POISEEstimator it was "
                "written with (e.g. POISEEstimator.from_config) and call its load."
            )
        spec = EstimatorSpec.from_dict(info["spec"])
        settings = dict(feature_config=info["feature_config"], broadcast=broadcast, preset=info.get("preset"))
        estimator = cls(info["num_generations"], spec, **settings)
        estimator.load(path, **kwargs)
        return estimator

    def refit(self, spec: EstimatorSpec) -> "POISEEstimator":
        """A new estimator with `spec` (e.g. another head, or no history) that learned what this one learned: its
        probes are fitted on this estimator's buffered rows, projected onto the new feature row (`FeatureRow.project`
        may leave out the history or the partner's reward, never add them), with the same step counts, bootstrap,
        reward std, layer and, where both keep one, prompt history. Compares heads and input sets on exactly the data
        a run's probe learned from."""
        settings = dict(feature_config=self.feature_config, broadcast=self.broadcast, describe=self.describe)
        refitted = type(self)(self.num_generations, spec, **settings, preset=self.preset)
        state = self.state_dict()
        tensors, info = dict(state["tensors"]), {**state["info"], "domains": [], "spec": spec.to_dict()}
        for i, domain in enumerate(state["info"]["domains"]):
            probe = refitted.new_probe(domain["name"]).probe  # unfitted: its state is dropped below
            info["domains"].append({**domain, "head": probe.name, "probe": probe.config()})
            tensors = {key: value for key, value in tensors.items() if not key.startswith(f"domain.{i}.probe.")}
            key = f"domain.{i}.buffer.features"
            if key in tensors:
                tensors[key] = self.row.project(tensors[key], refitted.row)
        if spec.history is None:
            tensors = {key: value for key, value in tensors.items() if not key.startswith("history.")}
            info.pop("history", None)
        refitted.load_state_dict({"tensors": tensors, "info": info}, source="the estimator refitted")
        loaded = refitted.state_  # the new estimator is not returned yet: its state may be set twice
        schedule = SCHEDULES[spec.buffer.schedule]
        probes = {
            name: online.fitted(loaded.layer_index)
            if online.can_fit and schedule.may_fit(online, loaded.steps, spec.buffer)
            else online
            for name, online in loaded.probes.items()
        }
        refitted.state_ = replace(loaded, probes=probes)
        return refitted

    # ---------------------------------------------------------------------------------------------- learned state
    @property
    def state_(self) -> EstimatorState:
        """What `observe`/`load_state_dict` learned, one frozen record (state.py); before either of them, what an
        estimator of this spec knows then: nothing learned, the bootstrap baselines."""
        learned = vars(self).get("_state")
        return EstimatorState.initial(self.spec) if learned is None else learned

    @state_.setter
    def state_(self, state: EstimatorState) -> None:
        self._state = state  # the one assignment that changes what the estimator learned

    @property
    def probes_(self) -> Mapping[str, OnlineLearner]:
        """Domain -> the learner of its sequence value (`OnlineLearner`: probe, buffer, step count)."""
        return MappingProxyType(self.state_.probes)

    @property
    def bootstrap_pairs_(self) -> Mapping[str, ProbeBuffer]:
        """Domain -> its buffered (partner mean, reward) pairs of earlier steps (the shrunk bootstrap's)."""
        return MappingProxyType(self.state_.bootstrap_pairs)

    @property
    def bootstrap_lines_(self) -> Mapping[str, torch.Tensor]:
        """Domain -> its bootstrap line [a, w]."""
        return MappingProxyType(self.state_.bootstrap_lines)

    @property
    def reward_std_(self) -> RunningStd:
        """The running std of earlier steps' rewards."""
        return self.state_.reward_std

    @property
    def steps_(self) -> int:
        """Observed (training) steps."""
        return self.state_.steps

    @property
    def layer_index_(self) -> int:
        """The candidate slice the probes use now (fixed, or the latest automatic choice)."""
        return self.state_.layer_index

    @property
    def layer_(self) -> int:
        """The layer id the probes use now (fixed, or the latest automatic choice)."""
        return self.layers[self.layer_index_]

    @property
    def prompt_history_(self) -> PromptHistory | None:
        """Each prompt's count and mean reward at earlier steps (None without a history spec)."""
        return self.state_.prompt_history

    @property
    def token_baseline_(self) -> SequenceBaseline | PrefixBaseline:
        """The granularity's token baseline (granularity.py), with its learner for "prefix"."""
        return self.state_.token_baseline

    @property
    def trusted_(self) -> bool:
        """Whether any domain's probe is trusted (past its bootstrap, or warm-started)."""
        return any(online.trusted for online in self.state_.probes.values())

    # ------------------------------------------------------------------------------------------------- structure
    @property
    def layers(self) -> tuple[int, ...]:
        """The candidate layer ids whose features the rows hold, in order."""
        return self.spec.layers.ids

    @property
    def row(self) -> FeatureRow:
        """The probe's input row, [φ | partner reward | history]."""
        return self.spec.row

    def new_probe(self, domain: str) -> OnlineLearner:
        """A domain's learner of the sequence value, unfitted, with this estimator's settings."""
        return new_learner(self.spec, domain, self.num_generations)

    def prepare(self, features: torch.Tensor, rollouts: Rollouts) -> PreparedBatch:
        """The batch as `advantages`, `predict` and `observe` use it: (N, D) or (N, C, D) features and their
        record."""
        return self._prepare(self.state_, features, rollouts)

    def _prepare(self, state: EstimatorState, features: torch.Tensor, rollouts: Rollouts) -> PreparedBatch:
        if features.shape[:1] != (rollouts.rows,):
            raise ValueError(f"Got {rollouts.rows} rewards for {features.shape[0]} feature rows.")
        self.row.check_pca(self.spec.head.pca_dims, features.size(-1))
        rewards, buffer = rollouts.rewards, self.spec.buffer
        g = rollouts.num_generations or self.num_generations
        if buffer.whole_groups and g != self.num_generations:
            raise ValueError(
                f"whole_groups (probe_buffer_whole_groups) keeps whole groups of {self.num_generations} rollouts in "
                f"the buffers, but the batch has groups of {g}: give batches of the estimator's num_generations."
            )
        names = routed(rollouts.domains, buffer.routing)
        if names is not None and buffer.same_domain_groups:
            check_same_domain(names, g)
        domain_rows = split_domains(names, rollouts.rows, rewards.device, state.probes, buffer.max_domains)
        SCHEDULES[buffer.schedule].accepts(domain_rows, buffer)
        self._check_reward_range(rewards)
        history = self._history_columns(state, rollouts.prompt_ids, rollouts.rows, rewards.device)
        return prepare_batch(features, rollouts, g, self.row, domain_rows, history)

    def _check_reward_range(self, rewards: torch.Tensor) -> None:
        """Refuse a finite reward outside `spec.reward_range` (one device->host transfer where a range is set)."""
        if self.spec.reward_range is None:
            return
        low, high = self.spec.reward_range
        outside = torch.isfinite(rewards) & ((rewards < low) | (rewards > high))
        if outside.any():
            rows = outside.nonzero().flatten()[:5]
            raise ValueError(
                f"The rewards {rewards[rows].tolist()} of rows {rows.tolist()} lie outside reward_range "
                f"[{low:g}, {high:g}] (probe_reward_range), which this estimator refuses (the reference preset's "
                "correctness rewards lie in [0, 1]): rescale the rewards, or widen or drop the range."
            )

    def history_columns(
        self, prompt_ids: torch.Tensor | None, rows: int, device: torch.device | str | None = None
    ) -> torch.Tensor | None:
        """(rows, 3) history columns of each row's prompt from the steps observed so far (None without `history`)."""
        return self._history_columns(self.state_, prompt_ids, rows, device)

    def _history_columns(
        self, state: EstimatorState, prompt_ids: torch.Tensor | None, rows: int, device: torch.device | str | None
    ) -> torch.Tensor | None:
        """(rows, 3) history columns of each row's prompt from earlier steps only (None without `history`), looked
        up on `device`, where the table lives (the rewards' device: ids elsewhere would move it back and forth)."""
        if state.prompt_history is None:
            return None
        if prompt_ids is None or prompt_ids.shape != (rows,):
            got = None if prompt_ids is None else tuple(prompt_ids.shape)
            raise ValueError(
                f"history=True (probe_history) looks each row's prompt up by its id: give prompt_ids, ({rows},) "
                f"int64 ids that are the same for a prompt at every step (e.g. buffer.prompt_group_ids), got {got}."
            )
        return state.prompt_history.columns(prompt_ids.to(device))

    # -------------------------------------------------------------------------------------------------- estimate
    @staticmethod
    def _probe_values(state: EstimatorState, batch: PreparedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(clipped, unclipped) probe value of each usable row from its domain's fitted probe; NaN elsewhere."""
        values = torch.full_like(batch.rewards, torch.nan)
        unclipped = values.clone()
        for name, rows in batch.domain_rows.items():
            online = state.probes.get(name)
            if online is not None and online.probe.is_fitted:
                clipped, raw = online.predict(batch.features, return_unclipped=True)
                values = torch.where(rows & batch.usable, clipped, values)
                unclipped = torch.where(rows & batch.usable, raw, unclipped)
        return values, unclipped

    def predict(self, features: torch.Tensor, rollouts: Rollouts) -> torch.Tensor:
        """Each row's probe value g(φ_j) (h(φ_j, r_j) when partner-aware, hence the record's rewards), from what
        earlier `observe` calls taught: NaN where a row has no usable features or its domain no fitted probe. Changes
        nothing; the baseline of rollout i is the mean of its partners' values (`advantages`)."""
        state = self.state_
        return self._probe_values(state, self._prepare(state, features, rollouts))[0]

    def _fallback(self, state: EstimatorState, batch: PreparedBatch) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The bootstrap baseline of each row (None: RLOO, `poise_advantages`' own) and the lines it used."""
        if BOOTSTRAPS[self.spec.bootstrap] is None:
            return None, []
        fallback, lines = batch.targets.clone(), []
        identity = torch.tensor([0.0, 1.0], dtype=torch.float64)
        for name, rows in batch.domain_rows.items():
            line = state.bootstrap_lines.get(name, identity).to(batch.rewards.device)
            fallback = torch.where(rows, (line[0] + line[1] * batch.targets).to(batch.rewards.dtype), fallback)
            lines.append(line)
        return fallback, lines

    def advantages(
        self, features: torch.Tensor, rollouts: Rollouts, prefix: PrefixBatch | None = None
    ) -> AdvantageResult:
        """A_i = r_i - b_i for one global batch of consecutive groups, from earlier steps' probes only. Changes
        nothing: hand the result to `observe` to learn from the batch without preparing it again.

        features: (N, D) or (N, C, D); rollouts: the batch's rewards and the rest of what it reads per row (`Rollouts`;
        its prompt_ids are needed with `history`: the rows' inputs take their prompt's history from earlier steps).
        Rows without a finite reward or completion get advantage 0; the importance weights multiply the advantages
        after any scaling. prefix: the per-prefix capture (granularity "prefix"); once trusted, the result holds
        `token_advantages`."""
        state = self.state_
        batch = self._prepare(state, features, rollouts)
        g, rewards, scorable, usable = batch.num_generations, batch.rewards, batch.scorable, batch.usable
        values, unclipped = self._probe_values(state, batch)
        trusted = torch.zeros_like(scorable)
        for name, rows in batch.domain_rows.items():
            online = state.probes.get(name)
            if online is not None and online.trusted:
                trusted = trusted | rows
        fallback, lines = self._fallback(state, batch)
        advantages, baselines, receives = poise_advantages(
            rewards, values, g, usable, batch.has_completion, trusted, fallback
        )
        token_baseline = state.token_baseline
        tokens = token_baseline.advantages(prefix, rewards, receives, advantages)
        divisor = REWARD_SCALINGS[self.spec.scale_rewards](state.reward_std)  # of earlier steps' rewards
        from_probe = trusted & ~torch.isnan(cross_rollout_baselines(values, g, usable))
        extra = {  # the share of rows whose baseline really is the bootstrap's (untrusted, or no usable partner)
            "bootstrap": (receives & ~from_probe).double().sum() / receives.sum().clamp(min=1),
            "feature_rows_dropped": (batch.has_completion & ~batch.has_features).double().sum(),
            "unscorable_rows": (~scorable).double().sum(),
        }
        if lines:
            mean_line = torch.stack(lines).mean(0)
            extra.update(bootstrap_intercept=mean_line[0], bootstrap_weight=mean_line[1])
        extra.update(token_baseline.diagnostics(prefix, rewards, receives, tokens))
        domains = batch.domain_rows if batch.named_domains else None
        stats, names = step_statistics(rewards, g, baselines, values, unclipped, receives, extra, domains)
        if tokens is not None:  # a row's logged advantage and baseline: its tokens' mean
            advantages, baselines = tokens.mean, torch.where(receives, rewards - tokens.mean, baselines)
        weights = rollouts.weights
        result = AdvantageResult(
            advantages=scale_advantages(advantages, divisor, weights),
            baselines=baselines,
            receives=receives,
            values=values,
            targets=batch.targets,
            stats=stats,
            names=names,
            batch=batch,
            prefix=prefix,
            token_advantages=None if tokens is None else scale_advantages(tokens.advantages, divisor, weights),
        )
        result.host_metrics = {"layer": float(self.layers[state.layer_index]), **self._buffer_sizes(state, batch)}
        result.host_metrics.update(token_baseline.host_metrics())
        if batch.named_domains:
            for name in batch.domain_rows:
                online = state.probes.get(name)
                result.host_metrics[f"domain/{name}/bootstrap"] = float(online is None or not online.trusted)
        return result

    @staticmethod
    def _buffer_sizes(state: EstimatorState, batch: PreparedBatch) -> dict[str, float]:
        """`buffer_size` (rows buffered in every domain) and, per domain of the batch, `domain/<name>/buffer_size`;
        `<granularity>/buffer_size` for a token baseline's learner."""
        sizes = {"buffer_size": float(sum(len(online.buffer) for online in state.probes.values()))}
        tokens = state.token_baseline
        for learner in tokens.learners:
            sizes[f"{tokens.name}/buffer_size"] = float(len(learner.buffer))
        if batch.named_domains:
            for name in batch.domain_rows:
                online = state.probes.get(name)
                sizes[f"domain/{name}/buffer_size"] = float(0 if online is None else len(online.buffer))
        return sizes

    # ---------------------------------------------------------------------------------------------------- learn
    def observe(
        self,
        result: AdvantageResult | None = None,
        *,
        features: torch.Tensor | None = None,
        rollouts: Rollouts | None = None,
        prefix: PrefixBatch | None = None,
    ) -> dict[str, float]:
        """Learn from a batch after its advantages were taken: buffers, probe refit, bootstrap line, reward std, and
        the layer choice when due. Give `result`, what `advantages` returned for the batch (its prepared batch is
        reused and its diagnostics come to the host in this call's one transfer), or the batch as `advantages` took
        it (`features` and `rollouts`). The record's prompt ids group the rows for K-fold layer selection (without
        them each group of G rows is a prompt of its own) and, with `history`, the step's rewards then enter their
        prompts' history, for later steps. Returns `probe_fit_seconds`, the buffer sizes after learning
        (`buffer_size`, and per domain with domains) and, when the layer was re-chosen, `layer_mae/<layer>`.

        The next learned state is built whole from the old one and the batch, then assigned in one statement: a
        stop anywhere inside leaves the estimator as it was before the call or as it is after it."""
        start = time.perf_counter()
        if result is not None and (features is not None or rollouts is not None):
            raise ValueError("observe takes `result` or the batch (features= and rollouts=), not both.")
        if result is None and (features is None or rollouts is None):
            raise ValueError(
                "observe needs `result`, what advantages returned for the batch, or the batch itself: features= and "
                "rollouts=."
            )
        old = self.state_
        batch = self._prepare(old, features, rollouts) if result is None else result.batch
        prefix = result.prefix if prefix is None and result is not None else prefix
        state, metrics = self._next_state(old, batch, result, prefix)
        self.state_ = state
        refitted = metrics.pop("refitted")
        metrics["probe_fit_seconds"] = time.perf_counter() - start if refitted or metrics else 0.0
        return {**metrics, **self._buffer_sizes(state, batch)}

    def _next_state(
        self, old: EstimatorState, batch: PreparedBatch, result: AdvantageResult | None, prefix: PrefixBatch | None
    ) -> tuple[EstimatorState, dict[str, Any]]:
        """The state after learning from `batch` (nothing of `old` is changed), and the layer choice's metrics with
        "refitted" (whether any head was refitted)."""
        targets, scorable = batch.targets, batch.scorable
        examples = batch.usable & scorable & torch.isfinite(targets)
        group_ids = batch.prompt_ids
        if group_ids is None:  # every group of G consecutive rows is its own prompt, distinct across steps
            rows = torch.arange(targets.numel(), device=targets.device)
            group_ids = (old.steps << 32) + rows // batch.num_generations
        probes, pairs, buffer = dict(old.probes), dict(old.bootstrap_pairs), self.spec.buffer
        for name, rows in batch.domain_rows.items():
            online = probes[name] if name in probes else self.new_probe(name)
            keep = rows & examples
            if buffer.whole_groups:  # a prompt's rows enter together or not at all, so they leave together
                keep = keep.view(-1, batch.num_generations).all(1).repeat_interleave(batch.num_generations)
            probes[name] = online.added(batch.features, targets, group_ids.to(targets.device), keep=keep)
            if BOOTSTRAPS[self.spec.bootstrap] is not None:
                ring = pairs[name] if name in pairs else ProbeBuffer(buffer.capacity(name))
                pairs[name] = ring.added(
                    targets.unsqueeze(1), batch.rewards, keep=rows & scorable & targets.isfinite()
                )
        tokens = old.token_baseline.observed(prefix, batch.rewards, scorable & batch.has_completion)
        history = old.prompt_history  # after this step's baselines: its rewards serve later steps only
        if history is not None:
            history = history.updated(batch.prompt_ids, batch.rewards)
        steps = old.steps + 1
        self._transfer(probes, pairs, tokens, result, targets.device)
        metrics: dict[str, Any] = {"refitted": False}
        layers, layer_index = self.spec.layers, old.layer_index
        if layers.select_every and steps % layers.select_every == 0:
            layer_index, chosen = select_layer(
                list(probes.values()),
                layers.ids,
                layer_index,
                layers.switch_margin,
                layers.folds,
                targets.device,
                self.broadcast,
            )
            metrics.update(chosen)
        probes, refit = SCHEDULES[buffer.schedule].plan(probes, steps, batch.domain_rows, layer_index, buffer)
        for name in refit:
            probes[name] = probes[name].fitted(layer_index, targets.device, self.broadcast)
        metrics["refitted"] = bool(refit)
        tokens, fitted = tokens.fitted(prefix, targets.device, self.broadcast)
        metrics["refitted"] |= fitted
        state = EstimatorState(
            probes=probes,
            bootstrap_pairs=pairs,
            bootstrap_lines=bootstrap_lines(self.spec.bootstrap, pairs),
            reward_std=old.reward_std.updated(batch.rewards),
            steps=steps,
            layer_index=layer_index,
            prompt_history=history,
            token_baseline=tokens,
        )
        return state, metrics

    @staticmethod
    def _transfer(
        probes: dict[str, OnlineLearner],
        pairs: dict[str, ProbeBuffer],
        tokens: Any,
        result: AdvantageResult | None,
        device: torch.device,
    ) -> None:
        """The step's one device->host transfer: the fill levels of the buffers this step added to (which the host
        does not know yet) and the handed result's diagnostics."""
        rings = [online.buffer for online in probes.values()] + list(pairs.values())
        rings = [ring for ring in rings + [learner.buffer for learner in tokens.learners] if not ring.counts_known]
        counts = [ring.counts().to(device).double() for ring in rings]
        pending = result is not None and not result.on_host
        payload = [result.payload().to(device)] if pending else []
        host = torch.cat([torch.zeros(0, dtype=torch.float64, device=device), *counts, *payload]).tolist()
        for i, ring in enumerate(rings):  # new buffers, built this step: the held state is not touched
            ring.set_counts(host[2 * i], host[2 * i + 1])
        if pending:
            result.receive_host(host[2 * len(rings) :])

    # ------------------------------------------------------------------------------------------- prompt values
    def prompt_values(
        self, prompt_features: torch.Tensor, prompt_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Predicted success value of each candidate prompt from its (M, width) prompt-block features (current
        layer) and, with `history`, its prompt's history (by its (M,) `prompt_ids`; only steps already observed, so
        before this step's generation), by a prompt-only probe on the buffers (prompt_value.py); None until a probe
        is trusted and at least two groups are buffered. What to draw from these values is `sampling.py`'s business."""
        prompt, state = self.spec.prompt, self.state_
        if prompt is None or not any(online.trusted for online in state.probes.values()):
            return None
        head = self.spec.head.build(self.row.prompt_pca_dims(prompt.columns, prompt.pca_dims), observed_clip=True)
        history = self._history_columns(state, prompt_ids, prompt_features.size(0), prompt_features.device)
        return fit_prompt_values(
            list(state.probes.values()),
            prompt.columns,
            state.layer_index,
            head,
            2 * self.num_generations,
            self.row.assemble_prompt(prompt_features, history),
            self.row,
        )

    def target_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lowest, highest) buffered target over every domain: the observed reward range that `prompt_values` are
        read on (0-d tensors, left on the buffers' device)."""
        return target_range(list(self.state_.probes.values()))

    # ---------------------------------------------------------------------------------------------- persistence
    def state_dict(self, include_buffer: bool = True) -> dict[str, Any]:
        """{"tensors": CPU tensors, "info": JSON-able dict}: everything `load_state_dict` needs, no pickle
        (`files.state_to_dict`)."""
        return state_to_dict(
            self.state_, self.num_generations, self.spec, self.feature_config, include_buffer, self.preset
        )

    def load_state_dict(
        self,
        state: dict[str, Any],
        warm_start: bool = False,
        source: str = "the state",
        device: torch.device | str | None = None,
    ) -> None:
        """Restore `state_dict()` exactly, in one assignment (a stop inside leaves the state as it was); with
        `warm_start`, only the probes, trusted at once and with fresh step counters (a new run starting from a saved
        probe). Buffers go to `device` (where the features will come from). Refuses a state of another feature
        configuration or prompt history setting, and on resume one whose refit settings, bootstrap or history table
        differ from this estimator's (`files.state_from_dict`)."""
        self.state_ = state_from_dict(
            state,
            self.spec,
            self.feature_config,
            self.state_,
            warm_start,
            source,
            device,
            self.describe,
            num_generations=self.num_generations,
        )

    def save(self, path: str | Path, include_buffer: bool = True) -> None:
        """One safetensors file (the JSON in its header), written atomically."""
        save_state(path, self.state_dict(include_buffer))

    def load(
        self,
        path: str | Path,
        warm_start: bool = False,
        bootstrap_path: str | Path | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Load a file written by `save`, or poise-trl 0.1's probe file (`path` + '.json' beside it) with, on
        resume, its `poise_bootstrap.safetensors` as `bootstrap_path`."""
        self.load_state_dict(read_state(path, bootstrap_path), warm_start, str(path), device)

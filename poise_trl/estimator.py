"""`POISEEstimator`: everything POISE learns across steps, as one pure-torch object any training loop can call.

The contract (the one TRL's `POISETrainer`, verl, OpenRLHF or a hand-written loop relies on):

    estimator = POISEEstimator(num_generations=2)          # G rollouts per prompt, consecutive in the batch
    result = estimator.advantages(features, rewards)       # features (N, D) or (N, C, D), rewards (N,)
    loss = policy_loss(..., result.advantages)             # A_i = r_i - b_i, b_i from rollout i's partners only
    estimator.observe(group_ids=group_ids, result=result)  # the ONLY learning method: buffers, refit, bootstrap
    # with history=True: advantages(features, rewards, prompt_ids=ids) and prompt_values(states, prompt_ids=ids)
    print(result.metrics())                                # diagnostics (paper App. C), fetched with observe's
    estimator.save("poise.safetensors")                    # one file, no pickle, written atomically

- `advantages` uses only what earlier `observe` calls taught it, so a rollout's baseline never depends on its own
  reward or features and the policy gradient stays unbiased. Before the probe is trusted (`warmup_steps` observed
  steps) the baseline is the bootstrap: RLOO, the partners' mean reward m_i, or the shrunk a + w * m_i. It changes
  nothing, and neither does `predict`, each row's probe value.
- `observe` appends the step's leave-one-out examples (features of j, mean reward of j's partners) to the sliding
  buffer of each domain, refits the ridge probe, the shrunk bootstrap's line, the running reward std and (with
  several candidate layers) the layer choice. Handed the step's `result`, it reuses the batch `advantages` prepared
  (`PreparedBatch`, batch.py) and the step costs exactly one device->host transfer; given the tensors
  (`observe(features, rewards, group_ids)`) it prepares the batch itself.
- `prompt_values` predicts a prompt's success rate from its prompt block; which prompts to draw from it is
  sampling.py's.
- With `history`, each row's input also holds its prompt's history (history.py: seen, log(1 + count), mean reward of
  the prompt's rollouts at earlier steps), looked up by the `prompt_ids` the caller hands `advantages` (and
  `prompt_values`), and updated by `observe` once the step's advantages were taken.
- `state_dict`/`load_state_dict` round-trip bit for bit; `save`/`load` also read the two-file layout of poise-trl 0.1
  (`poise_probe.safetensors` + `.json`, `poise_bootstrap.safetensors`).

Features may hold one vector per candidate layer, (N, C, D); `layer_index` says which slice the probes use. Rows are
grouped as G consecutive rollouts of one prompt. `domains` (one name per row) gives each domain its own probe.

What it is made of, each in a module of its own: the value head (heads.py, probe.py), the online learner that buffers,
trusts and persists a head (learner.py; one per domain, and one more for the per-prefix value), the granularity's
token baseline (granularity.py), the layer choice (layer_choice.py), the sampler's prompt values (prompt_value.py),
the prompts' history (history.py) and the file format (files.py).
"""

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .baselines import RunningStd, cross_rollout_baselines, poise_advantages, shrunk_rloo_line
from .batch import AdvantageResult, PreparedBatch, prepare_batch, scale_advantages, split_domains, step_statistics
from .buffer import ProbeBuffer
from .files import EstimatorFile
from .granularity import GRANULARITIES, PrefixBatch
from .heads import HEADS, ValueHead
from .history import HISTORY_COLUMNS, PromptHistory
from .layer_choice import select_layer
from .learner import OnlineLearner
from .prompt_value import fit_prompt_values, target_range
from .settings import check_settings

__all__ = ["POISEEstimator", "AdvantageResult", "PreparedBatch"]  # the result types live in batch.py


class POISEEstimator(EstimatorFile):
    """POISE's value baseline, learned online (paper Algorithm 1). See the module docstring for the contract.

    The constructor stores its arguments as given (scikit-learn's rule): what derives from them (the probe template,
    each domain's capacity) is computed where it is used, and what is learned (probes, buffers, bootstrap lines,
    reward std, step count, the layer in use) lives beside them. `state_dict`/`load_state_dict`/`save`/`load` are
    `files.EstimatorFile`'s, beside the file format.

    Args:
        num_generations: G, rollouts per prompt (>= 2).
        alpha, pca_dims, clip: the value head's settings (`probe.ScaledHead`); clip None means the observed reward
            range. The partner-reward column (`partner_reward`) and the history columns (`history`) are never part
            of a PCA block, whatever `pca_dims` says.
        head: the value head of the sequence value and of the sampler's prompt values, a key of `heads.HEADS`
            ("ridge", the paper's; "logistic", "mlp", "ensemble"). The per-prefix value is always ridge's.
        buffer_size: rows in each domain's sliding buffer; `domain_buffer_sizes` overrides it per domain.
        max_domains: distinct domains a run may have; each holds its own probe and buffer (the buffer grows with its
            rows, up to buffer_size x candidate layers x (width + 1) float32 on the features' device).
        warmup_steps: observed steps before a domain's probe is trusted.
        partner_reward: the probe input of rollout j is [φ_j, r_j] (beyond the paper) instead of φ_j.
        bootstrap: "rloo" (paper) or "shrunk" (a + w * RLOO fitted on earlier steps).
        scale_rewards: "none" (paper) or "batch" (divide by the std of earlier steps' rewards).
        layers: the candidate layer ids whose features the (N, C, D) rows hold, in order; `layer_index` is the
            slice in use at the start. `layer_select_every` (None: fixed) re-chooses it by prompt-grouped K-fold error.
        prompt_columns: (start, stop) feature columns of the prompt block, for `prompt_values`; `prompt_pca_dims`
            its PCA size (0: none).
        feature_config: how the caller extracts features; a saved state loads only into the same configuration.
        broadcast: makes every process agree (e.g. accelerate's `broadcast` from rank 0); None in one process.
        describe: text for a probe's refit settings in error messages (the trainer passes POISEConfig's terms).
        history: append each prompt's history (history.py; beyond the paper) to its rows' inputs, after the
            partner-reward column: the rollouts of a prompt at earlier steps, so the baseline stays unbiased.
            `history_size` prompts are remembered (the least recently seen leave first); `history_decay` weighs a
            step-older reward in the mean. Sequence granularity only.
        granularity: "sequence" (paper) or "prefix": a key of `granularity.GRANULARITIES`, resolved once into
            `token_baseline`. "prefix" learns a per-prefix value of one fixed layer (PCA `prefix_pca_dims`,
            [prompt k, prefix k]) and, once trusted, gives token advantages r - V(x, y_<t) from the `PrefixBatch`es
            the caller hands in.
    """

    def __init__(
        self,
        num_generations: int = 2,
        *,
        alpha: float = 100.0,
        pca_dims: int | Sequence[tuple[int, int, int]] | None = None,
        clip: tuple[float, float] | None = None,
        head: str = "ridge",
        buffer_size: int = 4096,
        domain_buffer_sizes: dict[str, int] | None = None,
        max_domains: int = 64,
        warmup_steps: int = 16,
        partner_reward: bool = True,
        bootstrap: str = "shrunk",
        scale_rewards: str = "none",
        layers: Sequence[int] = (0,),
        layer_index: int = 0,
        layer_select_every: int | None = None,
        layer_switch_margin: float = 0.05,
        layer_folds: int = 5,
        prompt_columns: tuple[int, int] | None = None,
        prompt_pca_dims: int = 0,
        feature_config: dict[str, Any] | None = None,
        broadcast: Callable[[torch.Tensor], torch.Tensor] | None = None,
        describe: Callable[[ValueHead], str] | None = None,
        history: bool = False,
        history_size: int = 65536,
        history_decay: float = 1.0,
        granularity: str = "sequence",
        prefix_pca_dims: tuple[int, int] = (0, 0),
    ):
        check_settings({k: v for k, v in locals().items() if k not in ("self", "broadcast", "describe")})  # the args
        self.num_generations = num_generations
        self.alpha = alpha
        self.pca_dims = pca_dims
        self.clip = clip
        self.head = head
        self.buffer_size = buffer_size
        self.domain_buffer_sizes = domain_buffer_sizes
        self.max_domains = max_domains
        self.warmup_steps = warmup_steps
        self.partner_reward = partner_reward
        self.bootstrap = bootstrap
        self.scale_rewards = scale_rewards
        self.layers = layers
        self.layer_index = layer_index  # the automatic layer choice moves it
        self.layer_select_every = layer_select_every
        self.layer_switch_margin = layer_switch_margin
        self.layer_folds = layer_folds
        self.prompt_columns = prompt_columns
        self.prompt_pca_dims = prompt_pca_dims
        self.feature_config = feature_config
        self.broadcast = broadcast
        self.describe = describe
        self.history = history
        self.history_size = history_size
        self.history_decay = history_decay
        self.granularity = granularity
        self.prefix_pca_dims = prefix_pca_dims
        # What the estimator learns.
        self.probes: dict[str, OnlineLearner] = {}  # per domain: the sequence value
        self.bootstrap_pairs: dict[str, ProbeBuffer] = {}  # per domain: (partner mean, reward) of earlier steps
        self.bootstrap_lines: dict[str, torch.Tensor] = {}  # per domain: [a, w] fitted on those pairs
        self.reward_std = RunningStd()
        self.steps = 0  # observed (training) steps
        self.prompt_history = PromptHistory(history_size, history_decay) if history else None
        self.token_baseline = GRANULARITIES[granularity](
            alpha=alpha, pca_dims=prefix_pca_dims, clip=clip, buffer_size=buffer_size, warmup_steps=warmup_steps
        )

    # ------------------------------------------------------------------------------------------------- structure
    @property
    def layer(self) -> int:
        """The layer id the probes use now (fixed, or the latest automatic choice)."""
        return self.layers[self.layer_index]

    @property
    def extra_columns(self) -> int:
        """Columns appended to the features: the partner's reward, then the prompt's history."""
        return int(self.partner_reward) + len(HISTORY_COLUMNS) * int(self.history)

    @property
    def probe_template(self) -> ValueHead:
        """An unfitted head with this estimator's refit settings: an integer `pca_dims` is the PCA of every feature
        column, the appended columns (partner's reward, history) staying outside."""
        pca = self.pca_dims
        if self.extra_columns and isinstance(pca, int) and pca > 0:
            pca = [(0, -self.extra_columns, pca)]
        return HEADS[self.head](alpha=self.alpha, pca_dims=pca, clip="observed" if self.clip is None else self.clip)

    def capacity(self, domain: str) -> int:
        return (self.domain_buffer_sizes or {}).get(domain, self.buffer_size)

    def new_probe(self, domain: str) -> OnlineLearner:
        """A domain's learner of the sequence value, unfitted, with this estimator's settings."""
        return OnlineLearner(self.probe_template, self.capacity(domain), self.warmup_steps)

    def describe_probe(self, probe: ValueHead) -> str:
        """A probe's refit settings as the caller names them (error messages)."""
        return f"head {probe.name!r} {json.dumps(probe.config())}" if self.describe is None else self.describe(probe)

    def prepare(
        self,
        features: torch.Tensor,
        rewards: torch.Tensor,
        num_generations: int | None = None,
        domains: Sequence[str] | None = None,
        has_completion: torch.Tensor | None = None,
        prompt_ids: torch.Tensor | None = None,
    ) -> PreparedBatch:
        """The batch as `advantages`, `predict` and `observe` use it (arguments as `advantages` takes them)."""
        if rewards.shape != features.shape[:1]:
            raise ValueError(f"Got {rewards.shape[0]} rewards for {features.shape[0]} feature rows.")
        blocks, width = self.pca_dims, features.size(-1)
        if (
            self.extra_columns
            and not isinstance(blocks, int | None)
            and any(k > 0 and int(b) > width for _, b, k in blocks)
        ):
            appended = "the partner-reward column" if self.partner_reward else "the first history column"
            raise ValueError(
                f"pca_dims={blocks} covers column {width}, {appended}: PCA blocks must lie within the {width} "
                "feature columns."
            )
        domain_rows = split_domains(domains, rewards.numel(), rewards.device, self.probes, self.max_domains)
        g = num_generations or self.num_generations
        history = self.history_columns(prompt_ids, rewards.numel(), rewards.device)
        return prepare_batch(
            features,
            rewards,
            has_completion,
            g,
            self.partner_reward,
            domain_rows,
            domains is not None,
            history,
            prompt_ids,
        )

    def history_columns(
        self, prompt_ids: torch.Tensor | None, rows: int, device: torch.device | str | None = None
    ) -> torch.Tensor | None:
        """(rows, 3) history columns of each row's prompt from earlier steps only (None without `history`), looked
        up on `device`, where the table lives (the rewards' device: ids elsewhere would move it back and forth)."""
        if self.prompt_history is None:
            return None
        if prompt_ids is None or prompt_ids.shape != (rows,):
            got = None if prompt_ids is None else tuple(prompt_ids.shape)
            raise ValueError(
                f"history=True (probe_history) looks each row's prompt up by its id: pass prompt_ids, ({rows},) "
                f"int64 ids that are the same for a prompt at every step (e.g. buffer.prompt_group_ids), got {got}."
            )
        return self.prompt_history.columns(prompt_ids.to(device))

    # -------------------------------------------------------------------------------------------------- estimate
    def _probe_values(self, batch: PreparedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(clipped, unclipped) probe value of each usable row from its domain's fitted probe; NaN elsewhere."""
        values = torch.full_like(batch.rewards, torch.nan)
        unclipped = values.clone()
        for name, rows in batch.domain_rows.items():
            online = self.probes.get(name)
            if online is not None and online.probe.is_fitted:
                clipped, raw = online.predict(batch.features, return_unclipped=True)
                values = torch.where(rows & batch.usable, clipped, values)
                unclipped = torch.where(rows & batch.usable, raw, unclipped)
        return values, unclipped

    def predict(
        self,
        features: torch.Tensor,
        rewards: torch.Tensor,
        domains: Sequence[str] | None = None,
        has_completion: torch.Tensor | None = None,
        prompt_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row's probe value g(φ_j) (h(φ_j, r_j) when partner-aware, hence the rewards), from what earlier
        `observe` calls taught: NaN where a row has no usable features or its domain no fitted probe. Changes
        nothing; the baseline of rollout i is the mean of its partners' values (`advantages`)."""
        return self._probe_values(self.prepare(features, rewards, None, domains, has_completion, prompt_ids))[0]

    def _fallback(self, batch: PreparedBatch) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The bootstrap baseline of each row (None: RLOO, `poise_advantages`' own) and the lines it used."""
        if self.bootstrap != "shrunk":
            return None, []
        fallback, lines = batch.targets.clone(), []
        identity = torch.tensor([0.0, 1.0], dtype=torch.float64)
        for name, rows in batch.domain_rows.items():
            line = self.bootstrap_lines.get(name, identity).to(batch.rewards.device)
            fallback = torch.where(rows, (line[0] + line[1] * batch.targets).to(batch.rewards.dtype), fallback)
            lines.append(line)
        return fallback, lines

    def advantages(
        self,
        features: torch.Tensor,
        rewards: torch.Tensor,
        num_generations: int | None = None,
        domains: Sequence[str] | None = None,
        has_completion: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        prefix: PrefixBatch | None = None,
        prompt_ids: torch.Tensor | None = None,
    ) -> AdvantageResult:
        """A_i = r_i - b_i for one global batch of consecutive groups, from earlier steps' probes only. Changes
        nothing: hand the result to `observe` to learn from the batch without preparing it again.

        features: (N, D) or (N, C, D); rewards: (N,), NaN where unscorable; num_generations: G of this batch (the
        constructor's by default); domains: one name per row; has_completion: (N,) False for rows whose completion
        is empty or masked; weights: (N,) positive importance weights of the rows' prompts (sampling.py), which
        multiply the advantages after any scaling. Rows without a finite reward or completion get advantage 0.
        prefix: the per-prefix capture (granularity "prefix"); once trusted, the result holds `token_advantages`.
        prompt_ids: (N,) int64, each row's prompt id, stable across steps (needed with `history`: the rows' inputs
        take their prompt's history from earlier steps)."""
        if weights is not None and (weights.shape != rewards.shape or not (weights.isfinite() & (weights > 0)).all()):
            raise ValueError(f"weights must be ({rewards.numel()},) finite and positive, got {weights.tolist()}.")
        batch = self.prepare(features, rewards, num_generations, domains, has_completion, prompt_ids)
        g, rewards, scorable, usable = batch.num_generations, batch.rewards, batch.scorable, batch.usable
        values, unclipped = self._probe_values(batch)
        trusted = torch.zeros_like(scorable)
        for name, rows in batch.domain_rows.items():
            online = self.probes.get(name)
            if online is not None and online.trusted:
                trusted = trusted | rows
        fallback, lines = self._fallback(batch)
        advantages, baselines, receives = poise_advantages(
            rewards, values, g, usable, batch.has_completion, trusted, fallback
        )
        tokens = self.token_baseline.advantages(prefix, rewards, receives, advantages)
        divisor = self.reward_std.divisor() if self.scale_rewards == "batch" else None  # of earlier steps' rewards
        from_probe = trusted & ~torch.isnan(cross_rollout_baselines(values, g, usable))
        extra = {  # the share of rows whose baseline really is the bootstrap's (untrusted, or no usable partner)
            "bootstrap": (receives & ~from_probe).double().sum() / receives.sum().clamp(min=1),
            "feature_rows_dropped": (batch.has_completion & ~batch.has_features).double().sum(),
            "unscorable_rows": (~scorable).double().sum(),
        }
        if lines:
            mean_line = torch.stack(lines).mean(0)
            extra.update(bootstrap_intercept=mean_line[0], bootstrap_weight=mean_line[1])
        extra.update(self.token_baseline.diagnostics(prefix, rewards, receives, tokens))
        stats, names = step_statistics(batch, baselines, values, unclipped, receives, extra)
        if tokens is not None:  # a row's logged advantage and baseline: its tokens' mean
            advantages, baselines = tokens.mean, torch.where(receives, rewards - tokens.mean, baselines)
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
        result.host_metrics = {"layer": float(self.layer), **self._buffer_sizes(batch)}
        result.host_metrics.update(self.token_baseline.host_metrics())
        if batch.named_domains:
            for name in batch.domain_rows:
                online = self.probes.get(name)
                result.host_metrics[f"domain/{name}/bootstrap"] = float(online is None or not online.trusted)
        return result

    def _buffer_sizes(self, batch: PreparedBatch) -> dict[str, float]:
        """`buffer_size` (rows buffered in every domain) and, per domain of the batch, `domain/<name>/buffer_size`;
        `<granularity>/buffer_size` for a token baseline's learner."""
        sizes = {"buffer_size": float(sum(len(online.buffer) for online in self.probes.values()))}
        for learner in self.token_baseline.learners:
            sizes[f"{self.token_baseline.name}/buffer_size"] = float(len(learner.buffer))
        if batch.named_domains:
            for name in batch.domain_rows:
                online = self.probes.get(name)
                sizes[f"domain/{name}/buffer_size"] = float(0 if online is None else len(online.buffer))
        return sizes

    # ---------------------------------------------------------------------------------------------------- learn
    def observe(
        self,
        features: torch.Tensor | None = None,
        rewards: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
        num_generations: int | None = None,
        domains: Sequence[str] | None = None,
        has_completion: torch.Tensor | None = None,
        *,
        result: AdvantageResult | None = None,
        prefix: PrefixBatch | None = None,
    ) -> dict[str, float]:
        """Learn from a batch after its advantages were taken: buffers, probe refit, bootstrap line, reward std, and
        the layer choice when due. Give the batch as `advantages` took it, or `result`, what `advantages` returned
        for it: its prepared batch is reused and its diagnostics come to the host in this call's one transfer.
        `group_ids` (N,) name each row's prompt for K-fold layer selection (default: each group of G rows is a prompt
        of its own) and, given the batch without `result`, key the prompt history. With `history` the step's rewards
        then enter their prompts' history, for later steps. Returns `probe_fit_seconds`, the buffer sizes after
        learning (`buffer_size`, and per domain with `domains`) and, when the layer was re-chosen, `layer_mae/<layer>`.
        """
        start = time.perf_counter()
        if result is not None:
            batch = result.batch
            if rewards is not None and rewards.shape[:1] != (batch.rows,):
                raise ValueError(f"Got {rewards.shape[0]} rewards, but `result` holds a batch of {batch.rows} rows.")
        elif features is None or rewards is None:
            raise ValueError("observe needs the batch (features and rewards) or `result`, what advantages returned.")
        else:
            batch = self.prepare(features, rewards, num_generations, domains, has_completion, group_ids)
        targets, scorable = batch.targets, batch.scorable
        examples = batch.usable & scorable & torch.isfinite(targets)
        if group_ids is None:  # every group of G consecutive rows is its own prompt, distinct across steps
            rows = torch.arange(targets.numel(), device=targets.device)
            group_ids = (self.steps << 32) + rows // batch.num_generations
        for name, rows in batch.domain_rows.items():
            if name not in self.probes:
                self.probes[name] = self.new_probe(name)
            self.probes[name].add(batch.features, targets, group_ids.to(targets.device), keep=rows & examples)
            if self.bootstrap == "shrunk":
                pairs = self.bootstrap_pairs.setdefault(name, ProbeBuffer(self.capacity(name)))
                pairs.add(targets.unsqueeze(1), batch.rewards, keep=rows & scorable & torch.isfinite(targets))
        prefix = result.prefix if prefix is None and result is not None else prefix
        self.token_baseline.observe(prefix, batch.rewards, scorable & batch.has_completion)
        self.reward_std.update(batch.rewards)
        if self.prompt_history is not None:  # after this step's baselines: its rewards serve later steps only
            self.prompt_history.update(batch.prompt_ids, batch.rewards)
        self.steps += 1
        # The step's one device->host transfer: the buffers' fill levels and the handed result's diagnostics.
        rings = [online.buffer for online in self.probes.values()] + list(self.bootstrap_pairs.values())
        rings += [learner.buffer for learner in self.token_baseline.learners]
        counts = torch.cat([ring.counts().to(targets.device) for ring in rings]).double()
        pending = result is not None and not result.on_host
        payload = result.payload() if pending else torch.zeros(0, dtype=torch.float64)
        host = torch.cat([counts, payload.to(counts.device)]).tolist()
        for i, ring in enumerate(rings):
            ring.set_counts(host[2 * i], host[2 * i + 1])
        if pending:
            result.receive_host(host[2 * len(rings) :])
        metrics: dict[str, float] = {}
        if self.layer_select_every and self.steps % self.layer_select_every == 0:
            learners = list(self.probes.values())
            self.layer_index, chosen = select_layer(
                learners,
                self.layers,
                self.layer_index,
                self.layer_switch_margin,
                self.layer_folds,
                targets.device,
                self.broadcast,
            )
            metrics.update(chosen)
        refitted = False
        for name, online in self.probes.items():
            if online.can_fit and (name in batch.domain_rows or online.layer_index != self.layer_index):
                online.fit(self.layer_index, targets.device)
                refitted = True
                self._agree(online)
        if self.token_baseline.fit(prefix, targets.device):
            refitted = True
            for learner in self.token_baseline.learners:
                self._agree(learner)
        self.bootstrap_lines = self.fit_bootstrap_lines()
        metrics["probe_fit_seconds"] = time.perf_counter() - start if refitted or metrics else 0.0
        return {**metrics, **self._buffer_sizes(batch)}

    def _agree(self, learner: OnlineLearner) -> None:
        """Every process fitted on identical inputs; a broadcast from rank 0 makes them agree to the bit."""
        if self.broadcast is not None:
            learner.probe.map_state(self.broadcast)

    def fit_bootstrap_lines(self) -> dict[str, torch.Tensor]:
        """Each domain's shrunk-bootstrap line [a, w], fitted on its buffered (partner mean, reward) pairs."""
        return {
            name: shrunk_rloo_line(pairs.features[:, 0], pairs.targets)
            for name, pairs in self.bootstrap_pairs.items()
            if len(pairs)
        }

    # ------------------------------------------------------------------------------------------- prompt values
    @property
    def trusted(self) -> bool:
        """Whether any domain's probe is trusted (past its bootstrap, or warm-started)."""
        return any(online.trusted for online in self.probes.values())

    def prompt_values(
        self, prompt_features: torch.Tensor, prompt_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Predicted success value of each candidate prompt from its (M, width) prompt-block features (current
        layer) and, with `history`, its prompt's history (by its (M,) `prompt_ids`; only steps already observed, so
        before this step's generation), by a prompt-only probe on the buffers (prompt_value.py); None until a probe
        is trusted and at least two groups are buffered. What to draw from these values is `sampling.py`'s business."""
        if self.prompt_columns is None or not self.trusted:
            return None
        start, stop = self.prompt_columns
        pca = [(0, stop - start, self.prompt_pca_dims)] if self.prompt_pca_dims else None  # the history stays out
        head = HEADS[self.head](alpha=self.alpha, pca_dims=pca, clip="observed")
        learners = list(self.probes.values())
        history = self.history_columns(prompt_ids, prompt_features.size(0), prompt_features.device)
        if history is not None:
            prompt_features = torch.cat([prompt_features, history.to(prompt_features.dtype)], dim=1)
        return fit_prompt_values(
            learners,
            self.prompt_columns,
            self.layer_index,
            head,
            2 * self.num_generations,
            prompt_features,
            0 if history is None else history.size(1),
        )

    def target_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lowest, highest) buffered target over every domain: the observed reward range that `prompt_values` are
        read on (0-d tensors, left on the buffers' device)."""
        return target_range(list(self.probes.values()))

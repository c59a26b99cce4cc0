"""`POISETrainer`: `GRPOTrainer` with POISE's cross-rollout internal-state baseline. The only TRL-aware module."""

import hashlib
import inspect
import json
import math
import os
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import trl
from accelerate.utils import broadcast, gather_object
from datasets import IterableDataset
from packaging.version import Version
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import RepeatSampler, get_config_model_id

from .baselines import (
    RunningStd,
    append_reward_column,
    baseline_diagnostics,
    leave_one_out_targets,
    poise_advantages,
    shrunk_rloo_fit,
)
from .config import POISEConfig
from .features import (
    HIDDEN_BLOCKS,
    assemble_features,
    block_slices,
    capture_layer,
    feature_spans,
    find_decoder_layers,
    layer_candidates,
    pca_blocks,
    resolve_layer_index,
)
from .probe import OnlineProbe, ProbeBuffer, ValueProbe, choose_layer, load_probe_set, save_probe_set

TESTED_TRL = ("1.16.0", "1.17.0")  # [low, high): the GRPOTrainer internals this subclass was tested against
PROBE_FILE = "poise_probe.safetensors"
BOOTSTRAP_FILE = "poise_bootstrap.safetensors"  # the shrunk bootstrap's (partner mean, reward) pairs per domain
DEFAULT_DOMAIN = "default"  # the one probe's name when there is no `probe_domain_column`
# Output keys of `_generate_and_score_completions` that TRL's own log-prob pass takes as model inputs besides the
# token ids (pixel_values, image_grid_thw, num_images, token_type_ids, ...): POISE's feature pass forwards the same.
_PASS_ARGUMENTS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy")
FORWARD_INPUT_KEYS = tuple(
    name
    for name in inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    if name not in (*_PASS_ARGUMENTS, "compute_aux_loss")
)

if not Version(TESTED_TRL[0]) <= Version(trl.__version__) < Version(TESTED_TRL[1]) and not os.environ.get(
    "POISE_ALLOW_UNTESTED_TRL"
):
    raise ImportError(
        f"poise-trl is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]} but trl {trl.__version__} is installed. "
        f"POISETrainer hooks GRPOTrainer internals that change between releases: install "
        f"'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}', or set POISE_ALLOW_UNTESTED_TRL=1 at your own risk."
    )


def prompt_group_ids(prompts: list) -> torch.Tensor:
    """A stable 63-bit id per prompt (the same on every rank and every run), so K-fold splits can group by prompt.

    Values JSON cannot write (images) count by type only: two prompts that differ only there share a group, which
    errs on the safe side for cross-validation, whereas an object's address would split one prompt's rollouts."""
    ids = []
    for prompt in prompts:
        text = json.dumps(prompt, sort_keys=True, default=lambda value: type(value).__name__).encode()
        ids.append(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big", signed=True))
    return torch.tensor(ids, dtype=torch.long)


class ResumableSampler(RepeatSampler):
    """TRL's `RepeatSampler` as TRL built it, made to resume where an uninterrupted run would be.

    - TRL's sampler draws epoch e's permutation as the (e+1)-th from one generator seeded once, so the fresh sampler
      of a resumed run would shuffle epoch e like epoch 0: a resume in any epoch after the first would train on
      other prompts. Each pass rewinds the generator to epoch e first (transformers' `set_epoch` does not reach the
      sampler on every path).
    - A finished run (global step >= max steps) yields nothing: transformers would otherwise run one extra step when
      resumed from its final checkpoint in mid-epoch."""

    def __init__(self, sampler: RepeatSampler, state: Callable[[], TrainerState]):
        vars(self).update(vars(sampler))  # everything TRL set, unchanged
        self.state = state

    def __iter__(self) -> Iterator[int]:
        state = self.state()
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            return iter(())
        if self.shuffle and self.seed is not None:
            self.generator.manual_seed(self.seed)
            for _ in range(int(state.epoch)):
                torch.randperm(self.num_samples, generator=self.generator)
        return super().__iter__()


class POISETrainer(GRPOTrainer):
    """
    Trainer for POISE (Policy Optimization with Internal State Value Estimation, arXiv 2605.07579).

    What changes w.r.t. [`~trl.GRPOTrainer`]: only the advantage. GRPO's group-mean baseline is replaced by
    `b_i = mean_{j != i} g_f(φ_j)`, where φ_j are rollout j's pooled hidden states (one decoder layer, last n prompt
    and reasoning tokens) plus entropy statistics, captured during the teacher-forced log-prob pass, and g_f is an
    online ridge probe fitted on earlier steps only. `A_i = r_i - b_i`, unscaled. Until `probe_warmup_steps` steps
    have been seen the baseline is the RLOO mean of the other rollouts' rewards. Generation, rewards, the clipped
    loss, vLLM, PEFT, DeepSpeed/FSDP and logging are inherited unchanged.

    Overrides: `_generate_and_score_completions` (replace the advantages), `_get_per_token_logps_and_entropies`
    (hook the layer during TRL's own old-log-prob pass when there is one, so no forward pass is added),
    `_calculate_rewards` (keep the gathered rewards), `_generate` (keep the tool/env mask, so features use only the
    tokens the policy generated), and the checkpoint pair `_save_checkpoint` / `_load_optimizer_and_scheduler` (probe,
    buffer and reward std travel with every checkpoint).

    Probe state lives in `self.probes`, a dict domain -> [`OnlineProbe`] (probe, buffer, step counter): one entry,
    `"default"`, unless `probe_domain_column` is set. With `probe_layer="auto"` every candidate layer is hooked in the
    same pass, buffered rows hold all of them, and the layer in use (`self.probe_layer`) is re-chosen from the buffer
    every `probe_layer_select_every` steps, after that step's baselines were computed.

    Beyond the paper (README "Beyond the paper"): `probe_partner_reward` appends each rollout's own reward to its probe
    input, h(φ_j, r_j), still used only as its partners' baseline; `probe_bootstrap="shrunk"` replaces the RLOO
    bootstrap by a + w * RLOO fitted on earlier steps. `prompt_selection="value"` chooses the prompts to train on. Its
    hook is the least invasive one TRL allows: the sampler keeps TRL's `RepeatSampler` and only draws
    `prompt_selection_oversample` times more prompts per generation batch (`_get_train_sampler`,
    `get_train_dataloader`), each process receives its own shard of whole candidate groups as usual, and
    `_generate_and_score_completions` keeps the best whole groups of its shard before calling the parent, so
    generation (vLLM included), rewards, shuffling and the batch sizes TRL expects downstream are unchanged. The
    prediction costs one no-grad forward of the training model over the candidates' prompt tokens.
    """

    _tag_names = ["trl", "poise"]
    _name = "POISE"
    _paper = {
        "title": "Your Language Model is Its Own Critic: Reinforcement Learning with Value Estimation from Actor's "
        "Internal States",
        "id": "2605.07579",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{choi2026poise,
                title        = {{Your Language Model is Its Own Critic: Reinforcement Learning with Value
                                 Estimation from Actor's Internal States}},
                author       = {Yunho Choi and Jongwon Lim and Woojin Ahn and Minjae Oh and Jeonghoon Shim
                                and Yohan Jo},
                year         = 2026,
                eprint       = {arXiv:2605.07579},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args: POISEConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = POISEConfig(f"{model_name.split('/')[-1]}-POISE")
        if not isinstance(args, POISEConfig):
            raise TypeError(
                f"POISETrainer needs a POISEConfig, got {type(args).__name__}: build the config with "
                "`POISEConfig(**your_grpo_config.to_dict())` or pass the same arguments to POISEConfig."
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)

        base = self.accelerator.unwrap_model(self.model)
        num_layers = len(find_decoder_layers(base))
        default_layer = resolve_layer_index(None, num_layers)
        self.auto_layer = args.probe_layer == "auto"
        # Layers hooked in every captured pass; buffered rows hold one feature vector per entry, in this order.
        self.probe_layers = (
            layer_candidates(args.probe_layer_candidates, num_layers)
            if self.auto_layer
            else [resolve_layer_index(args.probe_layer, num_layers)]
        )
        # Index (into probe_layers) of the layer in use: auto mode starts at the candidate nearest the fixed default.
        self._layer_index = min(range(len(self.probe_layers)), key=lambda i: abs(self.probe_layers[i] - default_layer))
        self.hidden_size = base.config.get_text_config().hidden_size
        self.marker_ids: list[int] | None = None
        if args.reasoning_end_marker is not None:
            self.marker_ids = self._tokenizer(args.reasoning_end_marker, add_special_tokens=False)["input_ids"]
            if not self.marker_ids:
                raise ValueError(f"reasoning_end_marker={args.reasoning_end_marker!r} tokenizes to no tokens.")
        self._probe_pca = pca_blocks(
            args.probe_features, self.hidden_size, args.probe_pca_dims, cap_at_width=args.pca_dims_from_preset
        )
        self.probes: dict[str, OnlineProbe] = {}
        if args.probe_domain_column is None:
            self.probes[DEFAULT_DOMAIN] = self._new_online_probe(DEFAULT_DOMAIN)
        self.probe_steps = 0  # training generation steps whose examples have entered the buffers
        self.reward_std = RunningStd()  # rewards of earlier training steps: the `scale_rewards="batch"` divisor
        if args.probe_init_path is not None:
            self._load_probe(args.probe_init_path, warm_start=True)
        self.feature_passes = 0  # teacher-forced passes POISE ran itself (0 when TRL's own pass is reused)
        self._capture_armed = False
        self._captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self._gathered_rewards: torch.Tensor | None = None
        self._tool_mask: list | None = None  # this batch's tool/env mask from `_generate` (1 = the policy wrote it)
        self.bootstrap_pairs: dict[str, ProbeBuffer] = {}  # per domain: (partner mean, reward) of earlier steps
        self._init_prompt_selection()

    # ------------------------------------------------------------------------------------------------------ probes
    @property
    def probe_layer(self) -> int:
        """The decoder layer whose features the probes use now (fixed, or the latest automatic choice)."""
        return self.probe_layers[self._layer_index]

    def _new_online_probe(self, domain: str) -> OnlineProbe:
        clip = tuple(self.args.probe_clip_range) if self.args.probe_clip_range is not None else "observed"
        capacity = (self.args.probe_domain_buffer_sizes or {}).get(domain, self.args.probe_buffer_size)
        probe = ValueProbe(alpha=self.args.probe_alpha, pca_dims=self._probe_pca, clip=clip)
        return OnlineProbe(probe, capacity, self.args.probe_warmup_steps)

    def _single_probe(self) -> OnlineProbe:
        if self.args.probe_domain_column is not None:
            raise AttributeError(
                f"This run keeps one probe per value of {self.args.probe_domain_column!r}: use "
                "`trainer.probes[domain].probe`, `.buffer` and `.steps`."
            )
        return self.probes[DEFAULT_DOMAIN]

    @property
    def value_probe(self) -> ValueProbe:
        """The probe of a single-domain run."""
        return self._single_probe().probe

    @property
    def probe_buffer(self) -> ProbeBuffer:
        """The buffer of a single-domain run: features are (N, len(probe_layers), D)."""
        return self._single_probe().buffer

    # ----------------------------------------------------------------------------------------------------- capture
    def _trl_runs_old_logps_pass(self) -> bool:
        """Whether GRPOTrainer computes `old_per_token_logps` while scoring (then POISE captures inside that pass)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        """While armed, hook the probe layer during this no-grad pass of the policy and keep pooled features."""
        if not (self._capture_armed and model is self.model and not torch.is_grad_enabled()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )
        self._capture_armed = False
        spans = self._spans(
            attention_mask[:, :-logits_to_keep], input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:]
        )
        layers = find_decoder_layers(self.accelerator.unwrap_model(self.model))
        kwargs["compute_entropy"] = True
        with ExitStack() as hooks:  # one pass, one pooling hook per candidate layer
            captures = [hooks.enter_context(capture_layer(layers[i], spans)) for i in self.probe_layers]
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )
        blocks = self.args.probe_features
        features = torch.stack([assemble_features(blocks, c.pooled(), entropies, spans) for c in captures], dim=1)
        self._captured = (features, spans)  # (B, len(probe_layers), D)
        return logps, entropies, aux

    def _spans(self, prompt_mask, completion_ids, completion_mask):
        generated = None
        if self._tool_mask is not None:  # right-pad TRL's per-row lists to the completion width, as TRL does
            generated = torch.ones_like(completion_mask)
            for row, mask in enumerate(self._tool_mask):
                mask = torch.as_tensor(mask, dtype=generated.dtype)[: generated.size(1)]
                generated[row, : mask.numel()] = mask
        return feature_spans(
            prompt_mask, completion_ids, completion_mask, self.args.probe_pool_tokens, self.marker_ids, generated
        )

    def _generate(self, prompts):
        """Keep the tool/env mask (tool results and `rollout_func`'s `env_mask` are 0), so that features use only the
        tokens the policy generated; the capture pass runs before TRL puts it in the output dict."""
        generated = super()._generate(prompts)
        self._tool_mask = generated[2]
        return generated

    def _feature_pass(self, output: dict[str, Any], mode: str) -> None:
        """One no-grad teacher-forced pass with entropies, outside gradient checkpointing, when TRL ran none. It takes
        the multimodal inputs TRL's own log-prob pass takes (pixel_values, image_grid_thw, ...)."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        forward_inputs = {key: output[key] for key in FORWARD_INPUT_KEYS if key in output}
        self._capture_armed = True
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                output["completion_ids"].size(1),
                batch_size=batch_size,
                **forward_inputs,
            )
        self.feature_passes += 1

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards = rewards_per_func
        return rewards_per_func

    # -------------------------------------------------------------------------------------------------- advantages
    def _generate_and_score_completions(self, inputs):
        inputs = self._select_prompts(inputs)
        mode = "train" if self.model.training else "eval"
        self._captured, self._capture_armed, self._tool_mask = None, self._trl_runs_old_logps_pass(), None
        output = super()._generate_and_score_completions(inputs)
        self._capture_armed = False
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        if num_generations < 2:  # eval with a single generation: nothing to pair, keep TRL's advantages
            rows = len(inputs) * self.accelerator.num_processes
            self._logs["extra"]["baseline"].extend([float("nan")] * rows)  # keep the column in step with its rows
            return output
        if self._captured is None:
            self._feature_pass(output, mode)
        local_features, spans = self._captured
        self._captured = None

        device = self.accelerator.device
        has_completion = self.accelerator.gather(spans.completion_mask.any(1))
        features = self.accelerator.gather(local_features.to(device))  # (N, len(probe_layers), D)
        feature_ok = has_completion & torch.isfinite(features).flatten(1).all(1)
        rewards_per_func = self._gathered_rewards
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(1)
        rewards[torch.isnan(rewards_per_func).all(1) | ~torch.isfinite(rewards)] = torch.nan
        scorable = torch.isfinite(rewards)
        features, feature_ok = self._partner_reward_features(features, rewards, feature_ok)
        # Environment-routed datasets may have no `prompt` column; the row then names the prompt.
        groups = self.accelerator.gather(prompt_group_ids([x.get("prompt", x) for x in inputs]).to(device))
        domain_rows = self._domain_rows(inputs, num_generations, device)

        # Each row is predicted by its domain's probe as fitted on earlier steps; a domain still in its bootstrap (or
        # never trained) gives its rows the RLOO baseline.
        values = torch.full_like(rewards, torch.nan)
        unclipped = values.clone()
        trusted = torch.zeros_like(scorable)
        trusted_domains = {}
        for name, rows in domain_rows.items():
            online = self.probes.get(name)
            trusted_domains[name] = online is not None and online.trusted
            trusted[rows] = trusted_domains[name]
            predict = rows & feature_ok
            if online is not None and online.probe.is_fitted and predict.any():
                values[predict], unclipped[predict] = online.predict(features[predict], return_unclipped=True)
        fallback, bootstrap_metrics = self._shrunk_bootstrap(rewards, num_generations, scorable, domain_rows)
        advantages, baselines, receives = poise_advantages(
            rewards, values, num_generations, feature_ok, has_completion, trusted, fallback
        )
        if self.args.scale_rewards == "batch":  # the std of earlier steps' rewards: independent of this batch
            advantages = advantages / self.reward_std.divisor()

        process_slice = slice(
            self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs)
        )
        output["advantages"] = advantages[process_slice]
        logged = self._logs["advantages"]  # TRL logged its group-mean advantages for this batch: replace them
        for _ in range(min(advantages.numel(), len(logged))):
            logged.pop()
        logged.extend(advantages.tolist())
        self._logs["extra"]["baseline"].extend(torch.where(receives, baselines, torch.nan).tolist())

        metrics = baseline_diagnostics(rewards, baselines, values, num_generations, receives, unclipped)
        metrics.update(
            bootstrap=(~trusted).float().mean().item(),  # fraction of rows on the RLOO baseline
            feature_rows_dropped=float((has_completion & ~feature_ok).sum()),
            layer=float(self.probe_layer),  # the layer this step's probe baselines came from
            **bootstrap_metrics,
        )
        if mode == "train":
            self.reward_std.update(rewards)
            targets = leave_one_out_targets(rewards, num_generations, scorable)  # the partners' mean reward
            metrics.update(self._update_probes(features, targets, feature_ok & scorable, groups, domain_rows))
            self._update_bootstrap(rewards, num_generations, scorable, domain_rows)
            metrics.update(self._selection_metrics(rewards, num_generations))
        metrics["buffer_size"] = float(sum(len(online.buffer) for online in self.probes.values()))
        if self.args.probe_domain_column is not None:
            for name, rows in domain_rows.items():
                domain_metrics = baseline_diagnostics(
                    rewards[rows], baselines[rows], values[rows], num_generations, receives[rows], unclipped[rows]
                )
                domain_metrics["bootstrap"] = float(not trusted_domains[name])
                domain_metrics["buffer_size"] = float(len(self.probes[name].buffer)) if name in self.probes else 0.0
                metrics.update({f"domain/{name}/{key}": value for key, value in domain_metrics.items()})
        for name, value in metrics.items():
            self._metrics[mode][f"poise/{name}"].append(value)
        return output

    def _domain_rows(self, inputs: list[dict], num_generations: int, device) -> dict[str, torch.Tensor]:
        """Row mask of the global batch for each domain present, in order of appearance (identical on every rank)."""
        column = self.args.probe_domain_column
        if column is None:
            total = len(inputs) * self.accelerator.num_processes
            return {DEFAULT_DOMAIN: torch.ones(total, dtype=torch.bool, device=device)}
        if any(column not in x for x in inputs):
            raise ValueError(
                f"probe_domain_column={column!r}, but the batch has no such column (columns: {sorted(inputs[0])}). "
                "Add it to the dataset, or set probe_domain_column=None."
            )
        domains = [str(name) for name in gather_object([x[column] for x in inputs])]
        for start in range(0, len(domains), num_generations):
            group = domains[start : start + num_generations]
            if len(set(group)) != 1:
                raise ValueError(f"One prompt's rollouts carry different {column!r} values: {group}.")
        return {
            name: torch.tensor([d == name for d in domains], dtype=torch.bool, device=device)
            for name in dict.fromkeys(domains)
        }

    def _update_probes(
        self,
        features: torch.Tensor,
        targets: torch.Tensor,
        usable: torch.Tensor,
        groups: torch.Tensor,
        domain_rows: dict[str, torch.Tensor],
    ) -> dict[str, float]:
        """Append this step's leave-one-out examples to their domains' buffers, re-choose the layer when due (auto),
        refit, and make every rank agree. Everything here only affects the baselines of later steps."""
        start = time.perf_counter()
        usable = usable & torch.isfinite(targets)
        for name, rows in domain_rows.items():
            if name not in self.probes:
                self.probes[name] = self._new_online_probe(name)
            keep = rows & usable
            self.probes[name].add(features[keep], targets[keep], groups[keep])
        self.probe_steps += 1
        metrics = {}
        if self.auto_layer and self.probe_steps % self.args.probe_layer_select_every == 0:
            metrics.update(self._select_layer())
        device = self.accelerator.device
        refitted = False
        for name, online in self.probes.items():
            if online.can_fit and (name in domain_rows or online.layer != self._layer_index):
                online.fit(self._layer_index, device)
                refitted = True
                if self.accelerator.num_processes > 1:  # identical inputs, but broadcast so ranks agree to the bit
                    for key, tensor in sorted(online.probe.state_dict().items()):
                        online.probe._state[key] = broadcast(tensor.to(device), from_process=0)
        metrics["probe_fit_seconds"] = time.perf_counter() - start if refitted or metrics else 0.0
        return metrics

    def _select_layer(self) -> dict[str, float]:
        """Choose the candidate layer with the lowest prompt-grouped K-fold MAE over every domain's buffer, with
        hysteresis: switch only when the best beats the current layer by `probe_layer_switch_margin` (relative)."""
        device = self.accelerator.device
        errors = [online.layer_errors(self.args.probe_layer_folds, device) for online in self.probes.values()]
        errors = [e for e in errors if e is not None]
        if not errors:  # too few prompts buffered to cross-validate yet
            return {}
        mae = torch.cat(errors, dim=1).mean(1)
        choice = choose_layer(mae, self._layer_index, self.args.probe_layer_switch_margin)
        if self.accelerator.num_processes > 1:  # every rank must hook and fit the same layer
            choice = int(broadcast(torch.tensor([choice], device=device), from_process=0).item())
        self._layer_index = choice
        return {f"layer_mae/{layer}": value for layer, value in zip(self.probe_layers, mae.tolist(), strict=True)}

    # -------------------------------------------------------------------------------------------------- probe files
    def _probe_metadata(self) -> dict[str, Any]:
        """What must match for a saved probe to be reused: the feature space and where the run stands."""
        base = self.accelerator.unwrap_model(self.model)
        return {
            "feature_config": {
                "probe_layer": "auto" if self.auto_layer else self.probe_layers[0],
                "probe_layer_candidates": list(self.probe_layers),
                "probe_pool_tokens": self.args.probe_pool_tokens,
                "probe_features": list(self.args.probe_features),
                "reasoning_end_marker": self.args.reasoning_end_marker,
                "hidden_size": self.hidden_size,
                "probe_partner_reward": self.args.probe_partner_reward,
            },
            "probe_domain_column": self.args.probe_domain_column,
            "model_name": get_config_model_id(base.config),
            "probe_steps": self.probe_steps,
            "layer": self.probe_layer,
            "reward_std": self.reward_std.state_dict(),
        }

    def _probe_settings(self, probe: ValueProbe) -> str:
        """A probe's refit settings in POISEConfig's terms, for error messages."""
        pca = probe.pca_dims
        if isinstance(pca, list | tuple):
            slices = block_slices(self.args.probe_features, self.hidden_size)
            ks = {int(start): int(k) for start, _, k in pca}
            pca = [ks.get(slices[name][0], 0) if name in slices else 0 for name in HIDDEN_BLOCKS]
        clip = None if probe.clip == "observed" else list(probe.clip) if probe.clip is not None else "no clipping"
        return f"probe_alpha={probe.alpha}, probe_pca_dims={pca}, probe_clip_range={clip}"

    def save_probe(self, path: str | os.PathLike, include_buffer: bool = True) -> None:
        """Write every domain's probe (and buffer) to one safetensors file + JSON: no pickle, so a downloaded file
        cannot run code. `probe_init_path` warm-starts a new run from it."""
        save_probe_set(path, self.probes, self._probe_metadata(), include_buffer=include_buffer)

    def _load_probe(self, path: str | os.PathLike, warm_start: bool = False) -> None:
        """Restore every domain from a probe file: exactly on resume; as a fresh, trusted start with `warm_start`."""
        states, info = load_probe_set(path, single_name=DEFAULT_DOMAIN)
        expected = self._probe_metadata()
        features = info.get("feature_config") or {}
        if "probe_layer_candidates" not in features and isinstance(features.get("probe_layer"), int):
            features["probe_layer_candidates"] = [features["probe_layer"]]  # one fixed-layer probe (save_probe_file)
            info.setdefault("layer", features["probe_layer"])
        if features:
            features.setdefault("probe_partner_reward", False)  # files written before the partner-aware probe
        if info.get("feature_config") != expected["feature_config"]:
            raise ValueError(
                f"The probe in {path} was fitted on features {info.get('feature_config')}, but this run extracts "
                f"{expected['feature_config']}. Resume with the same probe_layer/probe_layer_candidates/"
                "probe_pool_tokens/probe_features/reasoning_end_marker/probe_partner_reward and model, or start a "
                "fresh run."
            )
        if info.get("probe_domain_column") != self.args.probe_domain_column:
            raise ValueError(
                f"The probes in {path} are per {info.get('probe_domain_column')!r} (domains {list(states)}), but this "
                f"run sets probe_domain_column={self.args.probe_domain_column!r}."
            )
        self.probes = {}
        for name, (tensors, domain_info) in states.items():
            online = self._new_online_probe(name)  # this run's settings and buffer capacity (the newest rows survive)
            saved = ValueProbe.from_config(domain_info["probe"])
            if not warm_start and saved.config() != online.probe.config():
                raise ValueError(
                    f"The probe in {path} (domain {name!r}) refits with {self._probe_settings(saved)}, but this run "
                    f"sets {self._probe_settings(online.probe)}. Resume with the settings (or probe_preset) the run "
                    "was started with; to change them, start a new run with probe_init_path pointing at this file."
                )
            online.load_state(tensors, domain_info)
            if warm_start:  # trusted at once; without a buffer, keep the loaded fit until warmup steps of new rows
                online.steps, online.warm_started = 0, True
                online.refit_from_step = self.args.probe_warmup_steps if len(online.buffer) == 0 else 0
            self.probes[name] = online
        self._layer_index = self.probe_layers.index(int(info["layer"]))
        self.probe_steps = 0 if warm_start else int(info["probe_steps"])
        if not warm_start and "reward_std" in info:
            self.reward_std.load_state_dict(info["reward_std"])

    def _save_checkpoint(self, model, trial):
        # The probe is written first: the parent pushes the checkpoint folder to the Hub before it returns.
        if self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            self.save_probe(folder / PROBE_FILE)
            self._save_bootstrap(folder / BOOTSTRAP_FILE)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and (Path(checkpoint) / PROBE_FILE).exists():
            self._load_probe(Path(checkpoint) / PROBE_FILE)
        if checkpoint is not None and (Path(checkpoint) / BOOTSTRAP_FILE).exists():
            self._load_bootstrap(Path(checkpoint) / BOOTSTRAP_FILE)

    # ----------------------------------------------------------------------------------------- beyond the paper
    def _partner_reward_features(
        self, features: torch.Tensor, rewards: torch.Tensor, feature_ok: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With `probe_partner_reward`: [φ_j, r_j] and rows usable only with a finite reward as well (a row without
        one falls back like a row without features: its partners get the bootstrap baseline)."""
        if not self.args.probe_partner_reward:
            return features, feature_ok
        usable = feature_ok & torch.isfinite(rewards)
        return append_reward_column(features, torch.where(usable, rewards, torch.zeros_like(rewards))), usable

    def _bootstrap_line(self, domain: str) -> tuple[float, float]:
        """(a, w) of the shrunk bootstrap from earlier steps' pairs; (0, 1), plain RLOO, before any history."""
        pairs = self.bootstrap_pairs.get(domain)
        if pairs is None or len(pairs) == 0:
            return 0.0, 1.0
        return shrunk_rloo_fit(pairs.features[:, 0], pairs.targets)

    def _shrunk_bootstrap(
        self, rewards: torch.Tensor, num_generations: int, scorable: torch.Tensor, domain_rows: dict
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The fallback baseline a + w * RLOO per domain (None with probe_bootstrap='rloo'), and its logged weight."""
        if self.args.probe_bootstrap != "shrunk":
            return None, {}
        rloo = leave_one_out_targets(rewards, num_generations, scorable)
        fallback, lines = rloo.clone(), []
        for name, rows in domain_rows.items():
            intercept, weight = self._bootstrap_line(name)
            fallback[rows] = intercept + weight * rloo[rows]
            lines.append((intercept, weight))
        return fallback, {
            "bootstrap_intercept": sum(a for a, _ in lines) / len(lines),
            "bootstrap_weight": sum(w for _, w in lines) / len(lines),
        }

    def _update_bootstrap(
        self, rewards: torch.Tensor, num_generations: int, scorable: torch.Tensor, domain_rows: dict
    ) -> None:
        """Buffer this step's (RLOO baseline, reward) pairs; they only shape the shrunk bootstrap of later steps."""
        if self.args.probe_bootstrap != "shrunk":
            return
        rloo = leave_one_out_targets(rewards, num_generations, scorable)
        usable = scorable & torch.isfinite(rloo)
        for name, rows in domain_rows.items():
            if name not in self.bootstrap_pairs:
                capacity = (self.args.probe_domain_buffer_sizes or {}).get(name, self.args.probe_buffer_size)
                self.bootstrap_pairs[name] = ProbeBuffer(capacity)
            keep = rows & usable
            self.bootstrap_pairs[name].add(rloo[keep].unsqueeze(1), rewards[keep])

    def _save_bootstrap(self, path: Path) -> None:
        """The shrunk bootstrap's pairs, so that a resumed run continues with the same (a, w)."""
        names = [name for name, pairs in self.bootstrap_pairs.items() if len(pairs)]
        tensors = {}
        for i, name in enumerate(names):
            tensors.update({f"{i}.{k}": v for k, v in self.bootstrap_pairs[name].state_dict().items()})
        save_file(tensors, str(path), metadata={"domains": json.dumps(names)})

    def _load_bootstrap(self, path: Path) -> None:
        with safe_open(str(path), framework="pt") as f:
            names = json.loads(f.metadata()["domains"])
        tensors = load_file(str(path))
        self.bootstrap_pairs = {}
        for i, name in enumerate(names):
            capacity = (self.args.probe_domain_buffer_sizes or {}).get(name, self.args.probe_buffer_size)
            self.bootstrap_pairs[name] = ProbeBuffer(capacity)
            self.bootstrap_pairs[name].add(tensors[f"{i}.features"], tensors[f"{i}.targets"])

    # ----------------------------------------------------------------------------------------- prompt selection
    def _init_prompt_selection(self) -> None:
        self._selection: dict[str, float] = {}
        if self.args.prompt_selection is None:
            return
        if self.environment_factories is not None or self._is_vlm:
            raise ValueError(
                "prompt_selection='value' predicts from a text-only prefill of the prompts, which environments and "
                "vision-language models change: set prompt_selection=None for this run."
            )
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "prompt_selection='value' oversamples through TRL's RepeatSampler, which needs a map-style dataset: "
                "load the dataset without streaming, or set prompt_selection=None."
            )
        generator = torch.Generator()
        generator.manual_seed(self.args.seed + self.accelerator.process_index)
        self._selection_generator = generator  # the random choice before the prompt probe is trusted

    @property
    def selection_candidates(self) -> int:
        """Candidate prompts per process and generation batch: ceil(oversample x kept), raised until their rows fill
        `steps_per_generation` whole per-step batches, as TRL's dataloader needs."""
        rows = self.args.per_device_train_batch_size * self.args.steps_per_generation
        candidates = math.ceil(self.args.prompt_selection_oversample * rows / self.num_generations - 1e-9)
        while (candidates * self.num_generations) % self.args.steps_per_generation:
            candidates += 1
        return candidates

    def get_train_dataloader(self):
        """TRL's dataloader, with per-process batches of `selection_candidates` whole groups under prompt_selection."""
        if self.args.prompt_selection is None:
            return super().get_train_dataloader()
        batch_size = self._train_batch_size
        self._train_batch_size = self.selection_candidates * self.num_generations // self.args.steps_per_generation
        try:
            return super().get_train_dataloader()
        finally:
            self._train_batch_size = batch_size

    def _get_train_sampler(self, dataset=None):
        """TRL's `RepeatSampler`, drawing `selection_candidates` prompts per process under prompt_selection, and
        resuming exactly where an uninterrupted run would be (`ResumableSampler`)."""
        sampler = super()._get_train_sampler(dataset)
        if self.args.prompt_selection is not None:
            sampler.batch_size = self.selection_candidates * self.accelerator.num_processes
        return ResumableSampler(sampler, lambda: self.state)

    def _prompt_probe(self) -> ValueProbe | None:
        """The prompt-only probe: the buffer's prompt block (current layer) against its targets, whose mean per prompt
        is the prompt's success rate. None before the value probe's bootstrap ends or with too few rows."""
        buffers = [online.buffer for online in self.probes.values() if len(online.buffer)]
        if self.probe_steps < self.args.probe_warmup_steps or sum(map(len, buffers)) < 2 * self.num_generations:
            return None
        start, stop = block_slices(self.args.probe_features, self.hidden_size)["prompt"]
        device = self.accelerator.device
        x = torch.cat([b.features[:, self._layer_index, start:stop] for b in buffers]).to(device)
        y = torch.cat([b.targets for b in buffers]).to(device)
        pca = [(0, stop - start, self.args.probe_pca_dims[0])] if self.args.probe_pca_dims[0] else None
        return ValueProbe(alpha=self.args.probe_alpha, pca_dims=pca, clip="observed").fit(x, y)

    def _prefill_prompts(self, prompts: list) -> tuple[torch.Tensor, int]:
        """Pooled last-n prompt states at the probe layer from one no-grad pass over the prompt tokens only, and the
        number of prompt tokens it processed."""
        prompt_ids, _, _ = self._tokenize_prompts(prompts)
        width = max(map(len, prompt_ids))
        pad = self._tokenizer.pad_token_id
        device = self.accelerator.device
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        spans = feature_spans(mask, ids[:, :0], mask[:, :0], self.args.probe_pool_tokens, None)
        layer = find_decoder_layers(self.accelerator.unwrap_model(self.model))[self.probe_layer]
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            capture_layer(layer, spans) as capture,
        ):
            self._get_per_token_logps_and_entropies(
                self.model, ids, mask, 1, batch_size=self.args.per_device_train_batch_size
            )
        return capture.pooled()[:, 0], int(mask.sum())

    def _select_prompts(self, inputs: list[dict]) -> list[dict]:
        """Keep the `per_device_train_batch_size x steps_per_generation / G` whole groups of this process's candidates
        with the highest predicted p(1 - p) (uniformly random ones before the prompt probe is trusted)."""
        if self.args.prompt_selection is None or not self.model.training:
            return inputs
        size = self.num_generations
        keep = self.args.per_device_train_batch_size * self.args.steps_per_generation // size
        groups = [inputs[i : i + size] for i in range(0, len(inputs), size)]
        keys = [[json.dumps(x["prompt"], sort_keys=True, default=str) for x in group] for group in groups]
        if len(inputs) % size or any(len(set(k)) != 1 for k in keys) or len(groups) < keep:
            raise RuntimeError(
                f"prompt_selection got {len(inputs)} rows that are not {keep} or more whole groups of {size} "
                "identical prompts: the sampler no longer yields TRL's layout."
            )
        probe = self._prompt_probe()
        spread, tokens = torch.full((len(groups),), math.nan), 0
        if probe is None:
            chosen = torch.randperm(len(groups), generator=self._selection_generator)[:keep]
        else:
            states, tokens = self._prefill_prompts([group[0]["prompt"] for group in groups])
            value = probe.predict(states).double().cpu()
            spread = value * (1 - value)
            chosen = torch.topk(spread, keep).indices
        chosen = chosen.sort().values
        self._selection = {
            "kept_fraction": keep / len(groups),
            "random": float(probe is None),
            "spread_kept": float(spread[chosen].sum()) if probe is not None else 0.0,
            "spread_all": float(spread.sum()) if probe is not None else 0.0,
            "groups_kept": float(keep),
            "groups_all": float(len(groups)),
            "prefill_tokens": float(tokens),
        }
        return [row for i in chosen.tolist() for row in groups[i]]

    def _selection_metrics(self, rewards: torch.Tensor, num_generations: int) -> dict[str, float]:
        """`selection/*` of this generation batch, over all processes: kept fraction, mean predicted p(1 - p) of kept
        and of all candidates, prefill tokens, and the realized within-group reward variance and degenerate share."""
        if self.args.prompt_selection is None or not self._selection:
            return {}
        s = self._selection
        keys = ("spread_kept", "groups_kept", "spread_all", "groups_all", "prefill_tokens")
        local = torch.tensor([s[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
        total = dict(zip(keys, self.accelerator.gather(local).view(-1, len(keys)).sum(0).tolist(), strict=True))
        grouped = rewards.view(-1, num_generations).double()
        complete = torch.isfinite(grouped).all(1)
        nan = math.nan
        metrics = {
            "selection/kept_fraction": s["kept_fraction"],
            "selection/random": s["random"],
            "selection/predicted_spread": nan if s["random"] else total["spread_kept"] / total["groups_kept"],
            "selection/candidate_spread": nan if s["random"] else total["spread_all"] / total["groups_all"],
            "selection/prefill_tokens": total["prefill_tokens"],
            "selection/reward_variance": grouped[complete].var(1, unbiased=False).mean().item()
            if complete.any()
            else nan,
            "selection/degenerate_fraction": (grouped[complete].amax(1) == grouped[complete].amin(1))
            .double()
            .mean()
            .item()
            if complete.any()
            else nan,
        }
        self._selection = {}
        return metrics

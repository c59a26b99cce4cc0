"""`POISETrainer`: `GRPOTrainer` with POISE's cross-rollout internal-state baseline. The only TRL-aware module."""

import os
import textwrap
import time
from pathlib import Path
from typing import Any

import torch
import trl
from accelerate.utils import broadcast
from packaging.version import Version
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import get_config_model_id

from .baselines import baseline_diagnostics, cross_rollout_baselines, leave_one_out_targets
from .config import POISEConfig
from .features import (
    assemble_features,
    capture_layer,
    feature_spans,
    find_decoder_layers,
    pca_blocks,
    resolve_layer_index,
)
from .probe import ProbeBuffer, ValueProbe, load_probe_file, save_probe_file

TESTED_TRL = ("1.16.0", "1.17.0")  # [low, high): the GRPOTrainer internals this subclass was tested against
PROBE_FILE = "poise_probe.safetensors"

if not Version(TESTED_TRL[0]) <= Version(trl.__version__) < Version(TESTED_TRL[1]) and not os.environ.get(
    "POISE_ALLOW_UNTESTED_TRL"
):
    raise ImportError(
        f"poise-trl is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]} but trl {trl.__version__} is installed. "
        f"POISETrainer hooks GRPOTrainer internals that change between releases: install "
        f"'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}', or set POISE_ALLOW_UNTESTED_TRL=1 at your own risk."
    )


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
    `_calculate_rewards` (keep the gathered rewards), and the checkpoint pair `_save_checkpoint` /
    `_load_optimizer_and_scheduler` (probe and buffer travel with every checkpoint).
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
        self.probe_layer = resolve_layer_index(args.probe_layer, len(find_decoder_layers(base)))
        self.hidden_size = base.config.get_text_config().hidden_size
        self.marker_ids: list[int] | None = None
        if args.reasoning_end_marker is not None:
            self.marker_ids = self._tokenizer(args.reasoning_end_marker, add_special_tokens=False)["input_ids"]
            if not self.marker_ids:
                raise ValueError(f"reasoning_end_marker={args.reasoning_end_marker!r} tokenizes to no tokens.")
        pca = pca_blocks(args.probe_features, self.hidden_size, args.probe_pca_dims)
        clip = tuple(args.probe_clip_range) if args.probe_clip_range is not None else "observed"
        self.value_probe = ValueProbe(alpha=args.probe_alpha, pca_dims=pca, clip=clip)
        self.probe_buffer = ProbeBuffer(args.probe_buffer_size)
        self.probe_steps = 0  # generation steps whose examples have entered the buffer
        self.warm_started = args.probe_init_path is not None
        self._refit_from_step = 0
        if self.warm_started:
            self._load_probe(args.probe_init_path)
            self.probe_steps = 0
            if len(self.probe_buffer) == 0:  # a few new examples must not overwrite the loaded fit
                self._refit_from_step = args.probe_warmup_steps
        self.feature_passes = 0  # teacher-forced passes POISE ran itself (0 when TRL's own pass is reused)
        self._capture_armed = False
        self._captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self._gathered_rewards: torch.Tensor | None = None

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
        layer = find_decoder_layers(self.accelerator.unwrap_model(self.model))[self.probe_layer]
        kwargs["compute_entropy"] = True
        with capture_layer(layer, spans) as capture:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )
        self._captured = (assemble_features(self.args.probe_features, capture.pooled(), entropies, spans), spans)
        return logps, entropies, aux

    def _spans(self, prompt_mask, completion_ids, completion_mask):
        return feature_spans(
            prompt_mask, completion_ids, completion_mask, self.args.probe_pool_tokens, self.marker_ids
        )

    def _feature_pass(self, output: dict[str, Any], mode: str) -> None:
        """One no-grad teacher-forced pass with entropies, outside gradient checkpointing, when TRL ran none."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        self._capture_armed = True
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, output["completion_ids"].size(1), batch_size=batch_size
            )
        self.feature_passes += 1

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards = rewards_per_func
        return rewards_per_func

    # -------------------------------------------------------------------------------------------------- advantages
    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        self._captured, self._capture_armed = None, self._trl_runs_old_logps_pass()
        output = super()._generate_and_score_completions(inputs)
        self._capture_armed = False
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        if num_generations < 2:  # eval with a single generation: nothing to pair, keep TRL's advantages
            return output
        if self._captured is None:
            self._feature_pass(output, mode)
        local_features, spans = self._captured
        self._captured = None

        device = self.accelerator.device
        has_completion = self.accelerator.gather(spans.completion_mask.any(1))
        features = self.accelerator.gather(local_features.to(device))
        feature_ok = has_completion & torch.isfinite(features).all(1)
        rewards_per_func = self._gathered_rewards
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(1)
        rewards[torch.isnan(rewards_per_func).all(1) | ~torch.isfinite(rewards)] = torch.nan
        scorable = torch.isfinite(rewards)

        bootstrap = not self.value_probe.is_fitted or (
            self.probe_steps < self.args.probe_warmup_steps and not self.warm_started
        )
        values = unclipped = torch.full_like(rewards, torch.nan)
        if self.value_probe.is_fitted and feature_ok.any():
            values, unclipped = values.clone(), unclipped.clone()
            values[feature_ok], unclipped[feature_ok] = self.value_probe.predict(
                features[feature_ok], return_unclipped=True
            )
        rloo = leave_one_out_targets(rewards, num_generations, scorable)
        baselines = rloo
        if not bootstrap:
            probe_baselines = cross_rollout_baselines(values, num_generations, feature_ok)
            baselines = torch.where(torch.isnan(probe_baselines), rloo, probe_baselines)
        receives = scorable & has_completion & torch.isfinite(baselines)
        advantages = torch.where(receives, rewards - baselines, torch.zeros_like(rewards))
        if self.args.scale_rewards == "batch" and scorable.sum() > 1:
            advantages = advantages / (rewards[scorable].std() + 1e-4)

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
        metrics.update(bootstrap=float(bootstrap), feature_rows_dropped=float((has_completion & ~feature_ok).sum()))
        if mode == "train":
            metrics.update(self._update_probe(features, rloo, feature_ok & scorable))
        metrics["buffer_size"] = float(len(self.probe_buffer))
        for name, value in metrics.items():
            self._metrics[mode][f"poise/{name}"].append(value)
        return output

    def _update_probe(self, features: torch.Tensor, targets: torch.Tensor, usable: torch.Tensor) -> dict[str, float]:
        """Append this step's leave-one-out examples, refit on the whole buffer, and make every rank agree."""
        usable = usable & torch.isfinite(targets)
        self.probe_buffer.add(features[usable], targets[usable])
        self.probe_steps += 1
        if len(self.probe_buffer) < 2 or self.probe_steps < self._refit_from_step:
            return {"probe_fit_seconds": 0.0}
        start = time.perf_counter()
        device = self.accelerator.device
        self.value_probe.fit(self.probe_buffer.features.to(device), self.probe_buffer.targets.to(device))
        if self.accelerator.num_processes > 1:  # identical inputs, but broadcast so ranks agree to the bit
            for key, tensor in sorted(self.value_probe.state_dict().items()):
                self.value_probe._state[key] = broadcast(tensor.to(device), from_process=0)
        return {"probe_fit_seconds": time.perf_counter() - start}

    # -------------------------------------------------------------------------------------------------- probe files
    def _probe_metadata(self) -> dict[str, Any]:
        """What must match for a saved probe to be reused: the feature space and where the run stands."""
        base = self.accelerator.unwrap_model(self.model)
        return {
            "feature_config": {
                "probe_layer": self.probe_layer,
                "probe_pool_tokens": self.args.probe_pool_tokens,
                "probe_features": list(self.args.probe_features),
                "reasoning_end_marker": self.args.reasoning_end_marker,
                "hidden_size": self.hidden_size,
            },
            "model_name": get_config_model_id(base.config),
            "probe_steps": self.probe_steps,
        }

    def save_probe(self, path: str | os.PathLike, include_buffer: bool = True) -> None:
        """Write the probe (and its buffer) as safetensors + JSON: no pickle, so a downloaded file cannot run code."""
        buffer = self.probe_buffer if include_buffer else None
        save_probe_file(path, self.value_probe, buffer, self._probe_metadata())

    def _load_probe(self, path: str | os.PathLike) -> None:
        probe, buffer, info = load_probe_file(path)
        expected = self._probe_metadata()["feature_config"]
        if info.get("feature_config") != expected:
            raise ValueError(
                f"The probe in {path} was fitted on features {info.get('feature_config')}, but this run extracts "
                f"{expected}. Resume with the same probe_layer/probe_pool_tokens/probe_features/"
                "reasoning_end_marker and model, or start a fresh run."
            )
        self.value_probe = probe
        self.probe_buffer = ProbeBuffer(self.args.probe_buffer_size)
        if buffer is not None and len(buffer):  # keep this run's capacity: the newest rows survive
            self.probe_buffer.add(buffer.features, buffer.targets)
        self.probe_steps = int(info["probe_steps"])

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            self.save_probe(Path(self._get_output_dir(trial=trial)) / checkpoint_folder / PROBE_FILE)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and (Path(checkpoint) / PROBE_FILE).exists():
            self._load_probe(Path(checkpoint) / PROBE_FILE)
